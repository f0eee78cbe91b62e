"""`python -m benchmarks`: run every benchmark, write JSON + Markdown, print a summary.

    python -m benchmarks                         # the defaults (about 15 minutes on 2 cores)
    python -m benchmarks --scale tiny            # every benchmark at a tiny size (about 1.5 minutes)
    python -m benchmarks --only prepare,control --repeats 5 --output /tmp/bench
    python -m benchmarks --only light --merge    # rerun one; keep the others' last results
    python -m benchmarks --only nemo_gym         # NeMo Gym's IPI server (needs scripts/nemo-gym-env)
    python -m benchmarks --only object_store     # SeaweedFS (needs scripts/seaweedfs built)
    python -m benchmarks --only async_commit     # sync vs async commits (SeaweedFS if built)
    python -m benchmarks --only incremental      # incremental vs full checkpoints

Results go to `<output>/latest.json` and `<output>/latest.md` (default `benchmarks/results/`).
Every figure is the median over its repeats with the min-max over the same repeats; every
comparison is a ratio of runs interleaved in the same invocation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import (
    async_commit,
    bounded_state,
    control_rpc,
    dataplane,
    fleet_scale,
    incremental,
    light_scale,
    nemo_gym,
    object_store,
    prepare,
    report,
    throughput,
    workers,
)
from .common import SPREAD, BenchResult, Processes

BENCHMARKS: dict[str, Callable[[Any], Awaitable[BenchResult]]] = {
    "prepare": prepare.run,
    "throughput": throughput.run,
    "dataplane": dataplane.run,
    "control": control_rpc.run,
    "fleet": fleet_scale.run,
    "light": light_scale.run,
    "bounded": bounded_state.run,
    "nemo_gym": nemo_gym.run,
    "object_store": object_store.run,
    "workers": workers.run,
    "async_commit": async_commit.run,
    "incremental": incremental.run,
}
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results"


@dataclass
class Params:
    repeats: int
    sessions: list[int]
    """Benchmark 1: live sessions at the resources member."""
    inflight: int
    """Benchmark 1: calls held in flight, and rollouts in flight."""
    rollout_repeats: int
    """Benchmark 1: prepares with rollouts in flight, per controller."""
    model_latency: float
    """Benchmark 1: seconds the scripted policy model takes per call."""
    states: list[tuple[int, int]]
    """Benchmark 2: (sessions, bytes per state)."""
    store_repeats: int
    """Benchmark 2: commits and restores (each restore in a fresh process) per case."""
    concurrency: list[int]
    load_repeats: int
    duration: float
    warmup: float
    """Benchmark 3: runs per server and concurrency; load-generator seconds per run
    (measured, and unmeasured first)."""
    control_calls: int
    """Benchmark 4: calls per kind per run."""
    fleet_sizes: list[int]
    fleet_sessions: int
    """Benchmark 5: participants, and live sessions per resources member."""
    light_sizes: list[int]
    light_hosts: int
    fan_out: int | None
    """Benchmark 6: lightweight members per fleet (multiples of 4), the processes serving
    them, and the coordinator's fan-out bound (None: the fleet file's default)."""
    finished: int
    bounded_inflight: int
    bounded_latency: float
    checkpoint_every: int
    """Benchmark 7: rollouts run to the end before the checkpoint (run A), rollouts in flight
    at it (every run, and the dispatch concurrency), seconds per scripted generation, and
    (run C, off at 0) a checkpoint after every so many finished rollouts."""
    nemo_gym_sessions: list[int]
    nemo_gym_repeats: int
    """Benchmark 8: sessions mid-episode on NeMo Gym's IPI server; prepares, commits and
    restores (each restore in a fresh process) per size."""
    object_store_states: list[tuple[int, int]] = field(
        default_factory=lambda: [(10000, 5000), (1000, 50000)]
    )
    object_store_repeats: int = 7
    """Benchmark 9: (records, bytes per record) of a part on SeaweedFS; commits, restores and
    raw puts and gets per case."""
    workers_sessions: int = 1000
    workers_repeats: int = 5
    """Benchmark 10: sessions on each server (1 worker, 4 workers); prepares and commits of
    each, interleaved."""
    async_commit_states: list[tuple[int, int]] = field(
        default_factory=lambda: [(10000, 5000), (1000, 50000)]
    )
    async_commit_repeats: int = 5
    """Benchmark 11: (sessions, bytes per state); checkpoints of each mode (sync, async,
    alternating) per case and storage."""
    incremental_cases: list[tuple[int, int, int]] = field(
        default_factory=lambda: [
            (10000, 5000, 1),
            (10000, 5000, 10),
            (10000, 5000, 100),
            (1000, 50000, 10),
        ]
    )
    incremental_rounds: int = 8
    incremental_restores: int = 3
    """Benchmark 12: (sessions, bytes per state, per cent touched per round); rounds of an
    incremental and a full checkpoint side by side; restores of each chain end and full part."""


SCALES: dict[str, Params] = {
    "default": Params(
        repeats=9,
        sessions=[1000, 10000],
        inflight=59,
        rollout_repeats=5,
        model_latency=1.0,
        states=[(10000, 5000), (1000, 50000)],
        store_repeats=5,
        concurrency=[1, 64],
        load_repeats=5,
        duration=3.0,
        warmup=0.5,
        control_calls=400,
        fleet_sizes=[4, 8, 16],
        fleet_sessions=100,
        light_sizes=[100, 300, 1000],
        light_hosts=2,
        fan_out=None,
        finished=10000,
        bounded_inflight=50,
        bounded_latency=0.2,
        checkpoint_every=0,
        nemo_gym_sessions=[1, 16, 64, 256],
        nemo_gym_repeats=5,
        object_store_states=[(10000, 5000), (1000, 50000)],
        object_store_repeats=7,
        workers_sessions=1000,
        workers_repeats=5,
        async_commit_states=[(10000, 5000), (1000, 50000)],
        async_commit_repeats=5,
    ),
    "tiny": Params(
        repeats=2,
        sessions=[20, 100],
        inflight=4,
        rollout_repeats=2,
        model_latency=0.1,
        states=[(100, 5000), (10, 50000)],
        store_repeats=2,
        concurrency=[1, 8],
        load_repeats=2,
        duration=0.3,
        warmup=0.1,
        control_calls=30,
        fleet_sizes=[4, 8],
        fleet_sessions=5,
        light_sizes=[8, 20],
        light_hosts=2,
        fan_out=None,
        finished=60,
        bounded_inflight=5,
        bounded_latency=0.05,
        checkpoint_every=20,
        nemo_gym_sessions=[1, 4],
        nemo_gym_repeats=2,
        object_store_states=[(50, 2000)],
        object_store_repeats=2,
        workers_sessions=20,
        workers_repeats=2,
        async_commit_states=[(50, 2000)],
        async_commit_repeats=2,
        incremental_cases=[(200, 2000, 1), (200, 2000, 10), (200, 2000, 100), (20, 20000, 10)],
        incremental_rounds=2,
        incremental_restores=1,
    ),
}


@dataclass
class Context:
    params: Params
    processes: Processes
    workdir: Path
    quiet: bool = False
    started: float = field(default_factory=time.monotonic)

    def say(self, text: str) -> None:
        if not self.quiet:
            elapsed = time.monotonic() - self.started
            print(f"[{elapsed:7.1f} s] {text}", file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _states(text: str) -> list[tuple[int, int]]:
    """`10000x5000,1000x50000`: sessions x bytes per state."""
    cases = []
    for part in text.split(","):
        sessions, _, size = part.strip().partition("x")
        cases.append((int(sessions), int(size)))
    return cases


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Params]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--scale", choices=sorted(SCALES), default="default")
    parser.add_argument(
        "--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="results directory")
    parser.add_argument("--workdir", type=Path, default=None, help="keep servers' logs here")
    parser.add_argument("--repeats", type=int, help="repeats of benchmarks 1, 4 and 5")
    parser.add_argument("--rollout-repeats", type=int, help="benchmark 1: rollouts-in-flight runs")
    parser.add_argument("--model-latency", type=float, help="benchmark 1: seconds per model call")
    parser.add_argument("--sessions", type=_ints, help="benchmark 1: N, e.g. 1000,10000")
    parser.add_argument("--inflight", type=int, help="benchmark 1: M calls / rollouts in flight")
    parser.add_argument("--states", type=_states, help="benchmark 2: e.g. 10000x5000,1000x50000")
    parser.add_argument("--store-repeats", type=int, help="benchmark 2: commits and restores")
    parser.add_argument("--concurrency", type=_ints, help="benchmark 3: e.g. 1,64")
    parser.add_argument("--load-repeats", type=int, help="benchmark 3: runs per case")
    parser.add_argument("--duration", type=float, help="benchmark 3: seconds per load run")
    parser.add_argument("--control-calls", type=int, help="benchmark 4: calls per run")
    parser.add_argument("--fleet-sizes", type=_ints, help="benchmark 5: e.g. 4,8,16")
    parser.add_argument("--light-sizes", type=_ints, help="benchmark 6: e.g. 100,300,1000")
    parser.add_argument("--light-hosts", type=int, help="benchmark 6: host processes")
    parser.add_argument("--fan-out", type=int, help="benchmark 6: calls at once per stage")
    parser.add_argument("--finished", type=int, help="benchmark 7: rollouts finished in run A")
    parser.add_argument("--bounded-inflight", type=int, help="benchmark 7: rollouts in flight")
    parser.add_argument(
        "--bounded-latency", type=float, help="benchmark 7: seconds per model generation"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        help="benchmark 7: also run C, checkpointing after every N finished rollouts (0: off)",
    )
    parser.add_argument(
        "--nemo-gym-sessions", type=_ints, help="benchmark 8: sessions, e.g. 1,16,64"
    )
    parser.add_argument(
        "--nemo-gym-repeats", type=int, help="benchmark 8: prepares, commits, restores per size"
    )
    parser.add_argument(
        "--object-store-states", type=_states, help="benchmark 9: e.g. 10000x5000,1000x50000"
    )
    parser.add_argument(
        "--object-store-repeats", type=int, help="benchmark 9: commits and restores per case"
    )
    parser.add_argument(
        "--workers-sessions", type=int, help="benchmark 10: sessions on each server"
    )
    parser.add_argument(
        "--workers-repeats", type=int, help="benchmark 10: prepares and commits per server"
    )
    parser.add_argument(
        "--async-commit-states", type=_states, help="benchmark 11: e.g. 10000x5000,1000x50000"
    )
    parser.add_argument(
        "--async-commit-repeats", type=int, help="benchmark 11: checkpoints per mode and case"
    )
    parser.add_argument(
        "--incremental-rounds", type=int, help="benchmark 12: checkpoint pairs per case"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the results of benchmarks not run now from <output>/latest.json",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    params = SCALES[args.scale]
    overrides = {
        name: getattr(args, name)
        for name in (
            "repeats",
            "sessions",
            "inflight",
            "rollout_repeats",
            "model_latency",
            "states",
            "store_repeats",
            "concurrency",
            "load_repeats",
            "duration",
            "control_calls",
            "fleet_sizes",
            "light_sizes",
            "light_hosts",
            "fan_out",
            "finished",
            "bounded_inflight",
            "bounded_latency",
            "checkpoint_every",
            "nemo_gym_sessions",
            "nemo_gym_repeats",
            "object_store_states",
            "object_store_repeats",
            "workers_sessions",
            "workers_repeats",
            "async_commit_states",
            "async_commit_repeats",
            "incremental_rounds",
        )
        if getattr(args, name) is not None
    }
    params = replace(params, **overrides)
    if (
        min(
            params.repeats,
            params.store_repeats,
            params.rollout_repeats,
            params.load_repeats,
            params.nemo_gym_repeats,
            params.object_store_repeats,
            params.workers_repeats,
            params.async_commit_repeats,
            params.incremental_rounds,
            params.incremental_restores,
        )
        < 1
    ):
        parser.error("repeats must be at least 1")
    if any(size % 4 for size in [*params.fleet_sizes, *params.light_sizes]):
        parser.error("fleet sizes are multiples of 4 (one participant of each kind per group)")
    unknown = {n for n in args.only.split(",") if n} - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    return args, params


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


async def run_all(names: list[str], ctx: Context) -> dict[str, BenchResult]:
    results: dict[str, BenchResult] = {}
    for name in names:
        started = time.monotonic()
        ctx.say(f"== {name}")
        result = await BENCHMARKS[name](ctx)
        result.seconds = time.monotonic() - started
        results[name] = result
        ctx.say(f"== {name} done in {result.seconds:.1f} s")
    return results


RUN_FIELDS = ("scale", "finished_at", "seconds", "machine")


def earlier_runs(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs a `--merge` kept results from: each with its benchmarks, machine and time
    (the older single `earlier_run` read as a list of one)."""
    if "earlier_runs" in payload:
        runs: list[dict[str, Any]] = payload["earlier_runs"]
        return runs
    return [payload["earlier_run"]] if payload.get("earlier_run") else []


