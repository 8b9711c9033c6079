"""The planner (offload.plan) on ref-8L."""
