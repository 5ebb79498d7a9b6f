"""The fake engine: no model, the same engine interface as vLLM (``--engine fake``).

A step loop with a time model (:mod:`.scheduler`), a prefix-cached KV of fixed size that
publishes vLLM's KV events (:mod:`.kv_cache`, :mod:`.events`) and deterministic token
choice (:mod:`.tokens`). It is for load tests and fleet-size routing tests: its output
is not a model's.
"""
