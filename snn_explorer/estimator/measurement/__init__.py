"""Measurement: plans run on real ranks, their per-rank memory, collectives and step time."""
from .fake_ranks import FakeRankStep, record_rank_step
from .plan_measurement import PlanMeasurement, measure, measure_many

__all__ = ["FakeRankStep", "PlanMeasurement", "measure", "measure_many", "record_rank_step"]
