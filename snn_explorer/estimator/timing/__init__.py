"""The time model: hardware profiles, compute work, collectives, step and pipeline time."""
from .hardware import HardwareProfile, hardware_profile, hardware_profiles

__all__ = ["HardwareProfile", "hardware_profile", "hardware_profiles"]
