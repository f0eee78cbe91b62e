"""Benchmark 7: bounded state: what a fleet holds after many finished rollouts, driven by hand.

Two fresh fleets of one environment, policy model, agent and prompt-injection server (each
its own process), driven the way a controller other than `collect` drives them: rollouts
sent to the environment by hand, never a Forget, never a checkpoint until the end.

* A: `finished` rollouts run to the end (`in_flight` at a time), then `in_flight` more are
  started and caught mid-episode by a checkpoint with a derived scope (prepare, ListEpisodes
  of every member, commit);
* B: the same `in_flight` rollouts caught the same way, none finished before.

Measured after the commit, before the resume: the checkpoint's size (every file of every
part), each server process's resident memory (VmRSS), and what each participant tracks (the
readiness counts of GetStatus: the model's ledgers, the agent's and environment's live
episodes and kept outcomes, the resources' sessions). The ratios A / B are the point: a fleet
holds what is in flight, not its history, so they should stay near 1 (goal: at most 1.5).
Also reported: the model's ledgers and resident memory just before the commit (what a fleet
that has not committed since still holds: the model cannot tell a finished episode from one
between two calls, so the example agent tells it once its reply left, and the ledger goes
then; an agent that does not would leave them to the commit). With `--checkpoint-every N`, a
run C does what A does with a derived-scope checkpoint after every N finished rollouts, as a
controller that checkpoints as it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import DERIVE
from rollout_checkpoint.client.fleet import Fleet

from .common import BenchResult, Processes, Server, deadline_in, now, ratios, rss_bytes
from .fleetutil import Group, discover, start_groups
from .httpraw import Connection, HttpError, Response, json_body
from .states import task_rows

TIMEOUT = 600.0


@dataclass
class Measured:
    """One run's figures."""

    in_flight: int = 0
    checkpoint_bytes: int = 0
    rss: dict[str, int] = field(default_factory=dict)
    """Resident bytes per role (environment, model, agent, resources)."""
    tracked: dict[str, int] = field(default_factory=dict)
    """Entries each role tracks (model: ledgers; agent, environment: live episodes plus kept
    outcomes; resources: sessions)."""
    ledgers_before_commit: int = 0
    rss_before_commit: dict[str, int] = field(default_factory=dict)
    finished_seconds: float = 0.0
    prepare_seconds: float = 0.0
    failed: int = 0
    """Rollouts answered HTTP 500 (see `drive`)."""


def roles(group: Group) -> dict[str, Server]:
    return {
        "environment": group.environment,
        "model": group.model,
        "agent": group.agent,
        "resources": group.resources,
    }


async def tracked_entries(fleet: Fleet, group: Group) -> dict[str, int]:
    counts = {}
    for role, server in roles(group).items():
        status = await fleet.member(server.name).client.get_status()
        readiness = dict(status.readiness.counts)
        if role == "model":
            counts[role] = readiness["episodes"]
        elif role == "resources":
            counts[role] = readiness["sessions"]
        else:
            counts[role] = readiness["episodes"] + readiness["outcomes"]
    return counts


def longest_task() -> dict[str, Any]:
    """The task with the longest reference plan: its rollouts stay in flight the longest."""
    tasks = [json.loads(text) for text in task_rows()]
    return max(tasks, key=lambda task: len(task["reference_plan"]))


async def drive(
    address: str, names: list[str], workers: int, only: dict[str, Any] | None = None
) -> int:
    """Run these rollouts to the end through the environment, `workers` at a time (each on
    the example task its number picks, or all on `only`); returns how many failed.

    A rollout may fail (HTTP 500) when the example agent's keep-alive connection to the model
    is closed by the model's server just as it is reused (httpx `ReadError`; both sides
    expire idle connections after 5 s): counted, not fatal, so a long run is not lost. The
    environment's server closes the connection after such a 500: the worker reconnects."""
    tasks = [only] if only is not None else [json.loads(text) for text in task_rows()]
    queue = list(reversed(names))
    failures: list[str] = []

    async def work() -> None:
        connection = await Connection.open(address)
        try:
            while queue:
                rollout = queue.pop()
                task = tasks[int(rollout.rsplit("-", 1)[1]) % len(tasks)]
                try:
                    reply = await connection.request(
                        "POST", f"/ng-rollout/{rollout}/run", json_body({"task": task})
                    )
                except (HttpError, OSError):
                    reply = Response(500)
                if reply.status == 500:
                    failures.append(rollout)
                    with contextlib.suppress(OSError):
                        await connection.close()
                    connection = await Connection.open(address)
                elif reply.status != 200:
                    raise RuntimeError(f"{rollout}: HTTP {reply.status} {reply.body[:200]!r}")
        finally:
            with contextlib.suppress(OSError):
                await connection.close()

    await asyncio.gather(*(work() for _ in range(min(workers, len(names)) or 1)))
    return len(failures)


