"""A base for resources servers: FastAPI apps holding per-episode tool state under a session.

A subclass declares its tools with `@tool`, its `checkpoint_mode` and `checkpoint_verify`,
and (for `exported`) the three session hooks. `build_app()` gives the FastAPI app with signed
session cookies, `/seed_session`, `/verify`, `/close_session`, one `POST /<tool>` route per
tool, optionally the same tools over MCP at `/mcp`, and, when checkpointing is enabled, the
rollout prefix, the admission middleware and the gRPC sidecar. With checkpointing off none
of the checkpoint pieces is installed.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import secrets
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.middleware.sessions import SessionMiddleware

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.resources.middleware import (
    SESSION_KEY,
    ResourcesAdmissionMiddleware,
    cookie_session_id,
)
from rollout_checkpoint.server.resources.participant import (
    CheckpointMode,
    InvalidSessionState,
    ResourcesParticipant,
    VerifyMode,
)
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware, episode_of
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

__all__ = [
    "CheckpointMode",
    "InvalidSessionState",
    "ResourcesServer",
    "ResourcesServerConfig",
    "VerifyMode",
    "derive_secret",
    "tool",
]

_TOOL_MARK = "__rollout_checkpoint_tool__"
RESERVED_ROUTES = frozenset({"seed_session", "verify", "close_session", "mcp", "tools"})


def tool(description: str | None = None, *, name: str | None = None) -> Callable[[Any], Any]:
    """Mark `async def name(self, session_id: str, args: ArgsModel) -> result` as a tool.

    The tool is served as `POST /<name>` (the body is the arguments) and, when the server
    exposes its tools over MCP, as an MCP tool with the arguments' JSON schema.
    """

    def mark(function: Any) -> Any:
        setattr(
            function,
            _TOOL_MARK,
            (name or function.__name__, description or inspect.getdoc(function) or ""),
        )
        return function

    return mark


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    args_model: type[BaseModel] | None
    call: Callable[[str, Any], Awaitable[Any]]


def derive_secret(token: str, instance: str, purpose: str) -> bytes:
    """HKDF-SHA256 (RFC 5869) of the control token, bound to the instance and a purpose.

    A fresh process of the same instance derives the same key, so it accepts the cookies and
    MCP tokens the crashed one issued; the control token itself never signs anything.
    """
    salt = hashlib.sha256(b"rollout-checkpoint/v1").digest()
    prk = hmac.new(salt, token.encode(), hashlib.sha256).digest()
    info = f"rollout-checkpoint {purpose} for {instance}".encode()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


@dataclass(frozen=True)
class ResourcesServerConfig:
    """How one resources server process runs. `session_secret` None: derived, see `derive_secret`."""

    instance: str = "resources"
    checkpoint: CheckpointSettings | None = None
    session_secret: str | None = None
    expose_tools_over_mcp: bool | None = None
    clock: Clock | None = None
    """For tests: the control plane's clock (leases, heartbeats, thresholds)."""


