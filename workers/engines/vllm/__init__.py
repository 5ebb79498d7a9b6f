"""The vLLM engine: the only package that imports vllm."""
