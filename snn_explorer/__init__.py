"""snn_explorer: analyze, plan and apply distribution strategies for spiking neural networks."""
from .core import *  # noqa: F401,F403
from .core import __all__ as _core_all
from .explorer import Explorer

__version__ = "0.1.0"
__all__ = list(_core_all) + ["Explorer"]
