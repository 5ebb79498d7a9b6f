"""Generated demo models (random weights, a locally trained tokenizer). Only the CLI, tests and
benchmarks import these.
"""
