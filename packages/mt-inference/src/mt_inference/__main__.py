"""``python -m mt_inference eval|generate|serve|bias ...``: the same as `mt eval` ... (for an
install without the `mt` command, mt-pretrain)."""

from mt_inference.cli import main

if __name__ == "__main__":
    main()
