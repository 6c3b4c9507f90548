"""The memory model: shard arithmetic of parameters, gradients and optimizer state, the step's
dynamic peak (FSDP2's buffers replayed on it), pipeline stages' memory, activation curves."""
