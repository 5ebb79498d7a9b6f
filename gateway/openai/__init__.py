"""OpenAI's vocabulary: wire schemas, response objects, and parsers of a model's output. Pure:
imports nothing else of the gateway.
"""
