"""Cluster simulation and the planner: the engine's own Scheduler and BlockManager driven by
simulated time, a roofline cost model in place of the model runner (no torch)."""
