"""Finding and steering DeepSpeed's engine, and the run object every framework adapter drives: positions,
the policies, the checks and the report. Imports no training framework."""
