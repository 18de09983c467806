"""``python -m mt_pretrain ...``: same as the ``mt`` command."""

from mt_pretrain.cli.app import main

if __name__ == "__main__":
    main()
