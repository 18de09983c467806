"""One rank of a run: set-up (`rank`), data, the training loop, validation, checkpoints,
metrics, progress, the final sample, the run folder's protection, fault injection."""
