"""Instruments: what watches a run of the model (storage meters, saved-tensor and collective
recorders, operator counters) and keeps a run from disturbing its caller (isolation)."""
