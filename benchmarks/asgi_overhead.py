"""The CPU a request costs inside the app, with and without checkpointing (benchmark 3).

    python -m benchmarks.asgi_overhead --requests 2000 --rounds 10

Both variants of the counter example's app run in this one process, called directly as ASGI
apps (no socket, no HTTP parser, no sidecar started), alternating round by round: a seeded
session, then `--requests` calls of `increment_counter` with its cookie, through the rollout
prefix for the checkpointing variant. Timed by `time.process_time()`, so what other processes
of a shared machine do moves it far less than it moves wall-clock latency. Prints one JSON
line: per round, microseconds of CPU per request for each variant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.resources import ResourcesServerConfig
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

SECRET = "s" * 32
TOKEN = "t" * 32


def build(checkpoint: bool) -> Any:
    settings = CheckpointSettings(enabled=True, token=TOKEN) if checkpoint else None
    config = ResourcesServerConfig(instance="asgi", checkpoint=settings, session_secret=SECRET)
    return CounterServer(config).build_app()


async def call(
    app: Any, path: str, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> list[dict[str, Any]]:
    """One POST through the ASGI app; the messages it sent."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect while the app runs
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    await app(scope, receive, send)
    return sent


async def cpu_per_request(app: Any, prefix: str, requests: int) -> float:
    """Microseconds of this process's CPU per `increment_counter` call."""
    seeded = await call(app, f"{prefix}/seed_session", b'{"initial_count":0}')
    cookie = next(v for k, v in seeded[0]["headers"] if k == b"set-cookie").split(b";")[0]
    headers = ((b"cookie", cookie),)
    body = b'{"count":1}'
    for _ in range(requests // 10):  # warm-up
        await call(app, f"{prefix}/increment_counter", body, headers)
    started = time.process_time()
    for _ in range(requests):
        reply = await call(app, f"{prefix}/increment_counter", body, headers)
    spent = time.process_time() - started
    if reply[0]["status"] != 200:
        raise RuntimeError(f"increment_counter answered {reply[0]['status']}")
    return spent / requests * 1e6


async def run(requests: int, rounds: int) -> dict[str, list[float]]:
    apps = {"with": build(True), "without": build(False)}
    prefixes = {"with": "/ng-rollout/asgi-a1", "without": ""}
    results: dict[str, list[float]] = {"with": [], "without": []}
    for round_ in range(rounds):
        order = ("with", "without") if round_ % 2 == 0 else ("without", "with")
        for variant in order:
            results[variant].append(
                await cpu_per_request(apps[variant], prefixes[variant], requests)
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.asgi_overhead")
    parser.add_argument("--requests", type=int, default=2000, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args.requests, args.rounds))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
