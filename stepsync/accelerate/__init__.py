"""The adapter for custom accelerate loops: :func:`watch`."""
