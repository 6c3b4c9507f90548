"""``python -m snn_explorer.cli``: the ``snn-explorer`` console script."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
