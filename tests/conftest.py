import os
import sys

# Make helper modules in tests/ (e.g. distributed_harness) importable from test files.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# estimate() without hardware= would calibrate this machine on spawned ranks (seconds, and timing
# noise on a shared machine); tests predict step time on a datasheet profile unless they pass one.
os.environ.setdefault("SNN_EXPLORER_HARDWARE", "A100-SXM-80GB")