async def model_ledgers(fleet: Fleet, group: Group) -> int:
    """The ledgers the policy model keeps (its `episodes` count)."""
    status = await fleet.member(group.model.name).client.get_status()
    return int(status.readiness.counts["episodes"])


async def settled_ledgers(fleet: Fleet, group: Group) -> int:
    """The model's ledgers once the finished rollouts' releases arrived: the agent tells the
    model that an episode finished just after its reply left, so the count may still be
    falling when the last reply is in. Read until two reads 0.2 s apart agree."""
    last = await model_ledgers(fleet, group)
    async with asyncio.timeout(TIMEOUT):
        while True:
            await asyncio.sleep(0.2)  # the state lives in another process
            current = await model_ledgers(fleet, group)
            if current == last:
                return current
            last = current


async def checkpoint(fleet: Fleet, checkpoint_id: str, directory: Path) -> int:
    """Prepare, commit with a derived scope, resume; returns the scope's size."""
    progress = await fanout.prepare_until_done(fleet, checkpoint_id, deadline_in(TIMEOUT))
    if not progress.prepared:
        raise RuntimeError(f"not prepared: {progress.outcome} {progress.blockers()}")
    committed = await fanout.commit(
        fleet, checkpoint_id, deadline_in(TIMEOUT), str(directory), DERIVE
    )
    await fanout.resume(fleet, checkpoint_id, deadline_in(TIMEOUT))
    shutil.rmtree(directory, ignore_errors=True)
    assert committed.scope is not None
    return len(committed.scope)


async def run_finished(
    fleet: Fleet, group: Group, finished: int, workers: int, every: int, workdir: Path
) -> int:
    """Run `finished` rollouts to the end; with `every`, a checkpoint after each `every`.
    Returns how many failed."""
    names = [f"done-{i}" for i in range(finished)]
    failed = 0
    for start in range(0, finished, every or finished or 1):
        chunk = names[start : start + (every or finished)]
        failed += await drive(group.environment.http, chunk, workers)
        if every and start + len(chunk) < finished:
            await checkpoint(fleet, f"periodic-{start}", workdir / "periodic")
    return failed


async def one_run(
    processes: Processes,
    tag: str,
    finished: int,
    in_flight: int,
    latency: float,
    workdir: Path,
    every: int = 0,
) -> Measured:
    (group,) = await start_groups(processes, 1, tag=tag, model_latency=latency)
    measured = Measured()
    try:
        fleet = await discover(group.servers, processes.token)
        async with fleet:
            started = now()
            measured.failed = await run_finished(fleet, group, finished, in_flight, every, workdir)
            measured.finished_seconds = now() - started
            ledgers = await settled_ledgers(fleet, group)
            names = [f"live-{i}" for i in range(in_flight)]
            live = asyncio.ensure_future(
                drive(group.environment.http, names, in_flight, longest_task())
            )
            # Cut them mid-episode, once each has a delivered model call (a new ledger each;
            # the longest task makes 6, so at the default 0.2 s per generation none ends
            # before the cut): a ledger, a session and a boundary to export.
            async with asyncio.timeout(TIMEOUT):
                while await model_ledgers(fleet, group) < ledgers + in_flight:
                    if live.done():
                        live.result()
                        raise RuntimeError("the rollouts meant to be in flight all finished")
                    await asyncio.sleep(0.002)  # the state lives in another process
            preparing = now()
            progress = await fanout.prepare_until_done(fleet, tag, deadline_in(TIMEOUT))
            if not progress.prepared:
                raise RuntimeError(f"not prepared: {progress.outcome} {progress.blockers()}")
            measured.prepare_seconds = now() - preparing
            measured.ledgers_before_commit = await model_ledgers(fleet, group)
            measured.rss_before_commit = {role: rss_bytes(s) for role, s in roles(group).items()}
            directory = workdir / tag
            committed = await fanout.commit(
                fleet, tag, deadline_in(TIMEOUT), str(directory), DERIVE
            )
            assert committed.scope is not None
            measured.in_flight = len(committed.scope)
            measured.checkpoint_bytes = sum(
                p.stat().st_size for p in directory.rglob("*") if p.is_file()
            )
            measured.rss = {role: rss_bytes(s) for role, s in roles(group).items()}
            measured.tracked = await tracked_entries(fleet, group)
            await fanout.resume(fleet, tag, deadline_in(TIMEOUT))
            measured.failed += await live
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        processes.stop_servers(group.servers)
    return measured


