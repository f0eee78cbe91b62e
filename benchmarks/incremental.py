"""12. Incremental vs full checkpoints (issue 31): the pause, the bytes written, the restore.

    python -m benchmarks --only incremental --merge     # 10,000 x 5 KB (1 %, 10 %, 100 %), 1,000 x 50 KB
    python -m benchmarks --only incremental --scale tiny

One resources participant (`ResourcesParticipant`, `checkpoint_incremental`) holding N sessions
of S bytes, with hooks on the fast path (states serialized once, in a thread: `EncodedJSON`),
and its `ControlPlane` in this process on local disk. Each round touches a share of the
sessions (as a request on each would), then takes two asynchronous checkpoints of that one cut
side by side, incremental and full, each first in every other round (the same participant with
its opt-in switched off for the full one, so both export the same state). Per round:

* pause: Prepare (admission closed) to Resume returned (admission open);
* bytes: the size of the records file the checkpoint wrote (an incremental part's own
  records and its reference lines);
* kept: the bytes retention keeps for the incremental part (its records file and every
  records file it references, whole) over the full part's;
* restore: a fresh participant and control plane restoring the last incremental part (the
  end of its chain) and the last full part, read, verified and installed.

Every ratio divides runs of one round; the goals are the issue's.
"""

from __future__ import annotations

import asyncio
import shutil
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

from .common import BenchResult, ratios

DEADLINE_SECONDS = 600.0


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


async def checkpoint(
    server: Any, directory: Path, *, full: bool, scope: frozenset[EpisodeId] | None = None
) -> tuple[float, Any]:
    """One asynchronous checkpoint of `server` (its `control` plane and its `participant`):
    its pause and its durable manifest."""
    control = server.control
    checkpoint_id = directory.name
    deadline = time.time() + DEADLINE_SECONDS
    server.participant.incremental = not full
    try:
        started = time.perf_counter()
        async for update in await control.prepare(checkpoint_id, deadline):
            if update.final:
                break
        await control.commit(checkpoint_id, deadline, str(directory), scope, asynchronous=True)
        await control.resume(checkpoint_id, deadline)
        pause = time.perf_counter() - started
    finally:
        server.participant.incremental = True
    write = await control.await_part(checkpoint_id, deadline)
    assert write is not None and write.state is PartWriteState.DURABLE, write
    assert write.published is not None
    return pause, write.published.manifest


def kept_bytes(manifest: Any) -> int:
    """What a restore of the part reads from and retention must keep: its records file and
    every records file it references, whole."""
    referenced = manifest.chain.references if manifest.chain is not None else ()
    return int(manifest.bytes) + sum(reference.bytes for reference in referenced)


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


async def measure(case: Case, root: Path, rounds: int, restores: int) -> None:
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
            # Each kind goes first in every other round: the machine's load drifts within a
            # round too, and whichever ran first would otherwise take all of one drift.
            kinds = ("incremental", "full") if number % 2 == 0 else ("full", "incremental")
            for kind in kinds:
                directory = root / f"{kind}-{number}"
                pause, manifest = await checkpoint(server, directory, full=kind == "full")
                case.add(f"{kind} pause", pause)
                case.add(f"{kind} bytes", manifest.bytes)
                case.add(f"{kind} kept", kept_bytes(manifest))
                last[kind] = directory
                if kind == "incremental":
                    case.chains.append(manifest.chain_length)
        for _ in range(restores):
            for kind in ("incremental", "full"):
                case.add(f"{kind} restore", await restore_seconds(last[kind], case.count))
    finally:
        await server.control.close()


def report(result: BenchResult, case: Case) -> None:
    """The case's figures and its ratios, incremental / full of the same rounds."""
    label, runs = case.label, case.runs
    for kind in ("incremental", "full"):
        result.figure(
            f"{label}: {kind} pause",
            "Prepare -> Resume",
            "ms",
            (v * 1e3 for v in runs[f"{kind} pause"]),
        )
        result.figure(f"{label}: {kind} bytes", "records file", "bytes", runs[f"{kind} bytes"])
        result.figure(f"{label}: {kind} kept", "records files kept", "bytes", runs[f"{kind} kept"])
        result.figure(
            f"{label}: {kind} restore", "Restore", "ms", (v * 1e3 for v in runs[f"{kind} restore"])
        )
    for name, what in (
        ("pause", "async pause"),
        ("bytes", "bytes written"),
        ("kept", "bytes kept by retention"),
        ("restore", "restore (chain end / full part)"),
    ):
        result.ratio(
            f"{label}: {what}, incremental / full",
            f"incremental {name}",
            f"full {name}",
            ratios(runs[f"incremental {name}"], runs[f"full {name}"]),
        )
    result.params.setdefault("chain lengths", {})[label] = case.chains


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    rounds: int = params.incremental_rounds
    restores: int = params.incremental_restores
    result = BenchResult(
        "incremental",
        "12. Incremental checkpoints: the pause, the bytes and the restore vs full parts",
        "One resources participant that declares checkpoint_incremental, N sessions of S bytes "
        "(hooks on the fast path), its ControlPlane in this process, local disk. Each round "
        "touches a share of the sessions, then takes two asynchronous checkpoints of that cut "
        "side by side, incremental and full, each first in every other round. Pause: Prepare "
        "to Resume returned. Bytes: the records file written; kept: it and every records file "
        "it references. Restore: a "
        "fresh participant restoring the last incremental part (its chain's end) and the last "
        "full part, alternately.",
        params={"cases": params.incremental_cases, "rounds": rounds, "restores": restores},
    )
    work = Path(tempfile.mkdtemp(prefix="incremental-", dir=ctx.workdir))
    try:
        for number, (count, size, touched) in enumerate(params.incremental_cases):
            case = Case(count, size, touched)
            ctx.say(f"incremental: {case.label}")
            root = work / f"case-{number}"
            root.mkdir()
            await measure(case, root, rounds, restores)
            shutil.rmtree(root, ignore_errors=True)
            report(result, case)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result
