"""Measurement: plans run on real ranks, their per-rank memory, collectives and step time."""
from .plan_measurement import PlanMeasurement, measure, measure_many

__all__ = ["PlanMeasurement", "measure", "measure_many"]
