"""The SGLang engine (GPU hosts): the only package that imports sglang."""
