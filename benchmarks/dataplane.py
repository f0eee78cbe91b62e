"""Benchmark 3: data-plane overhead of checkpointing on the same FastAPI resources app.

Two processes of the counter example: one with checkpointing (rollout prefix, admission
middleware, refusal counter, gRPC sidecar idle next to it) and one with `--no-checkpoint`
(none of it installed). A load generator in its own process (`loadgen.py`, closed loop,
loopback, bounded by time) drives `increment_counter` with a session cookie at each
concurrency; runs alternate between the two servers, so each ratio compares neighbours.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from .common import REPO, BenchResult, ratios
from .light_scale import process_cpu_seconds

VARIANTS = ("with", "without")


async def load(ctx: Any, address: str, prefixed: bool, concurrency: int) -> dict[str, Any]:
    prefix = "/ng-rollout/lg{i}-a1" if prefixed else ""
    params = ctx.params
    command = [
        sys.executable,
        "-m",
        "benchmarks.loadgen",
        "--address",
        address,
        "--concurrency",
        str(concurrency),
        "--duration",
        str(params.duration),
        "--warmup",
        str(params.warmup),
        "--seed-path",
        f"{prefix}/seed_session",
        "--path",
        f"{prefix}/increment_counter",
    ]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the load generator failed: {err.decode()[-2000:]}")
    reply: dict[str, Any] = json.loads(out)
    if reply["errors"] or not reply["requests"]:
        raise RuntimeError(f"the load run had errors: {reply}")
    return reply


async def asgi_overhead(requests: int, rounds: int) -> dict[str, list[float]]:
    """`asgi_overhead.py` in its own process: CPU per request inside the app, both variants."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.asgi_overhead",
        "--requests",
        str(requests),
        "--rounds",
        str(rounds),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"asgi_overhead failed: {err.decode()[-2000:]}")
    reply: dict[str, list[float]] = json.loads(out)
    return reply


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    processes = ctx.processes
    result = BenchResult(
        "dataplane",
        "3. Data-plane overhead (checkpoint middleware on vs off)",
        "The counter example's FastAPI app with checkpointing (rollout prefix, admission "
        "middleware, refusal counter, idle gRPC sidecar) and with `--no-checkpoint`, each its own "
        "process; a closed-loop load generator in another process drives `increment_counter` "
        f"for {params.duration:g} s per run (after {params.warmup:g} s of warm-up) at each "
        "concurrency; runs alternate between the two.",
        params={
            "concurrency": params.concurrency,
            "duration": params.duration,
            "warmup": params.warmup,
            "repeats": params.load_repeats,
        },
    )
    with_server, without_server = await asyncio.gather(
        asyncio.to_thread(processes.serve, "dp-with", "counter"),
        asyncio.to_thread(
            processes.launch,
            "dp-without",
            ["-m", "rollout_checkpoint.examples.serve", "counter", "--no-checkpoint"],
        ),
    )
    servers = {"with": with_server, "without": without_server}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {
        (v, c): [] for v in VARIANTS for c in params.concurrency
    }
    try:
        for repeat in range(params.load_repeats):
            ctx.say(f"dataplane: round {repeat + 1}/{params.load_repeats}")
            for concurrency in params.concurrency:
                order = VARIANTS if repeat % 2 == 0 else tuple(reversed(VARIANTS))
                for variant in order:
                    cpu = process_cpu_seconds(servers[variant].process.pid)
                    reply = await load(ctx, servers[variant].http, variant == "with", concurrency)
                    cpu = process_cpu_seconds(servers[variant].process.pid) - cpu
                    reply["cpu_us"] = cpu / reply["sent"] * 1e6
                    runs[(variant, concurrency)].append(reply)
    finally:
        processes.stop_servers(servers.values())
    ctx.say("dataplane: CPU per request inside the app (ASGI, in process)")
    inside = await asgi_overhead(
        max(200, int(params.duration * 700)), max(2, 2 * params.load_repeats)
    )
    label = {"with": "with checkpointing", "without": "without (--no-checkpoint)"}
    for concurrency in params.concurrency:
        for variant in VARIANTS:
            replies = runs[(variant, concurrency)]
            case = f"concurrency {concurrency}, {label[variant]}"
            result.figure(case, "throughput", "req/s", [r["rps"] for r in replies])
            result.figure(case, "p50 latency", "ms", [r["p50_ms"] for r in replies])
            result.figure(case, "p99 latency", "ms", [r["p99_ms"] for r in replies])
            result.figure(
                case,
                "server CPU per request",
                "us",
                [r["cpu_us"] for r in replies],
                note="the server process's CPU time over the run / every request it answered",
            )
        with_runs = runs[("with", concurrency)]
        without_runs = runs[("without", concurrency)]
        for metric, key in (
            ("req/s", "rps"),
            ("p50", "p50_ms"),
            ("p99", "p99_ms"),
            ("server CPU per request", "cpu_us"),
        ):
            result.ratio(
                f"concurrency {concurrency}: {metric} with / without",
                f"{key} with",
                f"{key} without",
                ratios([r[key] for r in with_runs], [r[key] for r in without_runs]),
            )
    for variant in VARIANTS:
        result.figure(
            f"inside the app (ASGI, no server), {label[variant]}",
            "CPU per request",
            "us",
            inside[variant],
        )
    result.figure(
        "inside the app (ASGI, no server)",
        "CPU checkpointing adds per request",
        "us",
        [w - o for w, o in zip(inside["with"], inside["without"], strict=True)],
    )
    result.ratio(
        "inside the app: CPU per request with / without",
        "CPU with",
        "CPU without",
        ratios(inside["with"], inside["without"]),
    )
    return result
