"""The pure core: release rules, closed-form counting, the forecast, its wording, the report, the errors and
the checkpoint record. Imports neither torch, transformers, accelerate, deepspeed nor rich, and nothing from
the rest of stepsync."""
