"""What reaches a worker beside its jobs: cancels, admin commands (drain, resume, clear KV,
sleep, wake) and the desired LoRA adapters.
"""
