"""Benchmark 2: commit and restore throughput against the raw limit measured in the same run.

A prompt-injection server holds N sessions whose environments are scaled up to S bytes of
JSON (`states.py`), seeded over HTTP. Commit: the controller's Commit call -> its reply
(export through the server's hook, serialize, write, fsync, hash, publish the manifest),
after a Prepare that is not timed. Restore: a fresh process per restore (started closed, as
a replacement is), the controller's Restore call -> its reply (read, verify the digest,
parse, validate, install every session). The raw limit is a plain script (`raw_io.py`, its
own process) that serializes the same states with the standard library's json, writes and
fsyncs them, and, in another fresh process, reads them back and parses them; the same script
with orjson to write and msgspec to read (the runtime's own libraries) is a second, stricter
reference. Commits alternate with raw writes and restores with raw reads, so each ratio
compares runs taken side by side. The participant's memory after a restore is its VmRSS
growth over the Restore call, per byte of records restored.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId

from .common import REPO, BenchResult, Server, deadline_in, now, ratios, rss_bytes
from .fleetutil import seed_sessions
from .httpraw import Connection, json_body
from .states import environment

TIMEOUT = 600.0
MB = 1e6
METRICS_PATH = "/metrics"
PHASE_METRIC = "rollout_checkpoint_phase_duration_seconds"
METRICS_ENV = {"ROLLOUT_CHECKPOINT_METRICS_PATH": METRICS_PATH}


def rollout(index: int) -> str:
    return f"t{index:05d}"


async def raw(
    mode: str, path: Path, sessions: int = 0, size: int = 0, codec: str = "stdlib"
) -> dict[str, Any]:
    """Run the raw-limit script as its own process and return its JSON line."""
    command = [sys.executable, "-m", "benchmarks.raw_io", mode, "--path", str(path)]
    command += ["--codec", codec]
    if mode == "write":
        command += ["--sessions", str(sessions), "--bytes", str(size), "--prefix", "t"]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"raw_io {mode} failed: {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    return result


async def phase_seconds(address: str) -> dict[str, float]:
    """The participant's cumulative seconds per phase, from its Prometheus metrics."""
    connection = await Connection.open(address)
    try:
        reply = await connection.request("GET", METRICS_PATH)
    finally:
        await connection.close()
    phases: dict[str, float] = {}
    for line in reply.body.decode().splitlines():
        if line.startswith(f"{PHASE_METRIC}_sum{{"):
            labels, _, value = line.rpartition(" ")
            phase = labels.split('phase="', 1)[1].split('"', 1)[0]
            phases[phase] = float(value)
    return phases


def phase_delta(before: dict[str, float], after: dict[str, float], phase: str) -> float:
    return after.get(phase, 0.0) - before.get(phase, 0.0)


