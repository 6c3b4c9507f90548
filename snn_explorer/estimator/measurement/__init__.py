"""Measurement: plans run on real ranks, their per-rank memory, collectives and step time."""
from .fake_ranks import record_collectives
from .plan_measurement import PlanMeasurement, measure, measure_many

__all__ = ["PlanMeasurement", "measure", "measure_many", "record_collectives"]
