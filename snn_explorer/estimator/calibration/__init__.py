"""Calibration: this machine measured into a :class:`~..timing.hardware.HardwareProfile`."""
from .this_machine import calibrate, default_hardware, resolve_hardware

__all__ = ["calibrate", "default_hardware", "resolve_hardware"]
