"""References from vLLM's offline engine, one model load for the whole test session (run as a
script: ``offline_reference.py MODEL``; tests/e2e/reference.py drives it).

Each stdin line is one task, JSON with a ``kind``; each answer is one JSON line on the
result pipe (fd 1 as the script started). The prefix cache is emptied before every task,
so each task sees the engine as a fresh ``LLM(...)`` would. All tasks take token-id prompts:

- ``generate`` (``prompts``, ``max_tokens``): each prompt's greedy token ids.
- ``prompt_logprobs`` (``prompts``): each prompt token's logprob (None for the first).
- ``lm_eval`` (``scored``, ``generate``, ``max_tokens``, ``stop``, ``seed``): ``scored``
  as prompt_logprobs, ``generated`` each prompt's greedy text, cut at ``stop``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

Prompts = list[list[int]]


def generate(llm: LLM, task: dict[str, Any]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=task["max_tokens"])
    outputs = llm.generate(prompts(task["prompts"]), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def prompt_logprobs(llm: LLM, task: dict[str, Any]) -> list[list[float | None]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompts(task["prompts"]), params, use_tqdm=False)
    return [
        [
            None if lps is None else lps[token].logprob
            for token, lps in zip(o.prompt_token_ids or [], o.prompt_logprobs or [], strict=True)
        ]
        for o in outputs
    ]


def lm_eval(llm: LLM, task: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    scored = prompt_logprobs(llm, {"prompts": task["scored"]})
    greedy = SamplingParams(
        temperature=0, max_tokens=task["max_tokens"], stop=task["stop"], seed=task["seed"]
    )
    outputs = llm.generate(prompts(task["generate"]), greedy, use_tqdm=False)
    return {"scored": scored, "generated": [o.outputs[0].text for o in outputs]}


TASKS: dict[str, Callable[[LLM, dict[str, Any]], Any]] = {
    "generate": generate,
    "prompt_logprobs": prompt_logprobs,
    "lm_eval": lm_eval,
}


def prompts(token_ids: Prompts) -> list[Any]:
    return [{"prompt_token_ids": p} for p in token_ids]


def main() -> None:
    # vLLM logs to stdout: results get the original fd 1, everything else goes to stderr.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32")
    for line in sys.stdin:
        task = json.loads(line)
        llm.reset_prefix_cache()
        results.write(json.dumps(TASKS[task["kind"]](llm, task)) + "\n")
        results.flush()


if __name__ == "__main__":
    main()
