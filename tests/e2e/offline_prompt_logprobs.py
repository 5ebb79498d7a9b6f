"""Reference prompt logprobs: vLLM's offline LLM.generate with ``prompt_logprobs`` on
token-id prompts (run as a script)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    request = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], enforce_eager=True, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params)
    scored = [
        [
            None if lps is None else lps[token].logprob
            for token, lps in zip(o.prompt_token_ids, o.prompt_logprobs, strict=True)
        ]
        for o in outputs
    ]
    print("RESULT " + json.dumps(scored))


if __name__ == "__main__":
    main()
