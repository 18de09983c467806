"""mt-pretrain: `mt pretrain` and the root `mt` command line."""

__version__ = "0.1.0"
