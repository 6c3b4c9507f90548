"""Memory levers: activation checkpointing, blocks and time chunks, offload, spike compression."""
