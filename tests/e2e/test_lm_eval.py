"""lm-evaluation-harness against the gateway: ``local-completions`` on a log-likelihood
task and ``local-chat-completions`` on a generation task (bench/lm_eval_parity.py, on a
few docs of tests/e2e/lm_eval_tasks), checked against vLLM's offline engine on the
same model: every choice's log-likelihood, the accuracy lm-eval derives from them, and
every generated text. (``python -m bench.lm_eval_parity`` compares with ``vllm serve``
on all the docs; see docs/features/lm-eval.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.lm_eval_parity import GENERATION, LOGLIKELIHOOD, SEED
from tests.e2e.conftest import Running
from tests.e2e.reference import OfflineReference

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DOCS_PER_TASK = 3
MAX_GEN_TOKENS, STOP = 8, ["\n"]
"""As conveyor_gen.yaml's generation_kwargs."""


def lm_eval_runs(running: Running, out: Path) -> dict[str, Any]:
    """The harness in its own process (its imports and warnings stay out of pytest's)."""
    command = [
        sys.executable, "-m", "bench.lm_eval_parity", "--url", running.base_url,
        "--model", running.model, "--tokenizer", str(running.stack.model_path),
        "--limit", str(DOCS_PER_TASK), "--json-out", str(out),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs: dict[str, Any] = json.loads(out.read_text())["server"]
    return runs


def chat_prompt(running: Running, messages: list[dict[str, str]]) -> list[int]:
    """The prompt a chat completion of ``messages`` runs (POST /tokenize renders it the
    same way)."""
    body = {"model": running.model, "messages": messages}
    response = httpx.post(f"{running.base_url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


@pytest.mark.timeout(900)  # a harness process and an offline engine: minutes on a busy box
def test_lm_eval_scores_equal_offline_vllm(
    offline: OfflineReference, running: Running, tmp_path: Path
) -> None:
    started = time.monotonic()
    runs = lm_eval_runs(running, tmp_path / "runs.json")
    harness_s = time.monotonic() - started
    scored, generated = runs[LOGLIKELIHOOD], runs[GENERATION]
    docs = sorted(scored["requests"], key=int)
    assert len(docs) == DOCS_PER_TASK
    pairs = [pair for doc in docs for pair in scored["requests"][doc]]
    chats = sorted(generated["requests"], key=int)
    reference = offline.ask(
        "lm_eval",
        scored=[context + continuation for context, continuation in pairs],
        generate=[chat_prompt(running, generated["requests"][d][0]) for d in chats],
        max_tokens=MAX_GEN_TOKENS,
        stop=STOP,
        seed=SEED,
    )
    print(f"lm-eval: {harness_s:.1f}s; offline vLLM: {time.monotonic() - started - harness_s:.1f}s")
    theirs = iter(reference["scored"])
    correct = 0
    for doc in docs:
        expected = [sum(next(theirs)[len(context) :]) for context, _ in scored["requests"][doc]]
        assert scored["answers"][doc] == pytest.approx(expected, abs=1e-4), doc
        correct += expected.index(max(expected)) == int(scored["targets"][doc])
    assert scored["score"] == pytest.approx(correct / len(docs))
    for doc, text in zip(chats, reference["generated"], strict=True):
        assert generated["answers"][doc] == [text], doc