def report(result: BenchResult, label: str, finished: int, m: Measured) -> None:
    case = f"{label}: {finished:,} finished, {m.in_flight} in flight"
    result.figure(case, "checkpoint size", "bytes", [m.checkpoint_bytes])
    result.figure(case, "rollouts in the checkpoint scope", "episodes", [m.in_flight])
    result.figure(case, "prepare (Prepare call -> PREPARED)", "ms", [m.prepare_seconds * 1000])
    result.figure(case, "rollouts failed (HTTP 500, a keep-alive race)", "rollouts", [m.failed])
    for role, value in m.rss.items():
        result.figure(case, f"{role} resident memory", "MB", [value / 2**20])
    for role, value in m.tracked.items():
        result.figure(case, f"{role} tracked entries", "entries", [value])
    result.figure(
        case, "model ledgers just before the commit", "ledgers", [m.ledgers_before_commit]
    )
    result.figure(
        case,
        "model resident memory just before the commit",
        "MB",
        [m.rss_before_commit["model"] / 2**20],
    )
    if finished:
        result.figure(
            case, "finished rollouts per second", "rollouts/s", [finished / m.finished_seconds]
        )


def compare(result: BenchResult, name: str, a: Measured, b: Measured) -> None:
    result.ratio(
        f"checkpoint size {name}", "A", "B", ratios([a.checkpoint_bytes], [b.checkpoint_bytes])
    )
    result.ratio(
        f"resident memory of the fleet {name}",
        "A",
        "B",
        ratios([sum(a.rss.values())], [sum(b.rss.values())]),
    )
    for role in a.rss:
        result.ratio(
            f"{role} resident memory {name}", "A", "B", ratios([a.rss[role]], [b.rss[role]])
        )
    result.ratio(
        f"tracked entries of the fleet {name}",
        "A",
        "B",
        ratios([sum(a.tracked.values())], [sum(b.tracked.values())]),
    )


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    finished, in_flight = params.finished, params.bounded_inflight
    latency, every = params.bounded_latency, params.checkpoint_every
    periodic = (
        f"; C (with `--checkpoint-every {every}`): as A, with a derived-scope checkpoint after "
        f"every {every:,} finished"
        if every
        else ""
    )
    result = BenchResult(
        "bounded",
        "7. Bounded state (history does not grow the fleet)",
        "One environment, policy model, agent and prompt-injection server, each its own process, "
        "driven by hand (no collect, no Forget). A: "
        f"{finished:,} rollouts run to the end ({in_flight} at a time), then {in_flight} caught "
        f"in flight by a derived-scope checkpoint, the first; B: the same {in_flight} in flight, "
        f"none finished{periodic}. Scripted model: {latency * 1000:g} ms per generation. "
        "Measured after the commit: checkpoint bytes (every file), resident memory (VmRSS) per "
        "process, and the entries each participant tracks (GetStatus counts). Goal: A / B at "
        "most 1.5.",
        params={
            "finished": finished,
            "in_flight": in_flight,
            "model_latency": latency,
            "checkpoint_every": every,
        },
    )
    plan = [("B", 0, 0), ("A", finished, 0)] + ([("C", finished, every)] if every else [])
    runs: dict[str, Measured] = {}
    for label, count, interval in plan:
        ctx.say(f"bounded: run {label}: {count:,} finished, then {in_flight} in flight")
        measured = await one_run(
            ctx.processes,
            f"bounded-{label.lower()}",
            count,
            in_flight,
            latency,
            ctx.workdir,
            interval,
        )
        runs[label] = measured
        report(result, label, count, measured)
        if count:
            rate = count / measured.finished_seconds
            ctx.say(
                f"bounded: {count:,} rollouts in {measured.finished_seconds:.0f} s ({rate:.0f}/s)"
            )
    compare(result, "A / B", runs["A"], runs["B"])
    if "C" in runs:
        compare(result, "C / B", runs["C"], runs["B"])
    return result
