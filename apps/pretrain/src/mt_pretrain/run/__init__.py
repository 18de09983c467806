"""One rank of a run: set-up (`rank`), the training loop (`train`), validation, metrics,
progress, the final sample, and the run folder's protection."""
