"""What the tests share: real tiny runs with an independent recorder, custom loops, the stack under test,
the brute-force simulation, pairwise cases, the CI matrix, and the command line run as a user runs it."""
