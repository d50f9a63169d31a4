"""``python -m exactness``: the command line (receipt/cli.py)."""
import sys

from .receipt.cli import main

if __name__ == "__main__":
    sys.exit(main())
