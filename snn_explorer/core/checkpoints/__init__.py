"""Distributed checkpoints: files, integrity, the writer lock, tensors, save and load."""
