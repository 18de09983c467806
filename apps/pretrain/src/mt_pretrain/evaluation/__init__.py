"""Zero- and few-shot evaluation of mt models (`mt eval`, `mt pretrain --eval-task`):
mt-eval's tasks and metrics, scored by this app's pipeline stages at any layout."""
