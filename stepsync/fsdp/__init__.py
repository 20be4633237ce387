"""stepsync for torch-native loops whose model is sharded with FSDP2 (``fully_shard``): ``stepsync.watch(model,
optimizer=...)``."""
