"""Run every chaos scenario on one real cluster and print the table (`make chaos`)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

from shared.demo.model import write_demo_model
from tests.chaos import resume, scenarios
from tests.chaos.checker import HEADER, Report
from tests.chaos.cluster import Cluster

WORKER_ENV = {
    "CONVEYOR_SHUTDOWN_GRACE_S": "1",  # SIGTERM mid-stream must hand work back, not finish it
}


async def run_all(cluster: Cluster, names: list[str], with_load_shapes: bool) -> list[Report]:
    reference = await scenarios.baseline(cluster)
    reports = []
    for name in names:
        started = time.monotonic()
        report = await scenarios.run_with_fault(cluster, name, scenarios.SCENARIOS[name], reference)
        cluster.wait_workers(len(cluster.workers))
        print(report.row(), f"({time.monotonic() - started:.0f}s)", flush=True)
        reports.append(report)
    if with_load_shapes:
        for shape in (scenarios.disconnect_storm, scenarios.overload):
            report = await shape(cluster)
            print(report.row(), flush=True)
            reports.append(report)
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", action="append", choices=sorted(scenarios.SCENARIOS))
    parser.add_argument("--no-load-shapes", action="store_true")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="only the background-response and resumable-stream checks (two more gateways)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--engine",
        choices=("vllm", "fake"),
        default="vllm",
        help="fake: workers with no model (seconds to start; migration still checked)",
    )
    args = parser.parse_args()
    # A SIGTERM (a timeout, pkill) unwinds through the cluster's stop, so no worker,
    # engine or Redis outlives the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    names = args.scenario or list(scenarios.SCENARIOS)
    if args.engine == "fake":
        asked = scenarios.ENGINE_PROCESS_SCENARIOS.intersection(args.scenario or ())
        if asked:
            parser.error(f"{sorted(asked)} need an engine process; the fake engine has none")
        names = [name for name in names if name not in scenarios.ENGINE_PROCESS_SCENARIOS]
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-chaos-"))
    cluster = Cluster(
        write_demo_model(workdir / "model"),
        workdir,
        worker_env={**WORKER_ENV, "CONVEYOR_ENGINE": args.engine},
    )
    print(f"chaos cluster in {workdir}", flush=True)
    try:
        cluster.start(args.workers)
        if args.resume:
            pair = resume.start_pair(cluster)
            problems = asyncio.run(resume.check_all(cluster, pair))
            print("resume checks:", problems or "all good", flush=True)
            return 1 if problems else 0
        print(HEADER, flush=True)
        reports = asyncio.run(run_all(cluster, names, not args.no_load_shapes))
        leftovers = asyncio.run(scenarios.leftovers(cluster))
        print(f"left behind after all scenarios: {leftovers}")
    finally:
        cluster.stop()
    bad = [r for r in reports if r.hung or r.tokens_lost or r.tokens_duplicated or r.seq_gaps]
    return 1 if bad or any(leftovers.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
