"""The run journal: who owns a running job, what it has emitted, and its events, written
atomically.
"""
