"""The command line (check, inspect, demo), its input files, the checkpoint audit, and the harness
that the tests, the demo and the benchmark run real tiny trainings with."""
