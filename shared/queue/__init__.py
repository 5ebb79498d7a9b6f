"""Everything Conveyor keeps in Redis: stream and key names, the job queue, liveness, limits,
usage, media and the LoRA registry.
"""
