"""A closed-loop HTTP load generator, run as its own process (loopback only, bounded).

    python -m benchmarks.loadgen --address 127.0.0.1:8001 --concurrency 64 --duration 3 \
        --seed-path /ng-rollout/lg{i}-a1/seed_session --path /ng-rollout/lg{i}-a1/increment_counter

Each of `--concurrency` workers holds one keep-alive connection: it seeds its own session
(`{i}` is the worker's number), then sends the tool call again as soon as the previous reply
arrived, until `--duration` seconds (or `--requests` per worker) have passed after a
`--warmup`. Prints one JSON line: `requests`, `seconds`, `rps`, `p50_ms`, `p99_ms`, `errors`,
and `sent` (every request of the run, seeds and warm-up included: what the server worked for).

Standard library only, so it starts in milliseconds and costs the server's core nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from .httpraw import Connection, json_body


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def worker(
    index: int,
    args: argparse.Namespace,
    start: float,
    measure_from: float,
    stop_at: float,
    latencies: list[float],
    errors: list[int],
    sent_total: list[int],
) -> None:
    connection = await Connection.open(args.address)
    sent = 0
    try:
        seeded = await connection.request(
            "POST", args.seed_path.format(i=index), json_body({"initial_count": 0})
        )
        if seeded.status != 200:
            raise RuntimeError(f"seed_session answered {seeded.status}: {seeded.body[:200]!r}")
        cookie = seeded.cookie()
        path = args.path.format(i=index)
        body = json_body({"count": 1})
        head = connection.head("POST", path, len(body), cookie=cookie)
        sent = 1  # the seed
        while True:
            began = time.perf_counter()
            if began >= stop_at or (args.requests and sent > args.requests):
                return
            connection.write(head + body)
            reply = await connection.read_response()
            ended = time.perf_counter()
            sent += 1
            if began >= measure_from:
                if reply.status == 200:
                    latencies.append(ended - began)
                else:
                    errors.append(reply.status)
    finally:
        sent_total.append(sent)
        await connection.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    latencies: list[float] = []
    errors: list[int] = []
    sent_total: list[int] = []
    start = time.perf_counter()
    measure_from = start + args.warmup
    stop_at = measure_from + args.duration
    await asyncio.gather(
        *(
            worker(i, args, start, measure_from, stop_at, latencies, errors, sent_total)
            for i in range(args.concurrency)
        )
    )
    seconds = max(1e-9, min(time.perf_counter(), stop_at) - measure_from)
    ordered = sorted(latencies)
    return {
        "requests": len(latencies),
        "seconds": seconds,
        "rps": len(latencies) / seconds,
        "p50_ms": _percentile(ordered, 50) * 1000,
        "p99_ms": _percentile(ordered, 99) * 1000,
        "errors": len(errors),
        "concurrency": args.concurrency,
        "sent": sum(sent_total),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loadgen")
    parser.add_argument("--address", required=True, help="HOST:PORT (loopback)")
    parser.add_argument("--seed-path", required=True, help="with {i}: the worker's number")
    parser.add_argument("--path", required=True, help="with {i}: the worker's number")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds first")
    parser.add_argument("--requests", type=int, default=0, help="cap per worker (0: none)")
    args = parser.parse_args(argv)
    host = args.address.rpartition(":")[0]
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        parser.error("the load generator only drives loopback addresses")
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
