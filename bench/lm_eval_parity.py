"""lm-evaluation-harness against Conveyor and against ``vllm serve`` on the same model.

Two local tasks (``tests/e2e/lm_eval_tasks``, nothing downloaded): ``conveyor_mc``, a
multiple-choice log-likelihood task run with ``local-completions`` (token-id prompts,
``echo``, ``logprobs``), and ``conveyor_gen``, a greedy generation task run with
``local-chat-completions`` (the chat template applied by the server). Each server gets
the same requests (same seed); the scores and every sample's answer must be equal
(log-likelihoods within ``LOGLIKELIHOOD_TOLERANCE``).

    python -m bench.lm_eval_parity [--limit N]

starts ``conveyor up`` and ``vllm serve`` on the generated demo model (CPU), one after
the other, and prints each task's score and the samples that differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TASKS_DIR = Path(__file__).resolve().parents[1] / "tests" / "e2e" / "lm_eval_tasks"
LOGLIKELIHOOD = "conveyor_mc"
GENERATION = "conveyor_gen"
LOGLIKELIHOOD_TOLERANCE = 1e-4
SEED = 1234


@dataclass(frozen=True)
class TaskRun:
    """One task's score and, by doc id: each sample's answers (the log-likelihood of every
    choice, or the generated text) and requests (the ``(context ids, continuation ids)``
    of every choice as lm-eval tokenized them, or the chat messages it sent)."""

    score: float
    answers: dict[int, list[Any]]
    requests: dict[int, list[Any]]
    targets: dict[int, Any]


def task_config(name: str) -> dict[str, Any]:
    """The task's YAML with its data file made absolute (runs from any folder)."""
    config: dict[str, Any] = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    for split, path in files.items():
        files[split] = str(TASKS_DIR / Path(path).name)
    return config


def evaluate(
    base_url: str, model: str, tokenizer: Path, *, limit: int | None = None
) -> dict[str, TaskRun]:
    """Both tasks against the server at ``base_url`` (no ``/v1``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    completions = LocalCompletionsAPI(
        model=model,
        base_url=f"{base_url}/v1/completions",
        tokenizer=str(tokenizer),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        max_retries=1,
    )
    chat = LocalChatCompletion(
        model=model,
        base_url=f"{base_url}/v1/chat/completions",
        tokenizer_backend=None,
        tokenized_requests=False,
        max_retries=1,
    )
    return {
        LOGLIKELIHOOD: _run(completions, LOGLIKELIHOOD, limit, chat_template=False),
        GENERATION: _run(chat, GENERATION, limit, chat_template=True),
    }


def _run(lm: Any, task: str, limit: int | None, *, chat_template: bool) -> TaskRun:
    from lm_eval import evaluator  # heavy (datasets, torch): only when a run is asked for

    results = evaluator.simple_evaluate(
        model=lm,
        tasks=[task_config(task)],
        limit=limit,
        log_samples=True,
        apply_chat_template=chat_template,
        random_seed=SEED,
        numpy_random_seed=SEED,
        torch_random_seed=SEED,
        fewshot_random_seed=SEED,
        bootstrap_iters=0,
    )
    assert results is not None
    metric = "acc,none" if task == LOGLIKELIHOOD else "exact_match,none"
    samples = results["samples"][task]
    return TaskRun(
        score=float(results["results"][task][metric]),
        answers={s["doc_id"]: [_answer(r) for r in s["filtered_resps"]] for s in samples},
        requests={s["doc_id"]: _requests(lm, s["arguments"], task) for s in samples},
        targets={s["doc_id"]: s["target"] for s in samples},
    )


def _answer(resp: Any) -> Any:
    """A log-likelihood response is ``(loglikelihood, is_greedy)``; a generation, text."""
    if isinstance(resp, (list, tuple)):
        return float(resp[0])
    return resp


def _requests(lm: Any, arguments: Any, task: str) -> list[Any]:
    """Each request's arguments: log-likelihood pairs tokenized as lm-eval sends them."""
    rows = list(arguments.values()) if isinstance(arguments, dict) else list(arguments)
    args = [list(row.values()) if isinstance(row, dict) else list(row) for row in rows]
    if task == LOGLIKELIHOOD:
        return [list(lm._encode_pair(context, continuation)) for context, continuation in args]
    return [json.loads(_first_text(row)) for row in args]


def _first_text(value: Any) -> str:
    """A generation request's context: the chat messages as JSON text (however nested)."""
    while not isinstance(value, str):
        value = value[0]
    return value


def to_json(runs: dict[str, TaskRun]) -> dict[str, Any]:
    return {task: dataclasses.asdict(run) for task, run in runs.items()}


def differences(ours: dict[str, TaskRun], theirs: dict[str, TaskRun]) -> list[str]:
    """What differs between two servers' runs (empty: the same scores and answers)."""
    found: list[str] = []
    for task, run in ours.items():
        other = theirs[task]
        if run.score != other.score:
            found.append(f"{task}: score {run.score} != {other.score}")
        for doc, answer in run.answers.items():
            if not _same(answer, other.answers.get(doc)):
                found.append(f"{task} doc {doc}: {answer!r} != {other.answers.get(doc)!r}")
    return found


def _same(a: list[Any], b: list[Any] | None) -> bool:
    if b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, float) and isinstance(y, float):
            if abs(x - y) > LOGLIKELIHOOD_TOLERANCE:
                return False
        elif x != y:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="docs per task (default: all)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/7")
    parser.add_argument("--url", help="evaluate this running server only (no comparison)")
    parser.add_argument("--model", default="tiny", help="served model name (with --url)")
    parser.add_argument("--tokenizer", type=Path, help="the model's folder (with --url)")
    parser.add_argument("--json-out", type=Path, help="write the runs as JSON")
    args = parser.parse_args()
    if args.url is not None:
        runs = {"server": evaluate(args.url, args.model, args.tokenizer, limit=args.limit)}
    else:
        runs = _both_servers(args.redis_url, args.limit)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({name: to_json(run) for name, run in runs.items()}))
    for task in (LOGLIKELIHOOD, GENERATION):
        scores = ", ".join(f"{name} {run[task].score:.4f}" for name, run in runs.items())
        print(f"{task}: {scores} ({len(next(iter(runs.values()))[task].answers)} docs)")
    if len(runs) < 2:
        return
    found = differences(runs["conveyor"], runs["vllm"])
    for line in found:
        print("DIFFERS", line)
    print("equal" if not found else f"{len(found)} difference(s)")
    sys.exit(1 if found else 0)


def _both_servers(redis_url: str, limit: int | None) -> dict[str, dict[str, TaskRun]]:
    """``conveyor up`` then ``vllm serve`` on the demo model, each evaluated in turn."""
    from bench.servers import conveyor_server, running, vllm_server
    from shared.demo.model import write_demo_model

    work = Path(tempfile.mkdtemp(prefix="lm-eval-parity-"))
    model = write_demo_model(work / "demo")
    servers = {
        "conveyor": conveyor_server(model, "tiny", redis_url, "float32", 8, work),
        "vllm": vllm_server(model, "tiny", "float32", 8, work),
    }
    runs: dict[str, dict[str, TaskRun]] = {}
    for name, server in servers.items():
        with running(server, 600) as up:
            runs[name] = evaluate(up.base_url, "tiny", model, limit=limit)
    return runs


if __name__ == "__main__":
    main()
