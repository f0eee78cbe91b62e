"""Benchmark 10: prepare and commit of one server with 1 worker and with 4 workers.

`rollout-checkpoint serve counter` once as one process (the sidecar beside the HTTP app,
the in-process bridge) and once with `--workers 4` (the sidecar in the main process, four
worker processes behind the same port, the local Unix-socket bridge), both holding the same
N sessions mid-episode, seeded over 16 keep-alive connections (so each worker owns the
sessions of the connections it accepted). Measured at the controller (`ParticipantClient`),
the two servers interleaved repeat by repeat:

* prepare: the Prepare call -> its final PREPARED message (nothing in flight): a close
  broadcast to every worker and every worker's report back;
* commit: the Commit call -> its reply: every worker's export over the bridge, merged into
  the one part, written, fsynced, published;
* a tool call on a session, over one keep-alive connection that cycles through the sessions
  (so with 4 workers about three in four calls reach a worker that does not own the
  session and are forwarded to its owner over its Unix socket): what the cookie routing
  costs per request.

The ratios are 4 workers / 1 worker of the same runs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.participant import ParticipantClient

from .common import BenchResult, Server, deadline_in, ms, now, ratios
from .fleetutil import seed_sessions
from .httpraw import Connection, json_body

TIMEOUT = 120.0
CALLS = 200
"""Tool calls per server and repeat (the data-plane figure)."""


def rollout(index: int) -> str:
    return f"w{index:05d}"


async def tool_calls(address: str, cookies: dict[int, str], calls: int) -> list[float]:
    """`calls` increments over one keep-alive connection, cycling through the sessions."""
    connection = await Connection.open(address)
    latencies = []
    try:
        for call in range(calls):
            index = call % len(cookies)
            started = now()
            reply = await connection.request(
                "POST",
                f"/ng-rollout/{rollout(index)}-a1/increment_counter",
                json_body({"count": 1}),
                cookie=cookies[index],
            )
            latencies.append(now() - started)
            if reply.status != 200:
                raise RuntimeError(f"increment {index}: HTTP {reply.status} {reply.body[:200]!r}")
    finally:
        await connection.close()
    return latencies


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    processes = ctx.processes
    sessions: int = params.workers_sessions
    repeats: int = params.workers_repeats
    counts = (1, 4)
    result = BenchResult(
        "workers",
        "10. Several workers per server: prepare and commit, 1 vs 4 workers",
        "`serve counter` as one process and with `--workers 4` (main process with the "
        "sidecar, 4 worker processes on one port, the Unix-socket bridge), each holding N "
        "sessions seeded over 16 connections. Prepare: Prepare call -> PREPARED. Commit: "
        "Commit call -> reply (every worker's export over the bridge, one part). Tool call: "
        "one keep-alive connection cycling through the sessions (with 4 workers most calls "
        "are forwarded to the session's owner). Interleaved repeat by repeat.",
        params={"sessions": sessions, "repeats": repeats, "workers": list(counts)},
    )
    work = Path(tempfile.mkdtemp(prefix="workers-", dir=ctx.workdir))

    def serve(workers: int) -> Server:
        extra = ["--workers", str(workers)] if workers > 1 else []
        return processes.launch(
            f"counter-{workers}w",
            [
                "-m",
                "rollout_checkpoint.examples.serve",
                "counter",
                f"--token={processes.token}",
                *extra,
            ],
        )

    servers = await asyncio.gather(*(asyncio.to_thread(serve, n) for n in counts))
    clients = [ParticipantClient(s.grpc or "", processes.token, timeout=TIMEOUT) for s in servers]
    prepares: dict[int, list[float]] = {n: [] for n in counts}
    commits: dict[int, list[float]] = {n: [] for n in counts}
    calls: dict[int, list[float]] = {n: [] for n in counts}
    cookies: dict[int, dict[int, str]] = {}
    try:
        for workers, server, client in zip(counts, servers, clients, strict=True):
            await client.get_participant()  # connected before any clock starts
            ctx.say(f"workers: {sessions} sessions on the {workers}-worker server")
            cookies[workers] = await seed_sessions(
                server.http,
                range(sessions),
                rollout,
                lambda i: json.dumps({"initial_count": i}).encode(),
            )
        for repeat in range(repeats):
            for workers, server, client in zip(counts, servers, clients, strict=True):
                checkpoint_id = f"w{workers}-{repeat}"
                started = now()
                final = await client.prepare_until_final(checkpoint_id, deadline_in(TIMEOUT))
                prepares[workers].append(now() - started)
                if not final.readiness.ready:
                    raise RuntimeError(f"the {workers}-worker server did not get prepared")
                started = now()
                reply = await client.commit(
                    checkpoint_id, deadline_in(TIMEOUT), str(work / checkpoint_id)
                )
                commits[workers].append(now() - started)
                await client.resume(checkpoint_id, deadline_in(TIMEOUT))
                if reply.manifest.record_count != sessions:
                    raise RuntimeError(f"committed {reply.manifest.record_count} of {sessions}")
                calls[workers].extend(await tool_calls(server.http, cookies[workers], CALLS))
    finally:
        for client in clients:
            await client.close()
        processes.stop_servers(servers)
    for workers in counts:
        label = f"{workers} worker{'s' if workers > 1 else ''}, {sessions} sessions"
        result.figure(f"{label}: prepare", "Prepare -> PREPARED", "ms", map(ms, prepares[workers]))
        result.figure(f"{label}: commit", "Commit call -> reply", "ms", map(ms, commits[workers]))
        result.figure(
            f"{label}: tool call", "request -> reply, keep-alive", "ms", map(ms, calls[workers])
        )
    for name, samples in (("prepare", prepares), ("commit", commits), ("tool call", calls)):
        result.ratio(
            f"{name}: 4 workers / 1 worker",
            "4 workers",
            "1 worker",
            ratios(samples[4], samples[1]),
        )
    await asyncio.to_thread(shutil.rmtree, work, True)
    return result
