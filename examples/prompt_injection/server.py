"""The prompt-injection resources server: the sessions' lifecycle (seed, verify, close) and the
checkpoint hooks. The tools come from the clinic and hiring mixins; the tool plumbing
(`SessionEnvironments`) from `sessions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout_checkpoint.server.resources import (
    CheckpointMode,
    ResourcesServer,
    VerifyMode,
)
from rollout_checkpoint.server.resources.json_state import EnvironmentStates
from rollout_checkpoint.server.resources.json_state import through_json as _through_json
from rollout_checkpoint.server.resources.middleware import cookie_session_id
from rollout_checkpoint.server.resources.server import RESERVED_ROUTES

from .clinic_tools import ClinicTools
from .errors import RequestRefused
from .hiring_tools import HiringTools
from .scoring import score


class PromptInjectionServer(ClinicTools, HiringTools, ResourcesServer):
    """Incremental (`checkpoint_incremental`): an environment is created by `/seed_session`,
    changed only by a tool call on its session (ids and times come from the environment
    itself, never from a clock or a task running beside the requests) and dropped by
    `/verify` or `/close_session`; so a checkpoint that writes only the sessions those
    touched, and references the others' earlier records, restores exactly the environments
    a full one would."""

    checkpoint_mode = CheckpointMode.EXPORTED
    checkpoint_verify = VerifyMode.WAIT
    """`/verify` drops the environment: it cannot run twice, so a checkpoint waits for it."""
    checkpoint_incremental = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environments: dict[str, dict[str, Any]] = {}

    # -- app ------------------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        app = super().build_app()

        async def refused(request: Request, exc: Exception) -> JSONResponse:
            assert isinstance(exc, RequestRefused)
            return JSONResponse(
                {"error": {"code": exc.code, "detail": exc.detail}}, status_code=exc.status_code
            )

        app.add_exception_handler(RequestRefused, refused)
        # Last, so every route the base registered (seed, verify, close, the tools, /mcp)
        # matches first: only a name that is none of them reaches the catch-all.
        app.add_api_route("/{tool_name}", self._unknown_tool_route, methods=["POST"])
        return app

    async def _unknown_tool_route(self, request: Request, tool_name: str) -> JSONResponse:
        if tool_name in RESERVED_ROUTES:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        self._environment(cookie_session_id(request.scope))
        return JSONResponse({"output": f"Unknown tool: {tool_name}"})

    # -- session lifecycle ----------------------------------------------------------------

    async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        environment = body.get("environment")
        if not isinstance(environment, dict):
            raise RequestRefused(
                400, "invalid_environment", "seed_session needs {environment: <JSON object>}"
            )
        try:
            copy: dict[str, Any] = _through_json(environment)
        except (ValueError, TypeError, RecursionError) as exc:
            raise RequestRefused(
                400, "invalid_environment", f"the environment is not plain JSON: {exc}"
            ) from None
        self.environments[session_id] = copy
        return {}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            self._environment(session_id)
            return score(body)
        finally:
            # Verification ends the episode, also when it fails: the environment goes.
            self.environments.pop(session_id, None)

    async def close_session(self, session_id: str) -> None:
        self.environments.pop(session_id, None)

    # -- checkpoint hooks -----------------------------------------------------------------

    async def export_session_states(self, session_ids: list[str]) -> Mapping[str, Any]:
        return await EnvironmentStates(self.environments).export_session_states(session_ids)

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        await EnvironmentStates(self.environments).restore_session_states(states)

    async def retire_session_state(self, session_id: str) -> None:
        self.environments.pop(session_id, None)
