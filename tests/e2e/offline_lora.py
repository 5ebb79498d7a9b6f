"""Greedy reference with LoRA: vLLM's offline LLM.generate, one LoRARequest per adapter
(run as a script; stdin: {"model", "prompts", "max_tokens", "adapters": {name: path}}).

Prints ``RESULT {"base": [[ids], ...], name: [[ids], ...], ...}``: each prompt alone
(batch of one), as a single-request reference.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    request = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    adapters = request["adapters"]
    llm = LLM(
        model=request["model"],
        enforce_eager=True,
        dtype="float32",
        enable_lora=True,
        max_loras=max(1, len(adapters)),
        max_lora_rank=8,
    )
    params = SamplingParams(temperature=0, max_tokens=request["max_tokens"])
    loras: dict[str, LoRARequest | None] = {"base": None}
    for number, (name, path) in enumerate(sorted(adapters.items()), start=1):
        loras[name] = LoRARequest(name, number, path)
    result = {}
    for name, lora in loras.items():
        result[name] = [
            list(
                llm.generate(
                    [{"prompt_token_ids": prompt}], params, lora_request=lora, use_tqdm=False
                )[0]
                .outputs[0]
                .token_ids
            )
            for prompt in request["prompts"]
        ]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
