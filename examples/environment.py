"""The example environment server: relays task rows to an agent's `/run`.

`POST /ng-rollout/<capture_key>/run {"task": ...}` starts an episode pinned to the task's
digest and relays it to the agent under the same rollout prefix, and the agent's reply back
with the environment's name and the task digest beside it. A failed run stays a failure: the
agent's status and typed error (or the environment's own 502/504 for an agent that cannot be
reached or does not answer in time), never a 200 around an error. The relay is a *replay* step:
the environment prepares first, and waiting for whole agent runs would keep it from ever being
ready; the agent's own boundaries carry the episode, and after a crash the relay is simply
re-sent as attempt N+1. A replacement whose task differs from the checkpointed one is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.keep_alive import client_limits
from rollout_checkpoint.server.episodic.episode_participant import (
    EnvironmentParticipant,
    task_digest,
)
from rollout_checkpoint.server.episodic.episode_steps import (
    EpisodeRefused,
    EpisodeRetired,
    StepMode,
    TrackedEpisode,
)
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.rollout_prefix import (
    RolloutPrefixMiddleware,
    episode_of,
    rollout_path,
)
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .relay import (
    CLOSED_CODES,
    CalleeFailed,
    CalleeUnreachable,
    UnreachableClock,
    error_response,
    failure_response,
    json_object,
    post_replayable,
    refusal_code,
    reply_object,
)


@dataclass(frozen=True)
class EnvironmentConfig:
    instance: str = "environment"
    agent_url: str = "http://127.0.0.1:8000"
    resources_server: str = "prompt_injection"
    checkpoint: CheckpointSettings | None = None
    retry_seconds: float = 0.05
    unreachable_seconds: float = 120.0
    """How long a relay waits for an agent that cannot be reached (`UnreachableClock`)."""
    agent_timeout: float = 900.0
    """Seconds a relayed run may take before the relay answers 504 (a whole agent episode)."""


class EnvironmentServer:
    def __init__(self, config: EnvironmentConfig) -> None:
        self.config = config
        self.participant: EnvironmentParticipant | None = None
        self.runtime: CheckpointRuntime | None = None
        self.http: httpx.AsyncClient | None = None

    def build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            limits = client_limits(max_connections=512, max_keepalive_connections=128)
            timeout = httpx.Timeout(self.config.agent_timeout)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                self.http = client
                yield
            self.http = None

        app = FastAPI(
            title=f"environment ({self.config.instance})",
            lifespan=lifespan,
            openapi_url=None,
            docs_url=None,
            redoc_url=None,
        )
        app.add_api_route("/run", self._run_route, methods=["POST"])
        checkpoint = self.config.checkpoint
        if checkpoint is not None and checkpoint.enabled:
            self.participant = EnvironmentParticipant(self.config.instance)
            app.add_middleware(RolloutPrefixMiddleware)
            self.runtime = install_checkpointing(app, self.participant, checkpoint)
        return app

    async def _run_route(self, request: Request) -> JSONResponse:
        episode_id = episode_of(request.scope)
        if episode_id is None:
            return error_response(
                400, "rollout_id_required", "call /ng-rollout/<rollout_id>[-a<attempt>]/run"
            )
        body = await json_object(request)
        if body is None:
            return error_response(400, "invalid_json", "the body must be a JSON object")
        task = body.get("task")
        if not isinstance(task, dict):
            return error_response(400, "invalid_task", "the body needs a task object")
        participant = self.participant
        tracked: TrackedEpisode | None = None
        if participant is not None:
            try:
                await participant.claim_restored(episode_id)
                tracked, _ = participant.begin_task(episode_id, task)
            except EpisodeRefused as refused:
                return error_response(409, refused.code, refused.detail)
            except CheckpointError as mismatch:
                return error_response(409, "task_mismatch", mismatch.message)
        try:
            if participant is not None and tracked is not None:
                await participant.episodes_tracker.boundary(
                    tracked, {"next": "relay", "task_digest": task_digest(task)}
                )
            reply = await self._relay(episode_id.capture_key, request.scope, task, tracked)
            return self._passed_on(reply, task)
        except EpisodeRetired:
            return error_response(
                409, "stale_attempt", f"attempt {episode_id.capture_key} was retired"
            )
        except (CalleeUnreachable, httpx.TransportError) as failure:
            return failure_response(failure, **self._attribution(task))
        finally:
            if participant is not None and tracked is not None:
                participant.end_task(tracked)

    def _resources_server(self, task: dict[str, Any]) -> str:
        """The fleet name of the resources server the task's tools go to: the task's own
        `resources_server` (a tasks file mixing servers, as certify and collect take it),
        else this environment's default (`--resources-server`)."""
        named = task.get("resources_server")
        return named if isinstance(named, str) and named else self.config.resources_server

    def _attribution(self, task: dict[str, Any]) -> dict[str, str]:
        """What every reply of a run carries beside the agent's: which environment ran which
        task, so a failure is attributable as well as a result."""
        return {"environment": self.config.instance, "task_digest": task_digest(task)}

    def _passed_on(self, reply: httpx.Response, task: dict[str, Any]) -> JSONResponse:
        """The agent's reply to the run, attributed. A failure keeps the agent's status and
        typed error: wrapped in a 200 it would count, for a trainer reading the status, as a
        finished rollout. A reply that is neither (not a JSON object, or an error without
        its typed body) is the agent's failure (`CalleeFailed.answered`)."""
        attribution = self._attribution(task)
        body = reply_object(reply)
        typed_failure = (
            reply.status_code >= 400 and body is not None and isinstance(body.get("error"), dict)
        )
        if body is not None and (reply.status_code == 200 or typed_failure):
            return JSONResponse({**attribution, **body}, status_code=reply.status_code)
        return failure_response(CalleeFailed.answered("the agent", reply), **attribution)

    async def _relay(
        self, key: str, scope: Any, task: dict[str, Any], tracked: TrackedEpisode | None
    ) -> httpx.Response:
        assert self.http is not None
        episode = episode_of(scope)
        assert episode is not None
        url = self.config.agent_url + rollout_path(episode, "/run")
        tracker = self.participant.episodes_tracker if self.participant is not None else None
        delay = self.config.retry_seconds
        unreachable = UnreachableClock(self.config.unreachable_seconds)
        while True:
            step = (
                tracker.step(tracked, StepMode.REPLAY)
                if tracker is not None and tracked is not None
                else contextlib.nullcontext()
            )
            async with step:
                response = await post_replayable(
                    self.http,
                    url,
                    json={"task": task, "resources_server": self._resources_server(task)},
                )
                code = refusal_code(response)
                unreachable.saw(code)
                if code in CLOSED_CODES and (tracker is None or tracker.admission_open):
                    await asyncio.sleep(delay)  # the agent is still closed: stay at the boundary
                    delay = min(delay * 2, 1.0)
            if code in CLOSED_CODES:
                if tracker is not None and tracked is not None and not tracker.admission_open:
                    await tracker.park(tracked)
                continue
            if code == "stale_attempt":
                raise EpisodeRetired(key)
            return response
