"""The pure core: release rules, closed-form counting, the forecast and the report. Imports neither torch,
transformers, deepspeed nor rich, and nothing from the rest of stepsync."""