class ResourcesServer:
    checkpoint_mode: ClassVar[CheckpointMode | str] = CheckpointMode.RESTART_ONLY
    checkpoint_verify: ClassVar[VerifyMode | str] = VerifyMode.WAIT
    expose_tools_over_mcp: ClassVar[bool] = False
    passthrough_paths: ClassVar[frozenset[str]] = frozenset()
    """Non-data routes of the server (never counted, never refused)."""

    def __init__(self, config: ResourcesServerConfig | None = None) -> None:
        self.config = config or ResourcesServerConfig()
        self.instance = self.config.instance
        self.mode = CheckpointMode(self.checkpoint_mode)
        self.verify_mode = VerifyMode(self.checkpoint_verify)
        self.mcp_enabled = (
            self.expose_tools_over_mcp
            if self.config.expose_tools_over_mcp is None
            else self.config.expose_tools_over_mcp
        )
        self.tools = self._collect_tools()
        self.participant: ResourcesParticipant | None = None
        self.runtime: CheckpointRuntime | None = None
        if self.checkpoint_enabled and self.mode is CheckpointMode.EXPORTED:
            self._require_hooks()
        self.session_secret = self._session_secret()
        self._tools_body: bytes | None = None

    @property
    def checkpoint_enabled(self) -> bool:
        return self.config.checkpoint is not None and self.config.checkpoint.enabled

    # -- what subclasses implement ------------------------------------------------------

    async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create the session's state from the seed body; the reply body goes to the caller."""
        return {}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """Score the episode; the reply body goes to the caller."""
        return {"reward": 0.0}

    async def close_session(self, session_id: str) -> None:
        """Free the session's state (the default frees it through the retire hook)."""
        if self.mode is CheckpointMode.EXPORTED:
            await self.retire_session_state(session_id)

    async def export_session_states(self, session_ids: list[str]) -> Mapping[str, Any]:
        raise NotImplementedError

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        raise NotImplementedError

    async def retire_session_state(self, session_id: str) -> None:
        raise NotImplementedError

    # -- lifecycle helpers for sessions that begin elsewhere ----------------------------

    def checkpoint_session_started(self, request: Request) -> None:
        """Call from a route that starts a session (a Gymnasium `/reset`); no-op when off."""
        session_id, episode = cookie_session_id(request.scope), episode_of(request.scope)
        if self.participant is not None and session_id is not None and episode is not None:
            self.participant.session_started(session_id, episode)

    def checkpoint_session_ended(self, request: Request) -> None:
        """Call from a route that ends a session (a terminal `/step`); no-op when off."""
        if self.participant is not None:
            self.participant.session_ended(cookie_session_id(request.scope))

    # -- app ----------------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        app = FastAPI(
            title=f"{type(self).__name__} ({self.instance})",
            openapi_url=None,
            docs_url=None,
            redoc_url=None,
        )
        app.state.resources_server = self
        app.add_api_route("/seed_session", self._seed_route, methods=["POST"])
        app.add_api_route("/verify", self._verify_route, methods=["POST"])
        app.add_api_route("/close_session", self._close_route, methods=["POST"])
        app.add_api_route("/tools", self._tools_route, methods=["GET"])
        for spec in self.tools.values():
            app.add_api_route(
                f"/{spec.name}", self._tool_route(spec), methods=["POST"], name=spec.name
            )
        mcp = None
        if self.mcp_enabled:
            from rollout_checkpoint.server.resources.mcp import McpExposure

            mcp = McpExposure(self)
            mcp.mount(app)
        self.mcp = mcp
        if self.checkpoint_enabled:
            assert self.config.checkpoint is not None
            self.participant = ResourcesParticipant(
                self.instance, self.mode, self.verify_mode, self
            )
            app.add_middleware(
                ResourcesAdmissionMiddleware,
                participant=self.participant,
                mcp_path=mcp.path if mcp is not None else None,
                mcp_session=mcp.session_from_scope if mcp is not None else None,
                passthrough_paths=self.passthrough_paths | _metrics_paths(self.config.checkpoint),
            )
        app.add_middleware(
            SessionMiddleware,
            secret_key=self.session_secret,
            session_cookie="rollout_session",
            same_site="lax",
        )
        if self.checkpoint_enabled:
            app.add_middleware(RolloutPrefixMiddleware)
            assert self.participant is not None
            self.runtime = install_checkpointing(
                app, self.participant, self.config.checkpoint, clock=self.config.clock
            )
        return app

    # -- routes -------------------------------------------------------------------------

    async def _seed_route(self, request: Request) -> JSONResponse:
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        session_id = cookie_session_id(request.scope) or uuid.uuid4().hex
        request.session[SESSION_KEY] = session_id
        reply = dict(await self.seed_session(session_id, body))
        if self.mcp is not None:
            reply["mcp"] = self.mcp.connection_info(session_id)
        return JSONResponse(reply)

    async def _tools_route(self) -> Response:
        """The tools as function definitions (name, description, JSON schema) for an agent.

        Rendered on the first call and kept: the tools never change, and building their JSON
        schemas with pydantic cost about 3 ms for the prompt-injection server's 14 tools,
        which every episode paid again (an agent lists the tools once per episode)."""
        if self._tools_body is None:
            tools = [_function_definition(spec) for spec in self.tools.values()]
            self._tools_body = bytes(JSONResponse({"tools": tools}).body)
        return Response(self._tools_body, media_type="application/json")

    async def _verify_route(self, request: Request) -> JSONResponse:
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        session_id = cookie_session_id(request.scope)
        if session_id is None:
            return _error(400, "no_session", "call seed_session first")
        return JSONResponse(await self.verify(session_id, body))

    async def _close_route(self, request: Request) -> JSONResponse:
        session_id = cookie_session_id(request.scope)
        if session_id is None:
            return _error(400, "no_session", "no session to close")
        await self.close_session(session_id)
        return JSONResponse({"closed": True})

    def _tool_route(self, spec: Tool) -> Callable[[Request], Awaitable[JSONResponse]]:
        async def route(request: Request) -> JSONResponse:
            session_id = cookie_session_id(request.scope)
            if session_id is None:
                return _error(400, "no_session", "call seed_session first")
            body = await _json_object(request)
            if isinstance(body, JSONResponse):
                return body
            try:
                args = spec.args_model.model_validate(body) if spec.args_model is not None else body
            except ValidationError as exc:
                return _error(422, "invalid_arguments", str(exc))
            return JSONResponse(await spec.call(session_id, args))

        return route

    # -- internals ----------------------------------------------------------------------

    def _collect_tools(self) -> dict[str, Tool]:
        tools: dict[str, Tool] = {}
        for attribute in dir(type(self)):
            function = getattr(type(self), attribute, None)
            mark = getattr(function, _TOOL_MARK, None)
            if mark is None or not callable(function):
                continue
            name, description = mark
            if name in RESERVED_ROUTES:
                raise TypeError(f"{type(self).__name__}: {name!r} is a reserved route, not a tool")
            hints = inspect.get_annotations(function, eval_str=True)
            args_model = hints.get("args")
            if args_model is not None and not (
                isinstance(args_model, type) and issubclass(args_model, BaseModel)
            ):
                raise TypeError(f"tool {name}: annotate `args` with a pydantic model")
            tools[name] = Tool(name, description, args_model, getattr(self, attribute))
        return tools

    def _require_hooks(self) -> None:
        missing = [
            hook
            for hook in ("export_session_states", "restore_session_states", "retire_session_state")
            if getattr(type(self), hook) is getattr(ResourcesServer, hook)
        ]
        if missing:
            raise TypeError(
                f"{type(self).__name__} declares checkpoint_mode 'exported' but does not implement "
                + ", ".join(missing)
            )

    def _session_secret(self) -> str:
        if self.config.session_secret:
            return self.config.session_secret
        checkpoint = self.config.checkpoint
        if checkpoint is not None and checkpoint.enabled:
            return derive_secret(
                checkpoint.token.get_secret_value(), self.instance, "session cookies"
            ).hex()
        return secrets.token_hex(32)


def _metrics_paths(settings: CheckpointSettings | None) -> frozenset[str]:
    """The metrics path is no data route: never counted in flight, never refused."""
    if settings is None or settings.metrics_path is None:
        return frozenset()
    return frozenset({settings.metrics_path})


async def _json_object(request: Request) -> dict[str, Any] | JSONResponse:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return _error(400, "invalid_json", "the body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "invalid_json", "the body must be a JSON object")
    return body


def _function_definition(spec: Tool) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    if spec.args_model is not None:
        schema = spec.args_model.model_json_schema()
    return {
        "type": "function",
        "function": {"name": spec.name, "description": spec.description, "parameters": schema},
    }


def _error(status: int, code: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "detail": detail}}, status_code=status)
