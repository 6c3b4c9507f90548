"""``python -m snn_explorer.cli``: the ``snn-explorer`` console script."""
import sys

from . import main

sys.exit(main())
