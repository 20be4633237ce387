"""The adapter for a loop that drives DeepSpeed's engine itself: ``stepsync.watch(engine)``."""
