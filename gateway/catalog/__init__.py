"""The models this gateway serves: their tokenizers, chat templates, context windows and LoRA
adapters.
"""
