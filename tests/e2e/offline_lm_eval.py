"""Reference for the lm-eval test: vLLM's offline LLM.generate on token-id prompts, one
model load for both tasks (run as a script). ``scored``: each prompt's prompt logprobs
(None for the first token); ``generate``: each prompt's greedy text, cut at ``stop``."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    request = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], enforce_eager=True, dtype="float32")
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["scored"]], scoring)
    scored = [
        [
            None if lps is None else lps[token].logprob
            for token, lps in zip(o.prompt_token_ids, o.prompt_logprobs, strict=True)
        ]
        for o in outputs
    ]
    greedy = SamplingParams(
        temperature=0, max_tokens=request["max_tokens"], stop=request["stop"], seed=request["seed"]
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["generate"]], greedy)
    generated = [o.outputs[0].text for o in outputs]
    print("RESULT " + json.dumps({"scored": scored, "generated": generated}))


if __name__ == "__main__":
    main()
