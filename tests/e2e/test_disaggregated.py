"""Disaggregated serving: a prefill worker hands the KV cache to a decode worker (NIXL)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest

from tests.e2e.conftest import Running
from tests.e2e.stack import Process, Stack, stop_together, wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

PD_MODEL = "tiny-pd"
SHORT = [1, *range(300, 340)]  # 41 tokens: under one 128-token block, skips prefill
LONG = [1, *range(1000, 1300)]  # 301 tokens: two full blocks
LONGER = [1, *range(200, 900)]  # 701 tokens: five full blocks


@dataclass(frozen=True)
class Disaggregated:
    base_url: str
    prefill: Process
    decode: Process


@pytest.fixture(scope="module")
def pd(running: Running) -> Iterator[Disaggregated]:
    stack: Stack = running.stack
    env = {"CONVEYOR_SERVED_MODEL_NAME": PD_MODEL}
    prefill = stack.start_worker("prefill", role="prefill", **env)
    decode = stack.start_worker("decode", role="decode", **env)
    gateway, url = stack.start_gateway("gateway-pd", **env)
    wait_until(f"{url}/ready", status=200, process=gateway, timeout_s=600)
    _GATEWAY_URL[:] = [url]
    _REDIS_URL[:] = [stack.redis_url]
    _wait_for_roles(running, {"prefill", "decode"}, [prefill, decode])
    yield Disaggregated(url, prefill, decode)
    # Stop every P/D process here, replacements included, so later modules get the
    # CPU and memory back.
    stop_together([gateway, *_RESTARTED, decode, prefill])


_GATEWAY_URL: list[str] = []
_REDIS_URL: list[str] = []
_RESTARTED: list[Process] = []


def _gateway_sees(roles: set[str]) -> bool:
    """The gateway refreshes its worker list every second: wait until it has them too."""
    pools = httpx.get(f"{_GATEWAY_URL[0]}/admin/state", timeout=10).json()["pools"]
    return all(pools.get(PD_MODEL, {}).get(role) for role in roles)


def _wait_for_roles(running: Running, roles: set[str], processes: list[Process]) -> None:
    import json
    import time

    import redis

    from shared.queue import names

    client = redis.Redis.from_url(running.stack.redis_url)
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            for process in processes:
                assert process.popen.poll() is None, process.log_tail()
            live, registered = set(), set()
            for key in client.scan_iter(names.WORKER_HEARTBEAT_PATTERN):
                value = client.get(key)
                worker = json.loads(value) if value else {}
                if worker.get("model") == PD_MODEL:
                    live.add(worker.get("role"))
                    registered.add(str(worker.get("worker_id")))
            # These very processes (not a killed one whose key has not expired yet).
            ours = all(any(f"-{p.popen.pid}-" in w for w in registered) for p in processes)
            if roles <= live and ours and _gateway_sees(roles):
                return
            time.sleep(0.5)
    finally:
        client.close()
    raise TimeoutError(f"roles {roles} not all live")


def _counts(usage: object) -> dict[str, object]:
    """Usage without ``prompt_tokens_details``: prefix-cache hits differ between engines."""
    assert isinstance(usage, dict)
    return {name: usage[name] for name in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _complete(base_url: str, model: str, prompt: list[int], **extra: object) -> dict[str, object]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.parametrize("prompt", [SHORT, LONG, LONGER], ids=["short", "2-blocks", "5-blocks"])
def test_greedy_tokens_match_aggregated(
    pd: Disaggregated, running: Running, prompt: list[int]
) -> None:
    ours = _complete(pd.base_url, PD_MODEL, prompt, logprobs=2)
    reference = _complete(running.base_url, running.model, prompt, logprobs=2)
    assert ours["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]  # type: ignore[index]
    assert _counts(ours["usage"]) == _counts(reference["usage"])
    ours_lp = ours["choices"][0]["logprobs"]["token_logprobs"]  # type: ignore[index]
    ref_lp = reference["choices"][0]["logprobs"]["token_logprobs"]  # type: ignore[index]
    assert ours_lp == pytest.approx(ref_lp, abs=1e-3)


def test_long_prompt_goes_through_prefill(pd: Disaggregated) -> None:
    _complete(pd.base_url, PD_MODEL, LONGER)
    assert "handed to decode" in pd.prefill.log_path.read_text()


def test_stop_and_n_match_aggregated(pd: Disaggregated, running: Running) -> None:
    full = _complete(running.base_url, running.model, LONG)
    text = str(full["choices"][0]["text"])  # type: ignore[index]
    stop = text[len(text) // 2 :][:3]
    ours = _complete(pd.base_url, PD_MODEL, LONG, stop=[stop], n=2)
    reference = _complete(running.base_url, running.model, LONG, stop=[stop], n=2)
    assert [c["text"] for c in ours["choices"]] == [c["text"] for c in reference["choices"]]  # type: ignore[attr-defined]
    assert all(c["finish_reason"] == "stop" for c in ours["choices"])  # type: ignore[attr-defined]


def test_stream_through_prefill_and_decode(pd: Disaggregated, running: Running) -> None:
    reference = _complete(running.base_url, running.model, LONG)
    with httpx.stream(
        "POST",
        f"{pd.base_url}/v1/completions",
        timeout=300,
        json={
            "model": PD_MODEL,
            "prompt": LONG,
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        },
    ) as response:
        import json

        tokens: list[int] = []
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens.extend(choice.get("token_ids") or [])
    assert tokens == reference["choices"][0]["token_ids"]  # type: ignore[index]


def _decode_stats(running: Running) -> tuple[int, int]:
    import json

    import redis

    from shared.queue import names

    client = redis.Redis.from_url(running.stack.redis_url)
    try:
        for key in client.scan_iter(names.WORKER_HEARTBEAT_PATTERN):
            value = client.get(key)
            worker = json.loads(value) if value else {}
            if worker.get("model") == PD_MODEL and worker.get("role") == "decode":
                return int(worker["prompt_tokens_computed"]), int(
                    worker["prompt_tokens_transferred"]
                )
    finally:
        client.close()
    raise AssertionError("no decode worker registered")


def _decode_stats_after(running: Running, before: tuple[int, int]) -> tuple[int, int]:
    """The decode worker's counters once its heartbeat has carried the last request's."""
    deadline = time.monotonic() + 15
    while True:
        time.sleep(1.0)
        after = _decode_stats(running)
        if after != before or time.monotonic() > deadline:
            return after


def _transfer_log(pd: Disaggregated) -> str:
    lines = pd.decode.log_path.read_text(errors="replace").splitlines()
    wanted = ("nixl", "transfer", "recompute", "fail")
    return "\n".join(line for line in lines if any(w in line.lower() for w in wanted))[-3000:]


def test_decode_engine_never_computed_the_prompt(pd: Disaggregated, running: Running) -> None:
    # NIXL may fail a transfer on a starved CPU; decode then recomputes by design
    # (kv_load_failure_policy="recompute"), so a second fresh prompt gets one more try.
    failures = []
    for first in (1500, 3300):
        before = _decode_stats(running)
        prompt = [1, *range(first, first + 600)]  # 601 tokens, never seen (no prefix-cache hit)
        _complete(pd.base_url, PD_MODEL, prompt)
        after = _decode_stats_after(running, before)
        transferred, computed = after[1] - before[1], after[0] - before[0]
        if transferred >= 512:
            assert computed < 128, "decode recomputed the prompt"
            return
        failures.append(f"{before=} {after=}")
    raise AssertionError(f"the KV cache did not move: {failures}\n{_transfer_log(pd)}")


def _pd_workers(running: Running) -> list[dict[str, object]]:
    import json

    import redis

    from shared.queue import names

    client = redis.Redis.from_url(running.stack.redis_url)
    try:
        found = list(client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))
        workers = [json.loads(v) for v in client.mget(found) if v] if found else []
        return [w for w in workers if w.get("model") == PD_MODEL]
    finally:
        client.close()


def _pd_queues(running: Running) -> dict[str, tuple[int, int]]:
    import redis

    from shared.queue import names

    client = redis.Redis.from_url(running.stack.redis_url)
    try:
        state = {}
        for role in ("prefill", "decode"):
            stream = names.job_stream(PD_MODEL, role)
            pending = client.xpending(stream, names.JOB_GROUP)["pending"]
            state[role] = (int(client.xlen(stream)), int(pending))
        return state
    finally:
        client.close()


def _pd_idle(running: Running) -> bool:
    workers = _pd_workers(running)
    idle = all(w["active"] == 0 and w["engine_running"] == 0 for w in workers)
    queues_empty = all(state == (0, 0) for state in _pd_queues(running).values())
    return bool(workers) and idle and queues_empty


def _cpu_s(processes: list[psutil.Process]) -> dict[str, float]:
    seconds = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            seconds[f"{process.name()}[{process.pid}]"] = times.user + times.system
    return seconds


def _idle_cores(roots: list[Process], seconds: float) -> tuple[float, dict[str, float]]:
    """CPU of the workers' whole process trees (engine core and model worker included):
    cores busy in all, and per process."""
    trees = []
    for root in roots:
        process = psutil.Process(root.popen.pid)
        trees += [process, *process.children(recursive=True)]
    before, started = _cpu_s(trees), time.monotonic()
    time.sleep(seconds)
    after, wall = _cpu_s(trees), time.monotonic() - started
    each = {name: round((after[name] - before.get(name, 0.0)) / wall, 3) for name in after}
    return sum(each.values()), each


def test_idle_engines_do_not_spin(pd: Disaggregated, running: Running) -> None:
    """Idle prefill and decode workers leave the CPU alone. NIXL's UCX progress thread
    used to busy-poll a core per engine forever (poll timeout 0), idle or not, and a
    separate model-worker process spun for 1 s after every step (each idle canary)."""
    _complete(pd.base_url, PD_MODEL, [1, *range(3400, 3701)])  # a transfer: agents connected
    _eventually(lambda: _pd_idle(running), "both stages to be idle", timeout_s=60)
    # An idle worker's canary makes an engine step every 10 s (and with
    # --cpu-engine-in-process off, vLLM's model worker then spins for 1 s): one quiet
    # 3-s window of several is enough. (This runs before the disconnect test: a prefill
    # engine keeps stepping while it holds KV for a handoff decode dropped, until the
    # 30-s KV lease expires.)
    samples = []
    for _ in range(8):
        time.sleep(1.5)
        cores, each = _idle_cores([pd.prefill, pd.decode], 3.0)
        samples.append(round(cores, 3))
        if cores < 0.2:
            return
    raise AssertionError(f"idle P/D workers kept the CPU busy: {samples} cores; last: {each}")


def test_client_disconnect_aborts_both_stages(pd: Disaggregated, running: Running) -> None:
    """A burst of long prompts whose clients leave at once: prefills still running are
    aborted in the prefill engine, handed-off ones are dropped or aborted in decode,
    and nothing is left in either stage long before the work could have finished."""
    prefill_aborts = pd.prefill.log_path.read_text().count("client disconnected")
    decode_finishes = pd.decode.log_path.read_text().count("finished (length)")
    # 1,201-token prompts that share no prefix, so each prefill is real work; 800
    # tokens each would keep decode busy for several seconds.
    prompts = [[1, 10 + k, *range(100, 1299)] for k in range(24)]

    def leave_early(prompt: list[int]) -> None:
        body = {"model": PD_MODEL, "prompt": prompt, "max_tokens": 800, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{pd.base_url}/v1/completions", json=body, timeout=0.3)

    clients = [threading.Thread(target=leave_early, args=(p,)) for p in prompts]
    for client in clients:
        client.start()
    for client in clients:
        client.join(60)
    _eventually(lambda: _pd_idle(running), "both stages to be empty", timeout_s=6)
    prefill_log = pd.prefill.log_path.read_text()
    assert prefill_log.count("client disconnected") > prefill_aborts, prefill_log[-3000:]
    assert pd.decode.log_path.read_text().count("finished (length)") == decode_finishes


# ------------------------------------------------------------------- failures
# These run last (they kill workers) and in this order: decode dies mid-stream,
# prefill dies before the handoff, prefill dies after it. Each request's greedy
# tokens must equal aggregated serving's, exactly once each.

FAULT_PROMPT = [1, *range(2200, 2500)]  # 301 tokens: goes through prefill


def _stream_tokens(
    base_url: str,
    prompt: list[int],
    max_tokens: int,
    on_token: Callable[[int], None] = lambda count: None,
) -> list[int]:
    import json

    tokens: list[int] = []
    seqs: list[int] = []
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        timeout=600,
        json={
            "model": PD_MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("id: "):
                seqs.append(int(line[4:]))
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    tokens.extend(choice.get("token_ids") or [])
                on_token(len(tokens))
    assert len(seqs) == len(set(seqs)), "a duplicated event reached the client"
    return tokens


def _kill(process: Process) -> None:
    """SIGKILL a worker as `conveyor up` would see it die: its engine goes with it, and
    it leaves the registry at once."""
    from shared.queue.liveness import forget_dead_process

    process.popen.send_signal(signal.SIGKILL)
    process.popen.wait(30)
    process.kill_group()  # its engine core too: the KV cache it held is gone
    forget_dead_process(_REDIS_URL[0], process.popen.pid)


def _restart(running: Running, role: str) -> Process:
    env = {"CONVEYOR_SERVED_MODEL_NAME": PD_MODEL}
    process = running.stack.start_worker(
        f"{role}-restarted-{time.monotonic_ns()}", role=role, **env
    )
    _RESTARTED.append(process)
    _wait_for_roles(running, {role}, [process])
    return process


def _pending_by(running: Running, role: str) -> dict[str, int]:
    import redis

    from shared.connections.connect import as_text
    from shared.queue import names

    client = redis.Redis.from_url(running.stack.redis_url)
    pending: dict[str, int] = {}
    try:
        stream = names.job_stream(PD_MODEL, role)
        # the shared stream and, with placement, every worker's own one
        for key in [stream, *client.scan_iter(names.worker_job_stream(stream, "*"))]:
            if not client.exists(key):
                continue
            for c in client.xpending(key, names.JOB_GROUP).get("consumers") or []:
                name = as_text(c["name"])
                pending[name] = pending.get(name, 0) + int(c["pending"])
        return pending
    finally:
        client.close()


def _eventually(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_decode_that_dies_mid_stream_migrates(pd: Disaggregated, running: Running) -> None:
    reference = _complete(
        running.base_url, running.model, FAULT_PROMPT, max_tokens=200, ignore_eos=True
    )["choices"][0]["token_ids"]  # type: ignore[index]
    killed = threading.Event()
    restart = threading.Thread(target=_restart, args=(running, "decode"), daemon=True)

    def kill_decode_midway(count: int) -> None:
        if count >= 20 and not killed.is_set():
            killed.set()
            _kill(pd.decode)
            restart.start()

    tokens = _stream_tokens(pd.base_url, FAULT_PROMPT, 200, kill_decode_midway)
    assert killed.is_set()
    assert tokens == reference
    # The next tests need the replacement in the gateway's pools, not only reading its
    # stream (it can finish this job before the gateway's next directory refresh).
    restart.join(600)


def test_prefill_that_dies_before_the_handoff_is_prefilled_again(
    pd: Disaggregated, running: Running
) -> None:
    prompt = [1, *range(2600, 2900)]
    reference = _complete(running.base_url, running.model, prompt)["choices"][0]["token_ids"]  # type: ignore[index]
    prefill_pid = pd.prefill.popen.pid
    # Freeze its engine, not the worker: the worker takes the job and starts the prefill,
    # which cannot finish. (A frozen worker takes a job only if it froze inside a blocked
    # read, and its heartbeat lapses, so the gateway stops routing to it.)
    engine = psutil.Process(prefill_pid).children(recursive=True)
    for process in engine:
        process.suspend()
    result: dict[str, object] = {}
    client = threading.Thread(
        target=lambda: result.update(r=_complete(pd.base_url, PD_MODEL, prompt)), daemon=True
    )
    client.start()
    try:
        _eventually(
            lambda: any(
                f"-{prefill_pid}-" in name and count
                for name, count in _pending_by(running, "prefill").items()
            ),
            "the frozen prefill worker to hold the job",
        )
    finally:
        _kill(pd.prefill)  # it dies holding the job, before any handoff
    replacement = _restart(running, "prefill")
    client.join(300)
    assert result["r"]["choices"][0]["token_ids"] == reference  # type: ignore[index]
    assert "reclaimed 1 jobs" in replacement.log_path.read_text()
    _PREFILL[:] = [replacement]


_PREFILL: list[Process] = []


def test_prefill_that_dies_after_the_handoff_leaves_decode_to_recompute(
    pd: Disaggregated, running: Running
) -> None:
    prompt = [1, *range(3000, 3300)]
    reference = _complete(running.base_url, running.model, prompt)["choices"][0]["token_ids"]  # type: ignore[index]
    prefill = _PREFILL[0] if _PREFILL else pd.prefill
    decoders = [
        p for p in running.stack.processes if p.name.startswith("decode") and p.popen.poll() is None
    ]
    for decoder in decoders:
        os.kill(decoder.popen.pid, signal.SIGSTOP)  # decode has not pulled the KV yet
    result: dict[str, object] = {}
    client = threading.Thread(
        target=lambda: result.update(r=_complete(pd.base_url, PD_MODEL, prompt)), daemon=True
    )
    try:
        before = prefill.log_path.read_text().count("handed to decode")
        client.start()
        _eventually(
            lambda: prefill.log_path.read_text().count("handed to decode") > before,
            "the prefill worker to hand the job to decode",
        )
        _kill(prefill)  # the prefilled KV cache dies with it
    finally:
        for decoder in decoders:
            os.kill(decoder.popen.pid, signal.SIGCONT)
    client.join(300)
    assert result["r"]["choices"][0]["token_ids"] == reference  # type: ignore[index]
