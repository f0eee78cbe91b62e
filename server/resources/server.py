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
from rollout_checkpoint.server.core.extras import MCP, require
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
from rollout_checkpoint.server.resources.session_router import SessionRouter
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware, episode_of
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.server.runtime.worker_bridge import (
    worker_count,
    worker_http_socket,
    worker_index,
)
from rollout_checkpoint.server.runtime.worker_pool import owned_session_id

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

    `description` defaults to the method's docstring, `name` to the method's name. `args`
    must be annotated with a pydantic model (or left out: the raw JSON object is passed); a
    body that does not validate is answered 422 `invalid_arguments` and the tool never runs,
    and a request without a session 400 `no_session`. The result must be JSON-serializable.
    The server's constructor raises TypeError for a tool named like a reserved route
    (`seed_session`, `verify`, `close_session`, `mcp`, `tools`) or an `args` annotation that
    is not a pydantic model. With checkpointing on, each call is admitted, counted in flight
    and refused by the admission middleware like any request on its session.
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
    """One declared tool, as collected from `@tool` at construction: its route name, its
    description, the pydantic model of its arguments (None: the raw JSON object) and the
    bound method that runs it with `(session_id, args)`."""

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
    """The instance name: part of the checkpoint's path (`participants/resources/<instance>`),
    so a replacement must use the same one to restore. `checkpoint.instance`, when set,
    overrides it for the control plane."""
    checkpoint: CheckpointSettings | None = None
    """The checkpoint block; None or `enabled: false` installs nothing at all."""
    session_secret: str | None = None
    """The key that signs session cookies. None: derived from the control token and the
    instance when checkpointing is on (so a restored process accepts the crashed one's
    cookies), random per process otherwise."""
    expose_tools_over_mcp: bool | None = None
    """Serve the tools over MCP at `/mcp` too; None: the class's `expose_tools_over_mcp`."""
    clock: Clock | None = None
    """For tests: the control plane's clock (leases, heartbeats, thresholds)."""


