"""The adapter for transformers' Trainer: ``StepSyncCallback`` and what it must know of the Trainer."""
