"""LoRA adapters on the engine side: checking a PEFT folder, and gating how many run at once."""
