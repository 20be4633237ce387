"""What runs inside training: finding and steering the engine, the run's state, the policies, the
Trainer callback, the custom-loop watch, and stepsync's record in checkpoints."""