class ResourcesServer:
    """The base of a resources server: subclass it, declare tools with `@tool`, then serve
    `build_app()`.

    A subclass sets `checkpoint_mode` (`CheckpointMode`; `restart_only` by default, which
    blocks every checkpoint while a session lives) and `checkpoint_verify` (`VerifyMode`),
    and overrides `seed_session`, `verify` and `close_session` to hold its per-session state.
    An `exported` server also implements the three session hooks (`SessionHooks`):
    constructing it with checkpointing enabled raises TypeError when one is missing, so a
    server that could not restore fails at startup, not at its first checkpoint. The
    constructor also raises TypeError for an invalid `@tool` and ValueError for an unknown
    mode string. Sessions that begin or end outside these routes are reported with
    `checkpoint_session_started`/`checkpoint_session_ended`.
    """

    checkpoint_mode: ClassVar[CheckpointMode | str] = CheckpointMode.RESTART_ONLY
    """How session state survives a checkpoint (see `CheckpointMode`)."""
    checkpoint_verify: ClassVar[VerifyMode | str] = VerifyMode.WAIT
    """Whether a crash may run `/verify` again (see `VerifyMode`)."""
    checkpoint_incremental: ClassVar[bool] = False
    """An `exported` server may declare that its session state changes only through
    requests on the session (tool calls, HTTP or MCP), `/seed_session`, `/close_session`,
    `/verify`, or a call of `checkpoint_session_changed`. Its checkpoints then store only the
    sessions touched since the last published part and reference the others' records in
    earlier parts (a full part every `incremental_full_every`). A state that changes any
    other way (a timer, a sandbox running on its own) without that call would be restored
    as it was when last exported: leave this off for such a server."""
    expose_tools_over_mcp: ClassVar[bool] = False
    """Also serve the tools over MCP (the config may override it per process)."""
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
        """Whether the config enables checkpointing (then `build_app` installs the sidecar)."""
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
        """Return `{session_id: JSON state}` for these sessions, copied, all at once.

        Required for `exported`; called only then, at Commit. A session left out counts as
        already dropped (the commit succeeds without it); raising fails the Commit with
        `HOOK_FAILED`. The full contract: `SessionHooks.export_session_states`.
        """
        raise NotImplementedError

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Validate every state of `{session_id: state}`, then install them all, or none.

        Required for `exported`; called by a Restore into a fresh process. Raise
        `InvalidSessionState(session_id, ...)` for a state you reject (the Restore fails
        naming its episode; nothing stays installed). The full contract:
        `SessionHooks.restore_session_states`.
        """
        raise NotImplementedError

    async def retire_session_state(self, session_id: str) -> None:
        """Free one session's state; a second call, or an unknown id, must succeed.

        Required for `exported`; called by Retire once the session is drained, by a failed
        Restore to undo its install, and by the default `close_session`. Raising fails the
        RPC (`HOOK_FAILED`) and the retry calls it again. The full contract:
        `SessionHooks.retire_session_state`.
        """
        raise NotImplementedError

    # -- lifecycle helpers for sessions that begin elsewhere ----------------------------

    def checkpoint_session_started(self, request: Request) -> None:
        """Call from a route that starts a session (a Gymnasium `/reset`); no-op when off.

        Binds the request's cookie session to the episode its rollout prefix names, exactly
        as a successful `/seed_session` would: the session is tracked (a blocker under
        `restart_only`, exported under `exported`) until it ends or its rollout is retired.
        Call it once the route succeeded and the session id is in the cookie. Does nothing
        without a session or a rollout prefix; a session already tracked keeps its episode
        (a second call is a retry). Never raises.
        """
        session_id, episode = cookie_session_id(request.scope), episode_of(request.scope)
        if self.participant is not None and session_id is not None and episode is not None:
            self.participant.session_started(session_id, episode)

    def checkpoint_session_changed(self, session_id: str) -> None:
        """Say that a session's state changed outside a request on it (a background task
        finished, a sandbox wrote a file): the next checkpoint of a `checkpoint_incremental`
        server exports it again. Call it when the change begins and again when it has ended: a
        checkpoint cut between the first call and the change's end exports the state as it was
        then, and only the second call makes the next checkpoint take the finished change (a
        cut between a change and any call still references the earlier state, as if the change
        had come after that cut). Safe from any thread. No-op when checkpointing is off or the
        session is not tracked; never raises."""
        if self.participant is not None:
            self.participant.touch(session_id)

    def checkpoint_session_ended(self, request: Request) -> None:
        """Call from a route that ends a session (a terminal `/step`); no-op when off.

        Stops tracking the request's cookie session, as a successful `/close_session` would:
        it no longer blocks a Prepare and is no longer exported. It does not free the state
        (do that in the route, or let `close_session` do it). Idempotent; does nothing for an
        untracked session; never raises.
        """
        if self.participant is not None:
            self.participant.session_ended(cookie_session_id(request.scope))

    # -- app ----------------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        """The FastAPI app of this server; call it once per process.

        Routes: `/seed_session`, `/verify`, `/close_session`, `GET /tools` and one
        `POST /<tool>` per tool, with signed session cookies; `/mcp` when tools are exposed
        over MCP. With checkpointing on it also creates `self.participant`, adds the rollout
        prefix and admission middlewares, and installs the sidecar into the app's lifespan
        (`self.runtime`, see `install_checkpointing`): the sidecar starts and stops with the
        app. With checkpointing off none of these is installed.

        Raises `MissingExtra` when MCP is exposed without the `mcp` extra (mcp 2.x), or
        checkpointing asks for reflection without the `reflection` extra.
        """
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
            # The mcp extra is imported only here: MissingExtra (one line naming the extra)
            # when it is absent or is mcp 1.x, e.g. beside nemo-gym 0.4.0 (core/extras.py).
            require(MCP, "expose_tools_over_mcp")
            from rollout_checkpoint.server.resources.mcp import McpExposure

            mcp = McpExposure(self)
            mcp.mount(app)
        self.mcp = mcp
        if self.checkpoint_enabled:
            assert self.config.checkpoint is not None
            self.participant = ResourcesParticipant(
                self.instance,
                self.mode,
                self.verify_mode,
                self,
                keep_ended=self.config.checkpoint.export_ended_sessions,
                incremental=self.checkpoint_incremental,
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
            index = worker_index()
            if index is not None:  # one of several workers: outermost, the session router
                if self.mcp is not None:
                    raise ValueError("MCP tokens are not routed between workers: one worker only")
                app.add_middleware(
                    SessionRouter,
                    secret=self.session_secret,
                    cookie="rollout_session",
                    session_key=SESSION_KEY,
                    index=index,
                    workers=worker_count(),
                    socket_of=worker_http_socket,
                )
        return app

    # -- routes -------------------------------------------------------------------------

    def _new_session_id(self) -> str:
        """A fresh session id; in one of several workers, one that this worker owns: the
        seed holds the session's state here, and every later request of it is routed here
        by its id alone (session_router.py)."""
        index = worker_index() if self.checkpoint_enabled else None
        if index is None:
            return uuid.uuid4().hex
        return owned_session_id(index, worker_count())

    async def _seed_route(self, request: Request) -> JSONResponse:
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        session_id = cookie_session_id(request.scope) or self._new_session_id()
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
