"""Tensor parallelism: the style of each layer, its torch implementation, and the per-layer TP plan."""
