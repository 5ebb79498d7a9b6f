"""Greedy reference: vLLM's offline LLM.generate on token-id prompts (run as a script)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    request = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], enforce_eager=True, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=request["max_tokens"])
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))


if __name__ == "__main__":
    main()
