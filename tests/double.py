"""A test-double participant and a small HTTP app around it.

It implements the participant interface with plain episode states and can be told to hold
requests in flight, block a hook until released, or make a hook fail. The HTTP app serves a
data plane under `/ng-rollout/<capture_key>/...` with the same refusals as real servers
(409 `admission_closed` / `awaiting_restore` / `stale_attempt`). Run it as a process with `python -m tests.double`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import rejected_checkpoint
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.participant import (
    AWAITING_RESTORE,
    AWAITING_RESTORE_DETAIL,
    Blocker,
    BlockerReason,
    EpisodeInfo,
    ExportRecord,
    Kind,
    Participant,
    ReadinessReport,
    RestoredRecord,
)
from rollout_checkpoint.server.runtime.settings import CheckpointSettings


class Refused(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class DoubleParticipant(Participant):
    """Episodes with JSON states; knobs for holding, blocking and failing."""

    def __init__(self, instance: str = "double", kind: Kind = Kind.RESOURCES) -> None:
        self.kind = kind
        self.instance = instance
        self.states: dict[EpisodeId, Any] = {}
        self.pending: set[EpisodeId] = set()
        self.installed: set[EpisodeId] = set()
        self.inflight: dict[str, int] = {}
        self.admission = True
        self.served = False
        self.export_calls = 0
        self.retired_log: list[EpisodeId] = []
        self.discarded: list[EpisodeId] = []
        self.fail: dict[str, BaseException] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = {}

    # -- knobs --------------------------------------------------------------------------

    def gate(self, hook: str) -> asyncio.Event:
        """Block `hook` until the returned event is set; `entered[hook]` fires on arrival."""
        self.gates[hook] = asyncio.Event()
        self.entered[hook] = asyncio.Event()
        return self.gates[hook]

    async def _checkpoint(self, hook: str) -> None:
        if hook in self.entered:
            self.entered[hook].set()
        if hook in self.gates:
            await self.gates[hook].wait()
        if hook in self.fail:
            raise self.fail[hook]

    # -- data plane ---------------------------------------------------------------------

    def _admit(self, episode: EpisodeId) -> None:
        if self.context.retired.is_retired(episode):
            raise Refused("stale_attempt", f"attempt {episode.capture_key} was retired")
        if self.context.start_closed_pending:
            raise Refused(AWAITING_RESTORE, AWAITING_RESTORE_DETAIL)
        if not self.admission:
            raise Refused("admission_closed", "a checkpoint is in progress")

    def seed(self, episode: EpisodeId, state: Any) -> None:
        self._admit(episode)
        self.served = True
        self.states[episode] = copy.deepcopy(state)
        self.context.changed()

    @contextlib.asynccontextmanager
    async def request(self, episode: EpisodeId) -> AsyncIterator[None]:
        """Admission check, then counted in flight until the block exits (whatever happens)."""
        self._admit(episode)
        self.served = True
        key = episode.capture_key
        self.inflight[key] = self.inflight.get(key, 0) + 1
        self.pending.discard(episode)
        self.context.changed()
        try:
            yield
        finally:
            self.inflight[key] -= 1
            if not self.inflight[key]:
                del self.inflight[key]
            self.context.changed()

    # -- Participant --------------------------------------------------------------------

    def close_admission(self) -> None:
        if "close_admission" in self.fail:
            raise self.fail["close_admission"]
        self.admission = False

    def open_admission(self) -> None:
        self.admission = True

    def ready(self) -> bool:
        return not self.inflight

    def report(self) -> ReadinessReport:
        blockers = [
            Blocker(key, BlockerReason.REQUEST_IN_FLIGHT, f"{n} request(s) in flight")
            for key, n in self.inflight.items()
        ]
        return ReadinessReport.build(
            blockers, {"inflight": sum(self.inflight.values()), "sessions": len(self.states)}
        )

    async def export(self, scope: frozenset[EpisodeId] | None) -> Sequence[ExportRecord]:
        self.export_calls += 1
        snapshot = {
            e: json.loads(json.dumps(s)) if _jsonable(s) else s
            for e, s in self.states.items()
            if scope is None or e in scope
        }
        await self._checkpoint("export")
        return [ExportRecord(e, {"state": s}) for e, s in sorted(snapshot.items())]

    async def install(self, records: Sequence[RestoredRecord]) -> None:
        for record in records:
            if set(record.fields) != {"state"}:
                raise rejected_checkpoint(
                    "record must hold exactly a state", capture_key=record.checkpointed.capture_key
                )
        await self._checkpoint("install")
        for record in records:
            self.states[record.restored_as] = record.fields["state"]
            self.pending.add(record.restored_as)
            self.installed.add(record.restored_as)
        self.context.changed()

    async def retire(self, episode: EpisodeId) -> None:
        await self._checkpoint("retire")
        for held in [
            e
            for e in self.states
            if e.rollout_id == episode.rollout_id and e.attempt <= episode.attempt
        ]:
            del self.states[held]
            self.pending.discard(held)
        self.retired_log.append(episode)
        self.context.changed()

    async def discard_installed(self, episodes: Sequence[EpisodeId]) -> None:
        await self._checkpoint("discard")
        for episode in set(episodes) & self.installed:
            self.states.pop(episode, None)
            self.pending.discard(episode)
            self.installed.discard(episode)
        self.discarded.extend(episodes)
        self.context.changed()

    def restored_pending(self) -> frozenset[EpisodeId]:
        return frozenset(self.pending)

    def episodes(self) -> Sequence[EpisodeInfo]:
        return [EpisodeInfo(e, restored_pending=e in self.pending) for e in self.states]

    def has_served(self) -> bool:
        return self.served

    def forget_served(self) -> None:
        """Forget having served unless a state is still held or a request still runs."""
        if "forget_served" in self.fail:
            raise self.fail["forget_served"]
        self.served = bool(self.states or self.inflight)

    def facts(self) -> Mapping[str, str]:
        return {"mode": "exported", "verify": "wait"}

    def counters(self) -> Mapping[str, int]:
        return {"retired_sessions": len(self.retired_log)}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


# -- HTTP app -------------------------------------------------------------------------------


def _refusal(error: Refused) -> JSONResponse:
    return JSONResponse({"error": {"code": error.code, "detail": error.detail}}, status_code=409)


def create_app(participant: DoubleParticipant) -> Starlette:
    async def seed(request: Request) -> JSONResponse:
        episode = EpisodeId.from_capture_key(request.path_params["key"])
        body = await request.json()
        try:
            participant.seed(episode, body.get("state"))
        except Refused as error:
            return _refusal(error)
        return JSONResponse({"seeded": episode.capture_key})

    async def update(request: Request) -> JSONResponse:
        """Set the state; with `hold`, stay in flight until /release is called."""
        episode = EpisodeId.from_capture_key(request.path_params["key"])
        body = await request.json()
        try:
            async with participant.request(episode):
                if body.get("hold"):
                    release = participant.gates.setdefault("http-hold", asyncio.Event())
                    await release.wait()
                participant.states[episode] = body.get("state")
        except Refused as error:
            return _refusal(error)
        return JSONResponse({"updated": episode.capture_key})

    async def read(request: Request) -> JSONResponse:
        episode = EpisodeId.from_capture_key(request.path_params["key"])
        if episode not in participant.states:
            return JSONResponse(
                {"error": {"code": "unknown_episode", "detail": ""}}, status_code=404
            )
        return JSONResponse({"state": participant.states[episode]})

    async def release(request: Request) -> JSONResponse:
        participant.gates.setdefault("http-hold", asyncio.Event()).set()
        return JSONResponse({})

    return Starlette(
        routes=[
            Route("/ng-rollout/{key}/seed", seed, methods=["POST"]),
            Route("/ng-rollout/{key}/update", update, methods=["POST"]),
            Route("/ng-rollout/{key}/state", read, methods=["GET"]),
            Route("/test/release", release, methods=["POST"]),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Run the double as a real server process; prints the ports as one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--instance", default="double")
    parser.add_argument("--start-closed", action="store_true")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"])
    parser.add_argument(
        "--graceful-seconds",
        type=float,
        default=2,
        help="uvicorn's graceful shutdown timeout; SIGUSR1 releases held requests",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    import uvicorn

    participant = DoubleParticipant(args.instance)
    app = create_app(participant)
    settings = CheckpointSettings(
        enabled=True,
        token=os.environ["DOUBLE_TOKEN"],
        start_closed=args.start_closed,
    )
    runtime = install_checkpointing(app, participant, settings)
    assert isinstance(runtime, CheckpointRuntime)

    def release_held() -> None:
        participant.gates.setdefault("http-hold", asyncio.Event()).set()

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            # A test can release held requests after SIGTERM, when no new request gets in.
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, release_held)
            http_port = self.servers[0].sockets[0].getsockname()[1]
            print(json.dumps({"http_port": http_port, "grpc_port": runtime.port}), flush=True)

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_level=args.log_level,
        timeout_graceful_shutdown=args.graceful_seconds,
    )
    AnnouncingServer(config).run()


if __name__ == "__main__":
    main()
