"""Calibration: this machine measured into a :class:`~..timing.hardware.HardwareProfile`."""
from .this_machine import cached_hardware, calibrate, default_hardware, resolve_hardware

__all__ = ["cached_hardware", "calibrate", "default_hardware", "resolve_hardware"]
