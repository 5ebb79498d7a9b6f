"""Load benchmark: Conveyor against vLLM's own OpenAI server (``python -m bench.bench``)."""
