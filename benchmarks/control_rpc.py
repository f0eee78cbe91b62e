"""Benchmark 4: control-RPC latency, gRPC sidecar vs an HTTP/JSON route doing the same work.

One process (`control_server.py`): the counter example with its gRPC sidecar and, on its HTTP
app, `GET /ng-control/v1/checkpoint/status` and `POST /ng-control/v1/checkpoint/prepare`,
which check the same token, open the same observed operation and call the same control
plane, answering JSON. From this process: `GetStatus` vs the status route, and `Prepare`
(nothing to wait for: to its final PREPARED message) vs the prepare route (its final
update), calls alternating one by one; each prepare is followed by an untimed Resume. p50
and p99 per run, over `--control-calls` calls of each.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rollout_checkpoint.client.participant import ParticipantClient

from .common import BenchResult, deadline_in, ms, now, percentile, ratios
from .httpraw import Connection, json_body

WARMUP_CALLS = 20


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    processes = ctx.processes
    token = processes.token
    result = BenchResult(
        "control",
        "4. Control-RPC latency (gRPC vs HTTP/JSON, same process, same work)",
        "The counter example with its gRPC sidecar and an HTTP/JSON control route on its own "
        "app that does the same work (token check, observed operation, the same control-plane "
        "call, JSON instead of protobuf). GetStatus, and Prepare with nothing to wait for (to "
        "PREPARED; an untimed Resume after each), called alternately from one client process; "
        "p50 and p99 per run of `control_calls` calls each.",
        params={"calls": params.control_calls, "repeats": params.repeats},
    )
    server = await asyncio.to_thread(
        processes.launch,
        "control",
        ["-m", "benchmarks.control_server", f"--token={token}", "--instance", "control"],
    )
    client = ParticipantClient(server.grpc or "", token)
    http = await Connection.open(server.http)
    auth = (("authorization", f"Bearer {token}"),)
    counter = 0

    async def grpc_status() -> float:
        started = now()
        await client.get_status()
        return now() - started

    async def http_status() -> float:
        started = now()
        reply = await http.request("GET", "/ng-control/v1/checkpoint/status", headers=auth)
        elapsed = now() - started
        if reply.status != 200:
            raise RuntimeError(f"status route answered {reply.status}")
        return elapsed

    def next_id() -> str:
        nonlocal counter
        counter += 1
        return f"bench-control-{counter}"

    async def grpc_prepare() -> float:
        checkpoint_id = next_id()
        started = now()
        final = await client.prepare_until_final(checkpoint_id, deadline_in(60))
        elapsed = now() - started
        await client.resume(checkpoint_id, deadline_in(60))
        if not final.readiness.ready:
            raise RuntimeError("the gRPC prepare did not end PREPARED")
        return elapsed

    async def http_prepare() -> float:
        checkpoint_id = next_id()
        body = json_body({"checkpoint_id": checkpoint_id, "deadline": deadline_in(60)})
        started = now()
        reply = await http.request("POST", "/ng-control/v1/checkpoint/prepare", body, headers=auth)
        elapsed = now() - started
        await client.resume(checkpoint_id, deadline_in(60))
        if reply.status != 200 or json.loads(reply.body)["state"] != "PREPARED":
            raise RuntimeError(f"the HTTP prepare answered {reply.status}: {reply.body[:200]!r}")
        return elapsed

    calls = {
        ("GetStatus", "gRPC"): grpc_status,
        ("GetStatus", "HTTP/JSON"): http_status,
        ("Prepare", "gRPC"): grpc_prepare,
        ("Prepare", "HTTP/JSON"): http_prepare,
    }
    p50: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    p99: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    try:
        for call in calls.values():
            for _ in range(WARMUP_CALLS):
                await call()
        for repeat in range(params.repeats):
            ctx.say(f"control: round {repeat + 1}/{params.repeats}")
            for rpc in ("GetStatus", "Prepare"):
                samples: dict[str, list[float]] = {"gRPC": [], "HTTP/JSON": []}
                for _ in range(params.control_calls):
                    for transport in ("gRPC", "HTTP/JSON"):
                        samples[transport].append(await calls[(rpc, transport)]())
                for transport, values in samples.items():
                    p50[(rpc, transport)].append(ms(percentile(values, 50)))
                    p99[(rpc, transport)].append(ms(percentile(values, 99)))
    finally:
        await http.close()
        await client.close()
        processes.stop_servers([server])
    for rpc in ("GetStatus", "Prepare"):
        for transport in ("gRPC", "HTTP/JSON"):
            result.figure(f"{rpc}, {transport}", "p50", "ms", p50[(rpc, transport)])
            result.figure(f"{rpc}, {transport}", "p99", "ms", p99[(rpc, transport)])
        for name, table in (("p50", p50), ("p99", p99)):
            result.ratio(
                f"{rpc} {name}: gRPC / HTTP/JSON",
                f"{rpc} gRPC {name}",
                f"{rpc} HTTP/JSON {name}",
                ratios(table[(rpc, "gRPC")], table[(rpc, "HTTP/JSON")]),
            )
    return result
