"""Vocabulary shared by every core group: names, validation, serialization, topology, modes, precision."""
