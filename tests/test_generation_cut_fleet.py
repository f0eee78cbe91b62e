"""A long generation cut mid-way, the whole fleet SIGKILLed and restored (real processes).

Four processes (prompt-injection server, scripted policy model generating token by token,
agent, environment) run one rollout uninterrupted, for the baseline. A second fleet runs the
same rollout; once its final message (the longest generation) has begun, the fleet is
checkpointed and published, with the model closed mid-generation: it stages the prefix
generated so far (a generation cut). Every process is SIGKILLed; fresh ones started closed
are restored from the published checkpoint and resumed, and the rollout is sent again as
attempt 1. The restored agent re-issues the final call, the model attaches the cut's prefix
(same conversation digest), and the reply must equal the baseline while the model generates
only the remainder (its token counter, `GET /scripted/stats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from pathlib import Path
from typing import Any

import httpx

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import checkpoint, restore_published
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.examples.demo import FleetProcesses, launch_server, serve_options
from rollout_checkpoint.examples.policy_model import ScriptedPolicy
from rollout_checkpoint.examples.prompt_injection import load_tasks
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage

from .conftest import TOKEN

TASK = next(t for t in load_tasks() if t["task_id"] == "hr-003-resume-exfiltration")
ROLLOUT = next(
    f"cut{i}"
    for i in range(100)
    if not ScriptedPolicy([TASK]).falls_for_injection(TASK["task_id"], f"cut{i}")
)
FINAL_STEP = len(TASK["reference_plan"])
TOKEN_LATENCY = 0.06
"""Seconds per generated token: the final message (23 tokens) takes about 1.4 s, the window
in which the checkpoint must close the model (a Prepare of the four takes well under that)."""
TIMEOUT = 60.0


async def start(logs: Path, label: str, *, start_closed: bool) -> FleetProcesses:
    fleet = FleetProcesses(label)
    common = serve_options(TOKEN, start_closed=start_closed)

    def launch(name: str, kind: str, args: list[str]) -> None:
        fleet.servers[name] = launch_server(label, logs, name, kind, args)

    await asyncio.gather(
        asyncio.to_thread(launch, "prompt_injection", "resources", ["prompt_injection", *common]),
        asyncio.to_thread(
            launch,
            "policy_model",
            "model",
            ["policy_model", "--latency", "0", "--token-latency", str(TOKEN_LATENCY), *common],
        ),
    )
    model, tools = fleet.url("policy_model"), fleet.url("prompt_injection")
    await asyncio.to_thread(
        launch,
        "agent",
        "agent",
        ["agent", "--model-url", model, "--resources", f"prompt_injection={tools}", *common],
    )
    await asyncio.to_thread(
        launch,
        "environment",
        "environment",
        ["environment", "--agent-url", fleet.url("agent"), *common],
    )
    return fleet


async def run(http: httpx.AsyncClient, fleet: FleetProcesses, attempt: int = 0) -> dict[str, Any]:
    key = EpisodeId(ROLLOUT, attempt).capture_key
    reply = await http.post(f"{fleet.url('environment')}/ng-rollout/{key}/run", json={"task": TASK})
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def stats(http: httpx.AsyncClient, fleet: FleetProcesses) -> dict[str, Any]:
    reply = await http.get(f"{fleet.url('policy_model')}/scripted/stats")
    result: dict[str, Any] = reply.json()
    return result


async def final_generation_begun(http: httpx.AsyncClient, fleet: FleetProcesses) -> None:
    """Until the model has generated a token of the rollout's final message (the state lives
    in another process: read it, bounded)."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            generating = (await stats(http, fleet))["generating"]
            if any(g["step"] == FINAL_STEP and g["generated"] >= 1 for g in generating):
                return
            await asyncio.sleep(0.005)


def model_record(directory: Path) -> dict[str, Any]:
    # The runtime's reader: the model checkpoints incrementally (reference lines).
    _, records = LocalStorage().read_part(str(directory), "model", "policy_model", lambda _r: True)
    (record,) = records
    return record


async def test_a_cut_generation_continues_after_the_fleet_is_killed_and_restored(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    root = CheckpointRoot(tmp_path / "checkpoints")
    fleets: list[FleetProcesses] = []
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        try:
            fleets.append(baseline_fleet := await start(logs, "baseline", start_closed=False))
            baseline = await run(http, baseline_fleet)
            final = baseline["messages"][-1]["content"]
            total = math.ceil(len(final) / 4)
            assert (await stats(http, baseline_fleet))["continued_calls"] == 0

            fleets.append(first := await start(logs, "first", start_closed=False))
            running = asyncio.ensure_future(run(http, first))
            await final_generation_begun(http, first)
            deadline = time.time() + TIMEOUT
            async with await Fleet.discover(first.spec(TOKEN)) as fleet:
                events = [
                    e
                    async for e in checkpoint(
                        fleet, root, deadline, scope=[EpisodeId(ROLLOUT)], keep_closed=True
                    )
                ]
            outcome = events[-1].outcome
            assert outcome is not None and outcome.published is not None, events[-1]
            cut = model_record(root.directory(outcome.checkpoint_id))["generation_cut"]
            assert 1 <= cut["tokens"] < total and final.startswith(cut["text"])
            first.kill()
            running.cancel()
            with contextlib.suppress(BaseException):  # its environment died under it
                await running

            fleets.append(restored := await start(logs, "restored", start_closed=True))
            async with await Fleet.discover(restored.spec(TOKEN)) as fleet:
                await restore_published(fleet, root, "restore-1", time.time() + TIMEOUT)
                await fanout.resume(fleet, "restore-1", time.time() + TIMEOUT)
            continued = await run(http, restored, attempt=1)
            assert continued["messages"] == baseline["messages"]
            assert continued["reward"] == baseline["reward"]
            assert continued["continued_from_step"] == FINAL_STEP
            counted = await stats(http, restored)
            assert counted["continued_calls"] == 1
            assert counted["generated_tokens"] == total - cut["tokens"]
        finally:
            for processes in fleets:
                processes.kill()
