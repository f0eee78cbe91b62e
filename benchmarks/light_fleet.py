"""A lightweight participant host: ONE process serving many real sidecars.

    python -m benchmarks.light_fleet --members 500 --first 0 --stride 2 --token-file FILE

Each member is the runtime's own `Sidecar` (ParticipantService + health, bearer-token auth)
over its own `ControlPlane`, on its own port, wrapping a `LightParticipant`: a few episodes
with tiny states, always ready, so a fleet checkpoint measures the control plane and the
coordinator rather than any example server's hooks. Member `i` is of kind `KINDS[i % 4]`
and belongs to group `i // 4`, whose episodes every kind of the group holds (as a rollout
touches an environment, an agent, its model and its resources). Several hosts split a large
fleet across the cores: host `h` of `H` serves members `h, h + H, h + 2H, ...` (`--first h
--stride H`), so every fleet made of the first S members is spread over every host.

Once every sidecar listens, the host prints one JSON line on stdout,
`{"http": "", "grpc": <first address>, "members": [[name, address], ...]}` (what
`benchmarks.common.Processes.launch` reads), then serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.participant import (
    EpisodeInfo,
    ExportRecord,
    Kind,
    Participant,
    ReadinessReport,
    RestoredRecord,
)
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.server.runtime.sidecar import Sidecar
from rollout_checkpoint.server.runtime.telemetry import RuntimeObserver

KINDS = (Kind.ENVIRONMENT, Kind.MODEL, Kind.AGENT, Kind.RESOURCES)
"""Member `i` is of kind `KINDS[i % 4]`: every stage of a fleet holds a quarter of it."""
EPISODES = 3
"""Episodes each member holds (those of its group)."""


def member_name(index: int) -> str:
    return f"light-{index:04d}"


def group_rollout(group: int, episode: int) -> str:
    return f"g{group}r{episode}"


class LightParticipant(Participant):
    """A participant with nothing to wait for: a few tiny episode states, always ready.

    Its hooks copy dicts of a few keys, so a checkpoint's cost is the control plane's and
    the coordinator's; it never sees a data-plane request (admission is only a flag)."""

    def __init__(self, instance: str, kind: Kind, episodes: Sequence[EpisodeId]) -> None:
        self.kind = kind
        self.instance = instance
        self.states: dict[EpisodeId, dict[str, Any]] = {
            e: {"rollout": e.rollout_id, "step": n} for n, e in enumerate(episodes)
        }
        self.pending: set[EpisodeId] = set()
        self.admission = True

    def close_admission(self) -> None:
        self.admission = False

    def open_admission(self) -> None:
        self.admission = True

    def ready(self) -> bool:
        return True

    def report(self) -> ReadinessReport:
        return ReadinessReport.build((), {"sessions": len(self.states)})

    async def export(self, scope: frozenset[EpisodeId] | None) -> Sequence[ExportRecord]:
        return [
            ExportRecord(e, {"state": dict(s)})
            for e, s in sorted(self.states.items())
            if scope is None or e in scope
        ]

    async def install(self, records: Sequence[RestoredRecord]) -> None:
        for record in records:
            self.states[record.restored_as] = dict(record.fields["state"])
            self.pending.add(record.restored_as)
        self.context.changed()

    async def discard_installed(self, episodes: Sequence[EpisodeId]) -> None:
        for episode in episodes:
            if episode in self.pending:
                self.pending.discard(episode)
                self.states.pop(episode, None)
        self.context.changed()

    async def retire(self, episode: EpisodeId) -> None:
        for held in [
            e
            for e in self.states
            if e.rollout_id == episode.rollout_id and e.attempt <= episode.attempt
        ]:
            del self.states[held]
            self.pending.discard(held)
        self.context.changed()

    def restored_pending(self) -> frozenset[EpisodeId]:
        return frozenset(self.pending)

    def episodes(self) -> Sequence[EpisodeInfo]:
        return [
            EpisodeInfo(e, at_boundary=True, restored_pending=e in self.pending)
            for e in self.states
        ]

    def has_served(self) -> bool:
        return True

    def counters(self) -> Mapping[str, int]:
        return {"sessions": len(self.states)}


def light_sidecar(index: int, token: str, episodes: int = EPISODES) -> Sidecar:
    """Member `index`'s sidecar (not started): its own control plane over its participant,
    built as `install_checkpointing` builds one, on a free port of 127.0.0.1."""
    group = index // len(KINDS)
    participant = LightParticipant(
        member_name(index),
        KINDS[index % len(KINDS)],
        [EpisodeId(group_rollout(group, n), 1) for n in range(episodes)],
    )
    settings = CheckpointSettings(
        enabled=True, token=SecretStr(token), instance=participant.instance
    )
    control = ControlPlane(participant, settings.control_settings(), observer=RuntimeObserver())
    return Sidecar(control, settings)


async def host(first: int, stride: int, count: int, token: str, episodes: int) -> None:
    """Start `count` members `first, first + stride, ...`; announce them; serve until a signal."""
    indices = range(first, first + count * stride, stride)
    sidecars = [light_sidecar(i, token, episodes) for i in indices]
    for sidecar in sidecars:
        await sidecar.start()
    members = [[s.control.participant.instance, s.address] for s in sidecars]
    print(json.dumps({"http": "", "grpc": members[0][1], "members": members}), flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()
    await asyncio.gather(*(s.stop(grace=0) for s in sidecars))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.light_fleet")
    parser.add_argument("--members", type=int, required=True, help="sidecars in this process")
    parser.add_argument("--first", type=int, default=0, help="index of the first member")
    parser.add_argument("--stride", type=int, default=1, help="index step between members")
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--episodes", type=int, default=EPISODES, help="episodes per member")
    args = parser.parse_args(argv)
    token = args.token_file.read_text().strip()
    asyncio.run(host(args.first, args.stride, args.members, token, args.episodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
