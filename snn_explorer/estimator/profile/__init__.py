"""The profile: what runs of the model as one rank runs it measure (saved tensors, neuron state,
operators, FSDP2 events), fitted over batch and time steps."""
from .profiling import ModelProfile, model_profile

__all__ = ["ModelProfile", "model_profile"]
