"""The encode role's engine: a vision encoder and the cache of its embeddings."""
