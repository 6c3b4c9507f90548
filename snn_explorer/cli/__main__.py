"""``python -m snn_explorer.cli``: the ``snn-explorer`` console script."""
import sys

from . import main

if __name__ == "__main__":  # importing this module (pkgutil.walk_packages does) runs nothing
    sys.exit(main())