async def one_case(ctx: Any, result: BenchResult, sessions: int, size: int) -> None:
    processes = ctx.processes
    label = f"{sessions:,} x {size // 1000} KB"
    instance = f"pi-{sessions}x{size}"
    workdir: Path = ctx.workdir / instance
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    repeats = ctx.params.store_repeats
    ctx.say(f"throughput {label}: seeding")
    server: Server = await asyncio.to_thread(
        processes.serve, instance, "prompt_injection", env=METRICS_ENV
    )
    client = ParticipantClient(server.grpc or "", processes.token, timeout=TIMEOUT)
    commits: list[float] = []
    commit_bytes = 0
    raw_writes: list[float] = []
    restores: list[float] = []
    raw_reads: list[float] = []
    fast_writes: list[float] = []
    fast_reads: list[float] = []
    raw_bytes = 0
    exports: list[float] = []
    writes: list[float] = []
    reads: list[float] = []
    installs: list[float] = []
    memory: list[float] = []
    source = ""
    try:
        bodies = await asyncio.to_thread(
            lambda: [json_body({"environment": environment(i, size)}) for i in range(sessions)]
        )
        await seed_sessions(server.http, range(sessions), rollout, lambda i: bodies[i])
        ctx.say(f"throughput {label}: {repeats} commits and raw writes")
        for repeat in range(repeats):
            checkpoint_id = f"bench-commit-{repeat}"
            directory = workdir / f"commit-{repeat}"
            final = await client.prepare_until_final(checkpoint_id, deadline_in(TIMEOUT))
            if not final.readiness.ready:
                raise RuntimeError("the resources server did not get prepared")
            before = await phase_seconds(server.http)
            started = now()
            reply = await client.commit(checkpoint_id, deadline_in(TIMEOUT), str(directory))
            commits.append(now() - started)
            after = await phase_seconds(server.http)
            exports.append(phase_delta(before, after, "export"))
            writes.append(phase_delta(before, after, "write"))
            await client.resume(checkpoint_id, deadline_in(TIMEOUT))
            if reply.manifest.record_count != sessions:
                raise RuntimeError(f"committed {reply.manifest.record_count} of {sessions}")
            commit_bytes = reply.manifest.bytes
            if repeat == 0:
                source = str(directory)
            else:
                shutil.rmtree(directory, ignore_errors=True)
            raw_path = workdir / f"raw-{repeat}.jsonl"
            written = await raw("write", raw_path, sessions, size)
            raw_writes.append(written["seconds"])
            raw_bytes = written["bytes"]
            fast_path = workdir / f"fast-{repeat}.jsonl"
            fast = await raw("write", fast_path, sessions, size, codec="fast")
            fast_writes.append(fast["seconds"])
    finally:
        await client.close()
        processes.stop_servers([server])
    scope = [EpisodeId(rollout(i), 1) for i in range(sessions)]
    ctx.say(f"throughput {label}: {repeats} restores (fresh processes) and raw reads")
    for repeat in range(repeats):
        fresh = await asyncio.to_thread(
            processes.serve, instance, "prompt_injection", "--start-closed", env=METRICS_ENV
        )
        client = ParticipantClient(fresh.grpc or "", processes.token, timeout=TIMEOUT)
        try:
            await client.get_participant()  # connected before the clock starts
            before = await phase_seconds(fresh.http)
            resident = rss_bytes(fresh)
            started = now()
            reply = await client.restore(
                f"bench-restore-{repeat}", deadline_in(TIMEOUT), source, scope
            )
            restores.append(now() - started)
            memory.append((rss_bytes(fresh) - resident) / commit_bytes)
            after = await phase_seconds(fresh.http)
            reads.append(phase_delta(before, after, "read"))
            installs.append(phase_delta(before, after, "install"))
            if len(reply.restored) != sessions:
                raise RuntimeError(f"restored {len(reply.restored)} of {sessions}")
        finally:
            await client.close()
            processes.stop_servers([fresh])
        read = await raw("read", workdir / f"raw-{repeat}.jsonl")
        raw_reads.append(read["seconds"])
        fast = await raw("read", workdir / f"fast-{repeat}.jsonl", codec="fast")
        fast_reads.append(fast["seconds"])
    shutil.rmtree(workdir, ignore_errors=True)

    mb = commit_bytes / MB
    raw_mb = raw_bytes / MB
    note = f"{commit_bytes / sessions / 1000:.1f} KB per record, {mb:.1f} MB"
    commit = f"{label}: commit"
    restore = f"{label}: restore (fresh process)"
    raw_write = f"{label}: raw write (serialize + write + fsync)"
    raw_read = f"{label}: raw read (read + parse, kept)"
    result.figure(commit, "Commit call -> reply", "s", commits, note=note)
    result.figure(commit, "sessions/s", "sessions/s", [sessions / s for s in commits])
    result.figure(commit, "throughput", "MB/s", [mb / s for s in commits])
    result.figure(commit, "of which export (the server's hook)", "s", exports)
    result.figure(commit, "of which write (serialize, write, fsync, hash)", "s", writes)
    result.figure(raw_write, "time", "s", raw_writes, note=f"{raw_mb:.1f} MB")
    result.figure(raw_write, "throughput", "MB/s", [raw_mb / s for s in raw_writes])
    result.figure(restore, "Restore call -> reply", "s", restores)
    result.figure(restore, "sessions/s", "sessions/s", [sessions / s for s in restores])
    result.figure(restore, "throughput", "MB/s", [mb / s for s in restores])
    result.figure(restore, "of which read (read, hash, parse)", "s", reads)
    result.figure(restore, "of which install (the server's hook)", "s", installs)
    result.figure(
        restore,
        "memory: RSS growth / records bytes",
        "x",
        memory,
        note="the participant's VmRSS just before the Restore call and after its reply",
    )
    result.figure(raw_read, "time", "s", raw_reads)
    result.figure(raw_read, "throughput", "MB/s", [raw_mb / s for s in raw_reads])
    result.figure(f"{label}: raw write with orjson", "time", "s", fast_writes)
    result.figure(f"{label}: raw read with msgspec (kept)", "time", "s", fast_reads)
    result.ratio(f"{label}: commit / raw write", "commit", "raw write", ratios(commits, raw_writes))
    result.ratio(
        f"{label}: commit's write phase / raw write",
        "write phase",
        "raw write",
        ratios(writes, raw_writes),
    )
    result.ratio(f"{label}: restore / raw read", "restore", "raw read", ratios(restores, raw_reads))
    result.ratio(
        f"{label}: restore's read phase / raw read",
        "read phase",
        "raw read",
        ratios(reads, raw_reads),
    )
    result.ratio(
        f"{label}: commit / raw write with orjson",
        "commit",
        "raw write (orjson)",
        ratios(commits, fast_writes),
        note="the reference above uses the standard library; this one the runtime's encoder",
    )
    result.ratio(
        f"{label}: restore / raw read with msgspec",
        "restore",
        "raw read (msgspec)",
        ratios(restores, fast_reads),
        note="the runtime's decoder, with the collector running as in any plain script",
    )
    result.ratio(
        f"{label}: participant memory after the restore / records bytes",
        "RSS growth",
        "records bytes",
        memory,
    )


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    result = BenchResult(
        "throughput",
        "2. Commit and restore throughput",
        "A prompt-injection server with N sessions whose environments are scaled up to S of "
        "JSON. Commit: Commit call -> reply (export, serialize, write, fsync, hash, manifest). "
        "Restore: into a fresh process started closed, Restore call -> reply (read, verify, "
        "parse, validate, install). Raw limit: a plain script serializing the same states with "
        "the standard library's json, writing and fsyncing them; and reading them back and "
        "parsing them (kept in memory) in a fresh process; the same script with orjson and "
        "msgspec is a second reference. Memory: the participant's VmRSS growth over the "
        "Restore call per byte of records restored.",
        params={"states": params.states, "repeats": params.store_repeats},
    )
    for sessions, size in params.states:
        await one_case(ctx, result, sessions, size)
    return result
