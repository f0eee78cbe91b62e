"""Incremental parts of the environment, the agent and the policy model (issue 31).

    python -m benchmarks.episodic_incremental [--episodes 2000] [--rounds 6]

What a full part of each episodic kind and of the model costs at a realistic scale, and what
an incremental part saves. Each kind's participant (`EnvironmentParticipant`, the agent's
`EpisodeParticipant`, `ModelParticipant`) runs with its `ControlPlane` in this process on
local disk and holds N in-flight episodes, driven through the participant's own methods as
the example servers drive them:

* agent: each episode a task waiting in a replay step (its model call) at a boundary that
  holds the example agent's state after a few finished steps (messages, function calls);
  a touched episode finishes its step and records the next boundary;
* environment: each episode waiting in its relay to the agent at its one boundary (the
  task digest); a touched episode ended and a new rollout began in its place (the only
  way an environment's record changes);
* model: each episode a ledger of a few delivered calls (tool-call replies); a touched
  episode had one more call delivered. Commits name every episode (the model requires a
  scope).

Each round touches a share of the episodes, then takes two asynchronous checkpoints of that
cut side by side, incremental and full (the same participant with its opt-in switched off
for the full one), each first in every other round. Pause: Prepare to Resume returned;
bytes: the records file written; kept: it and every records file it references.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_checkpoint.server.core.checkpoint_storage import PartStorage
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.episodic.episode_participant import (
    EnvironmentParticipant,
    EpisodeParticipant,
)
from rollout_checkpoint.server.episodic.episode_steps import StepMode
from rollout_checkpoint.server.model.participant import ModelParticipant
from rollout_checkpoint.server.runtime.control_plane import ControlPlane, ControlSettings
from rollout_checkpoint.server.runtime.participant import Kind, Participant

from .incremental import checkpoint, kept_bytes

FINISHED_STEPS = 3
"""Steps each episode has finished when the measure starts ("a few")."""


def tool_call_reply(rollout: int, step: int) -> dict[str, Any]:
    """A chat completion that calls a tool, shaped like the example model's."""
    return {
        "id": f"chatcmpl-{rollout:06d}-{step}",
        "object": "chat.completion",
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": f"Step {step}: I will look this up before answering. " * 3,
                    "tool_calls": [
                        {
                            "id": f"call_{rollout}_{step}",
                            "type": "function",
                            "function": {
                                "name": "search_documents",
                                "arguments": json.dumps({"query": f"topic {rollout} part {step}"}),
                            },
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 812 + 90 * step, "completion_tokens": 64, "total_tokens": 900},
    }


def agent_state(rollout: int, steps: int) -> dict[str, Any]:
    """The example agent's boundary after `steps` finished steps."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant that uses tools. " * 6},
        {"role": "user", "content": f"Task {rollout}: summarize what the documents say. " * 3},
    ]
    calls = []
    for step in range(steps):
        message = tool_call_reply(rollout, step)["choices"][0]["message"]
        messages.append(message)
        result = {"documents": [f"doc-{rollout}-{step}-{i}: " + "lorem ipsum " * 8 for i in (1, 2)]}
        messages.append(
            {
                "role": "tool",
                "tool_call_id": f"call_{rollout}_{step}",
                "content": json.dumps(result),
            }
        )
        calls.append(
            {
                "name": "search_documents",
                "arguments": {"query": f"topic {rollout}"},
                "result": result,
            }
        )
    return {
        "resources_server": "http://127.0.0.1:8001",
        "step": steps,
        "messages": messages,
        "function_calls": calls,
        "cookies": {"session": f"s{rollout:06d}"},
        "verify_mode": "wait",
        "weight_versions": [3] * steps,
    }


@dataclass
class Slot:
    """One in-flight episode of an episodic kind: its task waits in a replay step until the
    bench advances it (`advance`: the next boundary, or None to end it and begin another)."""

    advance: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    rollout: int = 0


async def drive_slot(
    participant: EpisodeParticipant, slot: Slot, number: int, arrivals: asyncio.Queue[None]
) -> None:
    """Run episode after episode in one slot; `arrivals` gets one item each time an episode
    waits at a boundary again (what a round's checkpoint exports)."""
    steps = participant.episodes_tracker
    generation = 0
    while True:
        episode_id = EpisodeId(f"r{number:06d}-{generation}", 1)
        if isinstance(participant, EnvironmentParticipant):
            task = {"task_id": f"t{number}-{generation}", "prompt": "x" * 200}
            tracked, _ = participant.begin_task(episode_id, task)
            boundary: Any = {
                "next": "relay",
                "task_digest": hashlib.sha256(b"%d" % number).hexdigest(),
            }
        else:
            tracked, _ = participant.begin(episode_id)
            boundary = agent_state(number, FINISHED_STEPS)
        while boundary is not None:
            await steps.boundary(tracked, boundary)
            async with steps.step(tracked, StepMode.REPLAY):
                arrivals.put_nowait(None)
                boundary = await slot.advance.get()
        if isinstance(participant, EnvironmentParticipant):
            participant.end_task(tracked)
        else:
            steps.end(tracked)
        generation += 1


@dataclass
class Fleet:
    """One kind's participant and control plane, and how a round touches an episode."""

    participant: Participant
    control: ControlPlane
    touch: Callable[[int, int], None]
    scope: Callable[[], frozenset[EpisodeId] | None]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    arrivals: asyncio.Queue[None] | None = None
    """Episodic kinds: an item each time an episode waits at a boundary again."""

    async def settle(self, touched: int) -> None:
        """Wait until the `touched` episodes wait at their next boundary."""
        if self.arrivals is not None:
            for _ in range(touched):
                await self.arrivals.get()


async def episodic_fleet(kind: Kind, count: int) -> Fleet:
    participant: EpisodeParticipant = (
        EnvironmentParticipant("bench", incremental=True)
        if kind is Kind.ENVIRONMENT
        else EpisodeParticipant(Kind.AGENT, "bench", incremental=True)
    )
    control = ControlPlane(participant, ControlSettings(), storage=PartStorage())
    await control.start()
    slots = [Slot() for _ in range(count)]
    arrivals: asyncio.Queue[None] = asyncio.Queue()
    tasks = [
        asyncio.create_task(drive_slot(participant, s, i, arrivals)) for i, s in enumerate(slots)
    ]
    fleet = Fleet(participant, control, lambda number, round_number: None, lambda: None, tasks)
    fleet.arrivals = arrivals
    await fleet.settle(count)

    def touch(number: int, round_number: int) -> None:
        if kind is Kind.ENVIRONMENT:
            slots[number].advance.put_nowait(None)
        else:
            slots[number].advance.put_nowait(agent_state(number, FINISHED_STEPS + round_number % 2))

    fleet.touch = touch
    return fleet


async def model_fleet(count: int) -> Fleet:
    participant = ModelParticipant("bench", incremental=True)
    control = ControlPlane(participant, ControlSettings(), storage=PartStorage())
    await control.start()
    episodes = [EpisodeId(f"r{i:06d}", 1) for i in range(count)]

    def deliver(number: int, step: int) -> None:
        request = json.dumps({"messages": agent_state(number, step)["messages"]}).encode()
        call = participant.call_started(episodes[number], request)
        participant.delivered(call, json.dumps(tool_call_reply(number, step)).encode())
        participant.call_finished(call)

    for number in range(count):
        for step in range(FINISHED_STEPS):
            deliver(number, step)
    return Fleet(
        participant,
        control,
        lambda number, round_number: deliver(number, FINISHED_STEPS + round_number),
        lambda: frozenset(episodes),
    )


async def measure(kind: Kind, count: int, touched: int, rounds: int, root: Path) -> dict[str, Any]:
    fleet = await (model_fleet(count) if kind is Kind.MODEL else episodic_fleet(kind, count))
    runs: dict[str, list[float]] = {}
    chains: list[int] = []
    every = max(1, round(100 / touched))
    try:
        await checkpoint(fleet, root / "base", full=False, scope=fleet.scope())
        for number in range(rounds):
            touched_now = range(number % every, count, every)
            for i in touched_now:
                fleet.touch(i, number)
            await fleet.settle(len(touched_now))
            kinds = ("incremental", "full") if number % 2 == 0 else ("full", "incremental")
            for name in kinds:
                directory = root / f"{name}-{number}"
                pause, manifest = await checkpoint(
                    fleet, directory, full=name == "full", scope=fleet.scope()
                )
                runs.setdefault(f"{name} pause", []).append(pause)
                runs.setdefault(f"{name} bytes", []).append(manifest.bytes)
                runs.setdefault(f"{name} kept", []).append(kept_bytes(manifest))
                if name == "incremental":
                    chains.append(manifest.chain_length)
    finally:
        for task in fleet.tasks:
            task.cancel()
        await fleet.control.close()
    return {"runs": runs, "chains": chains}


def ratio(runs: dict[str, list[float]], name: str) -> float:
    return statistics.median(
        i / f for i, f in zip(runs[f"incremental {name}"], runs[f"full {name}"], strict=True)
    )


async def shares(episodes: int, rounds: int, step_seconds: float, interval: float) -> None:
    with tempfile.TemporaryDirectory(prefix="episodic-unchanged-") as work:
        for kind in (Kind.AGENT, Kind.ENVIRONMENT, Kind.MODEL):
            root = Path(work) / kind.value
            root.mkdir()
            found = await unchanged_share(kind, episodes, step_seconds, interval, rounds, root)
            print(
                f"{kind.value:11} {episodes} episodes, steps of {step_seconds:g} s, checkpoints "
                f"{interval:g} s apart: unchanged share per part "
                f"{', '.join(f'{share:.2f}' for share in found)}",
                flush=True,
            )


async def main(episodes: int, rounds: int, touched: list[int]) -> None:
    with tempfile.TemporaryDirectory(prefix="episodic-incremental-") as work:
        for kind in (Kind.AGENT, Kind.ENVIRONMENT, Kind.MODEL):
            for share in touched:
                root = Path(work) / f"{kind.value}-{share}"
                root.mkdir()
                result = await measure(kind, episodes, share, rounds, root)
                runs = result["runs"]
                print(
                    f"{kind.value:11} {episodes} episodes, {share:3d} % touched: "
                    f"full pause {statistics.median(runs['full pause']) * 1e3:7.1f} ms, "
                    f"full bytes {statistics.median(runs['full bytes']) / 1e3:8.1f} KB; "
                    f"incremental/full pause {ratio(runs, 'pause'):.3f}, "
                    f"bytes {ratio(runs, 'bytes'):.3f}, kept {ratio(runs, 'kept'):.3f}; "
                    f"chains {result['chains']}",
                    flush=True,
                )


async def unchanged_share(
    kind: Kind, count: int, step_seconds: float, interval: float, rounds: int, root: Path
) -> list[float]:
    """Episodes whose steps take `step_seconds` on average (exponential: mostly the model's
    generation), checkpointed every `interval` seconds: the share of each incremental part's
    records it referenced (unchanged since the part before). An environment's record moves
    only when its episode ends (after `STEPS_PER_EPISODE` steps) and another begins."""
    fleet = await (model_fleet(count) if kind is Kind.MODEL else episodic_fleet(kind, count))
    mean = step_seconds * (STEPS_PER_EPISODE if kind is Kind.ENVIRONMENT else 1)
    moved = [0] * count

    async def run_slot(number: int) -> None:
        while True:
            await asyncio.sleep(random.expovariate(1 / mean))
            moved[number] += 1
            fleet.touch(number, moved[number])

    movers = [asyncio.create_task(run_slot(i)) for i in range(count)]
    shares: list[float] = []
    try:
        await checkpoint(fleet, root / "base", full=False, scope=fleet.scope())
        for number in range(rounds):
            await asyncio.sleep(interval)
            _, manifest = await checkpoint(
                fleet, root / f"c{number}", full=False, scope=fleet.scope()
            )
            records = manifest.record_count
            shares.append(manifest.referenced_records / records if records else 0.0)
    finally:
        for task in [*movers, *fleet.tasks]:
            task.cancel()
        await fleet.control.close()
    return shares


STEPS_PER_EPISODE = 4


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--touched", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument(
        "--unchanged",
        type=float,
        nargs=2,
        metavar=("STEP_SECONDS", "INTERVAL"),
        help="instead: the share of records unchanged between checkpoints INTERVAL seconds "
        "apart, with steps of STEP_SECONDS on average",
    )
    arguments = parser.parse_args()
    if arguments.unchanged is None:
        asyncio.run(main(arguments.episodes, arguments.rounds, arguments.touched))
    else:
        asyncio.run(shares(arguments.episodes, arguments.rounds, *arguments.unchanged))
