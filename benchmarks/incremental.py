"""Incremental vs full checkpoints (issue 31): the pause, the bytes written, and the restore.

    python -m benchmarks.incremental                 # 10,000 x 5 KB (1 %, 10 %, 100 %), 1,000 x 50 KB
    python -m benchmarks.incremental --scale tiny    # 500 x 5 KB, 50 x 50 KB: a smoke run
    python -m benchmarks.incremental --json out.json

One resources participant (`ResourcesParticipant`, `checkpoint_incremental`) holding N sessions
of S bytes, with hooks on the fast path (states serialized once, in a thread: `EncodedJSON`),
and its `ControlPlane` in this process on local disk. Each round touches a share of the
sessions (as a request on each would), then takes two asynchronous checkpoints of that one cut
side by side: incremental, then full (the same participant with its opt-in switched off for
it, so both export the same state). Per round:

* pause: Prepare (admission closed) to Resume returned (admission open);
* bytes: the size of the records file the checkpoint wrote (an incremental part's own
  records and its reference lines);
* restore: a fresh participant and control plane restoring the last incremental part (the
  end of its chain) and the last full part, read, verified and installed.

Every ratio divides runs of one round; the goals are the issue's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_checkpoint.server.core.checkpoint_storage import PartStorage
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.resources.participant import (
    CheckpointMode,
    ResourcesParticipant,
    VerifyMode,
)
from rollout_checkpoint.server.runtime.control_plane import ControlPlane, ControlSettings
from rollout_checkpoint.server.runtime.part_writes import PartWriteState
from rollout_checkpoint.server.runtime.records_codec import EncodedJSON, encode_json

DEADLINE_SECONDS = 600.0
GOALS = {1: 0.05, 10: 0.15, 100: 1.05}
"""Touched share (%) -> the goal for the async pause, incremental / full."""
BYTES_GOAL_AT_10 = 0.12
RESTORE_GOAL = 1.2


class Sessions:
    """The server's state and its session hooks (the fast path of docs/your-server.md)."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}

    async def export_session_states(self, session_ids: list[str]) -> Mapping[str, Any]:
        held = {s: self.states[s] for s in session_ids if s in self.states}
        return await asyncio.to_thread(
            lambda: {s: EncodedJSON(encode_json(state)) for s, state in held.items()}
        )

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        self.states.update(states)

    async def retire_session_state(self, session_id: str) -> None:
        self.states.pop(session_id, None)


@dataclass
class Server:
    sessions: Sessions
    participant: ResourcesParticipant
    control: ControlPlane

    @classmethod
    async def start(cls, settings: ControlSettings) -> Server:
        sessions = Sessions()
        participant = ResourcesParticipant(
            "bench", CheckpointMode.EXPORTED, VerifyMode.WAIT, sessions, incremental=True
        )
        control = ControlPlane(participant, settings, storage=PartStorage())
        await control.start()
        return cls(sessions, participant, control)


@dataclass
class Case:
    count: int
    size: int
    touched: int
    """Per cent of the sessions touched between two checkpoints."""
    runs: dict[str, list[float]] = field(default_factory=dict)
    chains: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.count} x {self.size / 1000:g} KB, {self.touched} % touched"

    def add(self, name: str, value: float) -> None:
        self.runs.setdefault(name, []).append(value)


async def checkpoint(server: Server, directory: Path, *, full: bool) -> tuple[float, Any]:
    """One asynchronous checkpoint: its pause and its durable manifest."""
    control = server.control
    checkpoint_id = directory.name
    deadline = time.time() + DEADLINE_SECONDS
    server.participant.incremental = not full
    try:
        started = time.perf_counter()
        async for update in await control.prepare(checkpoint_id, deadline):
            if update.final:
                break
        await control.commit(checkpoint_id, deadline, str(directory), None, asynchronous=True)
        await control.resume(checkpoint_id, deadline)
        pause = time.perf_counter() - started
    finally:
        server.participant.incremental = True
    write = await control.await_part(checkpoint_id, deadline)
    assert write is not None and write.state is PartWriteState.DURABLE, write
    assert write.published is not None
    return pause, write.published.manifest


async def restore_seconds(directory: Path, count: int) -> float:
    fresh = await Server.start(ControlSettings())
    scope = frozenset(EpisodeId(f"r{i:06d}", 1) for i in range(count))
    try:
        started = time.perf_counter()
        await fresh.control.restore(
            "restore", time.time() + DEADLINE_SECONDS, str(directory), scope
        )
        return time.perf_counter() - started
    finally:
        await fresh.control.close()


async def measure(case: Case, root: Path, rounds: int) -> None:
    server = await Server.start(ControlSettings())
    blob = "x" * max(case.size - 40, 1)
    for i in range(case.count):
        session_id = f"s{i:06d}"
        server.sessions.states[session_id] = {"blob": blob, "n": 0}
        server.participant.session_started(session_id, EpisodeId(f"r{i:06d}", 1))
    step = max(1, round(100 / case.touched)) if case.touched < 100 else 1
    try:
        await checkpoint(server, root / "base", full=False)  # the chain starts full
        last: dict[str, Path] = {}
        for number in range(rounds):
            for i in range(number % step, case.count, step):
                session_id = f"s{i:06d}"
                server.sessions.states[session_id] = {"blob": blob, "n": number + 1}
                server.participant.touch(session_id)
            for kind in ("incremental", "full"):
                directory = root / f"{kind}-{number}"
                pause, manifest = await checkpoint(server, directory, full=kind == "full")
                case.add(f"{kind} pause", pause)
                case.add(f"{kind} bytes", manifest.bytes)
                last[kind] = directory
                if kind == "incremental":
                    case.chains.append(manifest.chain_length)
        for _ in range(3):
            for kind in ("incremental", "full"):
                case.add(f"{kind} restore", await restore_seconds(last[kind], case.count))
    finally:
        await server.control.close()


def ratio(case: Case, name: str) -> float:
    pairs = zip(case.runs[f"incremental {name}"], case.runs[f"full {name}"], strict=True)
    return statistics.median(a / b for a, b in pairs)


def report(cases: list[Case]) -> dict[str, Any]:
    rows = []
    for case in cases:
        pause, size, restore = ratio(case, "pause"), ratio(case, "bytes"), ratio(case, "restore")
        rows.append(
            {
                "case": case.label,
                "incremental pause ms": round(
                    statistics.median(case.runs["incremental pause"]) * 1e3, 1
                ),
                "full pause ms": round(statistics.median(case.runs["full pause"]) * 1e3, 1),
                "pause ratio": round(pause, 3),
                "pause goal": GOALS.get(case.touched),
                "bytes ratio": round(size, 4),
                "bytes goal": BYTES_GOAL_AT_10 if case.touched == 10 else None,
                "restore ratio (chain end / full)": round(restore, 3),
                "restore goal": RESTORE_GOAL,
                "chain lengths": case.chains,
            }
        )
    return {"rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", choices=("full", "tiny"), default="full")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    large, small = (10_000, 1_000) if args.scale == "full" else (500, 50)
    cases = [Case(large, 5_000, touched) for touched in (1, 10, 100)]
    cases.append(Case(small, 50_000, 10))
    work = Path(tempfile.mkdtemp(prefix="incremental-bench-"))
    try:
        for number, case in enumerate(cases):
            print(f"incremental: {case.label}", file=sys.stderr, flush=True)
            root = work / f"case-{number}"
            root.mkdir()
            asyncio.run(measure(case, root, args.rounds))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = report(cases)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    os.sync()


if __name__ == "__main__":
    main()
