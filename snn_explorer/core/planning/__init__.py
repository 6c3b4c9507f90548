"""From an analysis to a plan: pipeline layout and schedules, recommendation, plan types, planner."""
