"""A worker's health: its heartbeat and status, the engine monitor, and the idle canary."""