def merged(payload: dict[str, Any], previous_path: Path) -> dict[str, Any]:
    """`payload` plus the results of every benchmark it lacks from the run at `previous_path`.

    Under `earlier_runs`, each kept benchmark is named with the run it really came from (its
    machine and time, since its figures came from there): the previous run for its own
    results, and the older runs it had itself kept for theirs, so merging again and again
    never credits an old figure to a newer run. Without a previous file, `payload` as it is."""
    if not previous_path.exists():
        return payload
    previous = json.loads(previous_path.read_text())
    kept = {n: r for n, r in previous["benchmarks"].items() if n not in payload["benchmarks"]}
    if not kept:
        return payload
    runs = []
    older_names: set[str] = set()
    for run in earlier_runs(previous):
        names = sorted(set(run["benchmarks"]) & set(kept))
        older_names |= set(names)
        if names:
            runs.append({**run, "benchmarks": names})
    own = sorted(set(kept) - older_names)
    if own:
        runs.append({"benchmarks": own, **{k: previous.get(k) for k in RUN_FIELDS}})
    return {
        **{k: v for k, v in payload.items() if k not in ("earlier_run", "earlier_runs")},
        "params": {**previous.get("params", {}), **payload["params"]},
        "benchmarks": {**kept, **payload["benchmarks"]},
        "earlier_runs": sorted(runs, key=lambda run: str(run["finished_at"])),
    }


def main(argv: list[str] | None = None) -> int:
    args, params = parse_args(argv)
    names = [n for n in BENCHMARKS if not args.only or n in args.only.split(",")]
    keep = args.workdir is not None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rollout-checkpoint-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    processes = Processes(workdir, secrets.token_urlsafe(24))
    ctx = Context(params, processes, workdir, quiet=args.quiet)
    info = machine()
    started = time.monotonic()
    try:
        results = asyncio.run(run_all(names, ctx))
    finally:
        processes.close()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    payload = {
        "scale": args.scale,
        "params": {k: v for k, v in vars(params).items()},
        "spread": SPREAD,
        "machine": info,
        "seconds": round(time.monotonic() - started, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "benchmarks": {name: result.to_json() for name, result in results.items()},
    }
    if args.merge:
        payload = merged(payload, args.output / "latest.json")
    json_path, md_path = report.write(payload, args.output)
    print(report.summary(payload))
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
