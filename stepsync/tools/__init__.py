"""The command line (check, inspect, demo), its input files, the checkpoint audit, and the tiny real run that
the demo, the notebook and the benchmark train."""
