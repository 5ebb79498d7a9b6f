"""Reaching Redis: URLs (plain or Sentinel), connections, the pool, retries, and which Redis
holds a model.
"""
