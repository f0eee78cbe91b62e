"""Benchmark 5: prepare + commit + resume across 4, 8 and 16 participants (separate processes).

The largest fleet is started once: groups of one environment, policy model, agent and counter
resources server (each counter holding `fleet_sessions` live sessions). A fleet of size S is
its first S/4 groups, so the sizes run interleaved round by round on the same processes.
Through the coordination library: prepare (stage by stage, to PREPARED), commit (every
member at once, explicit scope: every live session), resume (reverse stage order).
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.server.core.episodes import EpisodeId

from .common import BenchResult, deadline_in, ms, now, ratios
from .fleetutil import Group, discover, seed_sessions, start_groups
from .httpraw import json_body

TIMEOUT = 120.0


def session_rollout(group: int, index: int) -> str:
    return f"g{group}s{index}"


async def cycle(
    fleet: Fleet, checkpoint_id: str, directory: str, scope: list[EpisodeId]
) -> dict[str, float]:
    started = now()
    progress = await fanout.prepare_until_done(fleet, checkpoint_id, deadline_in(TIMEOUT))
    prepared = now()
    if not progress.prepared:
        raise RuntimeError(f"the fleet did not get prepared: {progress.outcome}")
    committed_reply = await fanout.commit(
        fleet, checkpoint_id, deadline_in(TIMEOUT), directory, scope
    )
    committed = now()
    await fanout.resume(fleet, checkpoint_id, deadline_in(TIMEOUT))
    resumed = now()
    if committed_reply.record_count() < len(scope):
        raise RuntimeError(f"committed {committed_reply.record_count()} records of {len(scope)}")
    return {
        "total": resumed - started,
        "prepare": prepared - started,
        "commit": committed - prepared,
        "resume": resumed - committed,
    }


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    processes = ctx.processes
    sizes = sorted(params.fleet_sizes)
    result = BenchResult(
        "fleet",
        "5. Fleet scale (prepare + commit + resume)",
        "Groups of one environment, policy model, agent and counter resources server, each its "
        f"own process; every counter holds {params.fleet_sessions} live sessions. Through the "
        "coordination library: prepare to PREPARED, commit (explicit scope, every live session), "
        "resume; the sizes alternate round by round on the same processes.",
        params={"sizes": sizes, "sessions": params.fleet_sessions, "repeats": params.repeats},
    )
    ctx.say(f"fleet: starting {sizes[-1]} participants")
    groups: list[Group] = await start_groups(processes, sizes[-1] // 4, "counter", tag="scale-")
    fleets: dict[int, Fleet] = {}
    scopes: dict[int, list[EpisodeId]] = {}
    timings: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
    try:
        for number, group in enumerate(groups):
            await seed_sessions(
                group.resources.http,
                range(params.fleet_sessions),
                lambda i, g=number: session_rollout(g, i),
                lambda i: json_body({"initial_count": i}),
            )
        for size in sizes:
            members = groups[: size // 4]
            fleets[size] = await discover([s for g in members for s in g.servers], processes.token)
            scopes[size] = [
                EpisodeId(session_rollout(g, i), 1)
                for g in range(len(members))
                for i in range(params.fleet_sessions)
            ]
        root = ctx.workdir / "fleet-checkpoints"
        await asyncio.to_thread(root.mkdir, exist_ok=True)
        for repeat in range(-1, params.repeats):  # round -1 warms every channel, unmeasured
            if repeat >= 0:
                ctx.say(f"fleet: round {repeat + 1}/{params.repeats}")
            for size in sizes:
                checkpoint_id = f"bench-fleet-{size}-{repeat + 1}"
                directory = root / checkpoint_id
                timing = await cycle(fleets[size], checkpoint_id, str(directory), scopes[size])
                if repeat >= 0:
                    timings[size].append(timing)
    finally:
        await asyncio.gather(*(f.close() for f in fleets.values()))
        # Only at the end: the counter checkpoints incrementally, so a later checkpoint may
        # reference any earlier one of the run (a commit whose references are gone is refused).
        await asyncio.to_thread(shutil.rmtree, ctx.workdir / "fleet-checkpoints", True)
        processes.stop_servers([s for g in groups for s in g.servers])
    for size in sizes:
        for phase in ("total", "prepare", "commit", "resume"):
            result.figure(
                f"{size} participants",
                "prepare + commit + resume" if phase == "total" else phase,
                "ms",
                [ms(t[phase]) for t in timings[size]],
            )
    smallest = sizes[0]
    for size in sizes[1:]:
        result.ratio(
            f"{size} / {smallest} participants (end to end)",
            f"{size} total",
            f"{smallest} total",
            ratios([t["total"] for t in timings[size]], [t["total"] for t in timings[smallest]]),
        )
    return result
