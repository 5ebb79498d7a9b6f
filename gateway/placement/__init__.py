"""Placement: which worker's job stream a new job goes to (its prefix cache, its load)."""
