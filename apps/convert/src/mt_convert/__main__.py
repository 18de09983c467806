"""``python -m mt_convert SRC DST ...``: same as ``mt convert``."""

from mt_convert.cli import main

if __name__ == "__main__":
    main()
