"""Intake: reading jobs off the streams, the checks before one runs, and reclaiming the jobs of
dead workers.
"""
