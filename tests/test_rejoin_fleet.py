"""One member of the example fleet SIGKILLed, replaced, and the whole fleet restored.

The supervisor's case (a fleet that heals itself): five real processes (the demo's fleet)
run rollouts, a checkpoint is taken and published mid-flight, and the fleet is resumed, so
the survivors go on serving past the cut. Then ONE member (the agent) is SIGKILLed and its
replacement starts closed on the same addresses. The four survivors have served, so a plain
Restore is refused FRESH_PROCESS_REQUIRED; a rejoining one restores the whole fleet from the
published checkpoint, all or nothing: every survivor discards what it held (the sessions,
ledgers and episodes it carried on since the cut) and installs the checkpoint's state. The
continued rollouts, re-sent as attempt N+1, must end exactly as an uninterrupted baseline.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import restore_published
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.examples.demo import (
    Demo,
    FleetProcesses,
    Options,
    Rollout,
    launch_server,
    make_rollouts,
    run_all,
    run_one,
    serve_options,
    signal_group,
)
from rollout_checkpoint.examples.demo.comparison import trajectory_of

from .conftest import refused

ROLLOUTS = 12
LATENCY = 0.2
"""Seconds per scripted model call: the cut (once the first rollout finished) finds the
longer rollouts in flight, and they are still running on the survivors when the agent dies
right after the resume."""
TIMEOUT = 60.0


async def run_until_checkpointed(
    demo: Demo, processes: FleetProcesses, root: CheckpointRoot, rollouts: list[Rollout]
) -> tuple[dict[str, object], list[asyncio.Future[None]], httpx.AsyncClient]:
    """Dispatch every rollout; once one finished, checkpoint and publish (the demo's own
    cut); the rollouts' tasks go on."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(300.0))
    finished = asyncio.Event()

    async def dispatch(rollout: Rollout) -> None:
        await run_one(client, processes.url("environment"), rollout)
        if rollout.reply is not None:
            finished.set()

    tasks = [asyncio.ensure_future(dispatch(r)) for r in rollouts]
    await asyncio.wait_for(finished.wait(), TIMEOUT)
    checkpoint = await demo.take_checkpoint(processes, root, rollouts)
    return checkpoint, tasks, client


def replace_agent(processes: FleetProcesses, logs: Path, token: str) -> None:
    """SIGKILL the agent, then start its replacement closed on the same addresses."""
    dead = processes.servers["agent"]
    signal_group(dead.process, signal.SIGKILL)
    dead.process.wait(timeout=30)
    processes.servers["agent"] = launch_server(
        "replacement",
        logs,
        "agent",
        "agent",
        [
            "agent",
            "--http-address",
            dead.http,
            "--grpc-address",
            dead.grpc,
            "--model-url",
            processes.url("policy_model"),
            "--resources",
            f"prompt_injection={processes.url('prompt_injection')}",
            "--resources",
            f"counter={processes.url('counter')}",
            *serve_options(token, start_closed=True),
        ],
    )


async def test_a_fleet_with_one_member_replaced_rejoins_and_matches_the_baseline(
    tmp_path: Path,
) -> None:
    options = Options(
        rollouts=ROLLOUTS, concurrency=ROLLOUTS, latency=LATENCY, json=True, timeout=TIMEOUT
    )
    demo = Demo(options)
    logs = tmp_path / "logs"
    logs.mkdir()
    root = CheckpointRoot(tmp_path / "checkpoints")
    try:
        baseline = await demo.baseline(logs)
        assert demo.report.passed, demo.report.problems

        processes = await demo.start(logs, "first", start_closed=False)
        rollouts = make_rollouts(ROLLOUTS)
        checkpoint, tasks, client = await run_until_checkpointed(demo, processes, root, rollouts)
        scope = checkpoint["scope"]
        assert isinstance(scope, list) and scope, "the cut found no rollout in flight"
        deadline = time.time() + TIMEOUT
        async with await Fleet.discover(processes.spec(demo.token)) as fleet:
            await fanout.resume(fleet, str(checkpoint["id"]), deadline)
        # The survivors go on serving past the cut until the agent dies under them.
        await asyncio.to_thread(replace_agent, processes, logs, demo.token)

        deadline = time.time() + TIMEOUT
        async with await Fleet.discover(processes.spec(demo.token)) as fleet:
            # A survivor has served: a restore that does not rejoin is refused (nothing
            # changes; the fleet restore below would otherwise be all or nothing refused).
            await refused(
                fleet.member("environment").client.restore(
                    "restore-1", deadline, str(checkpoint["directory"]), scope
                ),
                "FRESH_PROCESS_REQUIRED",
            )
            restored = await restore_published(fleet, root, "restore-1", deadline, rejoin=True)
            assert list(restored.continued) == scope
            await fanout.resume(fleet, "restore-1", deadline)
        # The environment kept its episodes at their boundary while the agent was gone (its
        # relay re-issues a call that cannot reach its callee); the rejoin retired them, so
        # their requests end now (409 stale_attempt).
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
        await client.aclose()

        # Continue every checkpointed rollout as attempt N+1, whatever it did after the cut.
        in_scope = {e.rollout_id for e in scope}
        for rollout in rollouts:
            if rollout.rollout_id in in_scope:
                rollout.attempt, rollout.reply, rollout.error = 1, None, None
        remaining = [r for r in rollouts if r.reply is None]
        assert {r.rollout_id for r in remaining} == in_scope
        await run_all(processes.url("environment"), remaining, ROLLOUTS)
        failed = {r.rollout_id: r.error for r in rollouts if r.reply is None}
        assert not failed, failed
        differing = [
            r.rollout_id
            for r in rollouts
            if trajectory_of(r.reply or {}) != trajectory_of(baseline[r.rollout_id].reply or {})
        ]
        assert not differing, f"differ from the uninterrupted baseline: {differing}"
    finally:
        for fleet_processes in demo.fleets:
            fleet_processes.stop()
