"""Image inputs of chat requests: found, fetched (SSRF-guarded), checked and stored for the
workers.
"""
