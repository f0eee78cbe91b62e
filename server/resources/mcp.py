"""A resources server's tools over MCP: streamable HTTP at `/mcp`, sessions named by a signed token.

The endpoint is the official MCP Python SDK (2.x): a low-level `mcp.server.Server` whose
`tools/list` and `tools/call` handlers serve exactly the server's `@tool`s (never the seed,
verify, close or checkpoint control routes), driven by the SDK's
`StreamableHTTPSessionManager` in **stateless** mode with **JSON responses**. Stateless
matters for checkpointing: a stateful endpoint hands out its own `mcp-session-id`, which dies
with the process, so a harness would get 404 after a restore. Here every POST stands alone
(a 2026-07-28 client sends one self-contained POST per call; a handshake-era client's
`initialize` is answered afresh by each request), and one tool call is one POST, so the
admission middleware can fence, count and drain it like any other request on its session.

Our own session travels in the `x-rollout-session-token` request header: an itsdangerous
signature over `{"sid": <session id>, "srv": <instance>}`, keyed by a secret derived from the
server's session secret with a purpose of its own (never the cookie key). The derivation is
deterministic, so a restored process with the same secret accepts the tokens the crashed one
issued. A bad, unsigned or tampered token names no session: the middleware then finds none
by the token, and the `tools/call` handler answers with an MCP tool error (`isError`) saying
the token is invalid, without running the tool.

A tool result is returned the way the SDK's own `MCPServer` returns a dict: one text content
block holding the JSON (byte for byte the body the HTTP route `POST /<tool>` would answer,
which is what a model-facing harness reads) and, for a JSON object, the same object as
`structuredContent` (what programmatic clients read). No output schema is declared.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import mcp_types as types
from itsdangerous import BadData, URLSafeSerializer
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rollout_checkpoint.server.resources.server import derive_secret

if TYPE_CHECKING:
    from rollout_checkpoint.server.resources.server import ResourcesServer, Tool

__all__ = ["MCP_PATH", "TOKEN_HEADER", "McpExposure"]

log = logging.getLogger(__name__)

MCP_PATH: Final = "/mcp"
TOKEN_HEADER: Final = "x-rollout-session-token"
_TOKEN_HEADER_BYTES: Final = TOKEN_HEADER.encode("ascii")
_TOKEN_PURPOSE: Final = "MCP session tokens"
_TOKEN_SALT: Final = b"rollout-checkpoint.mcp-session-token"
_MAX_TOKEN_LENGTH: Final = 4096
_INVALID_TOKEN: Final = (
    f"invalid or missing session token: send the {TOKEN_HEADER} header exactly as the "
    "seed_session reply's mcp.headers gives it"
)


class McpExposure:
    """The MCP endpoint of one resources server (see the module docstring).

    An instance is the ASGI app served at `path`; `mount` routes it and runs the SDK's
    session manager inside the app's lifespan.
    """

    path: str

    def __init__(self, server: ResourcesServer) -> None:
        self.server = server
        self.path = MCP_PATH
        key = derive_secret(server.session_secret, server.instance, _TOKEN_PURPOSE)
        self._serializer = URLSafeSerializer(key, salt=_TOKEN_SALT)
        self._tools: dict[str, Tool] = dict(server.tools)
        self._schemas: dict[str, dict[str, Any]] = {
            name: _input_schema(tool) for name, tool in self._tools.items()
        }
        self._listing = types.ListToolsResult(
            tools=[
                types.Tool(
                    name=name,
                    description=tool.description or None,
                    input_schema=self._schemas[name],
                )
                for name, tool in sorted(self._tools.items())
            ]
        )
        lookup: Callable[[str], Mapping[str, Any] | None] = self._schemas.get
        self.mcp_server: Server[Any] = Server(
            server.instance,
            version=_package_version(),
            title=type(server).__name__,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            get_tool_input_schema=lookup,
        )
        self._manager: StreamableHTTPSessionManager | None = None

    # -- the session token --------------------------------------------------------------

    def token_for(self, session_id: str) -> str:
        """The signed MCP token naming `session_id` on this server instance. The key is
        derived from the server's secret, so a restored process accepts the crashed one's."""
        return self._serializer.dumps({"sid": session_id, "srv": self.server.instance})

    def session_from_token(self, token: str) -> str | None:
        """The session a token names, or None when it is not one of this server's tokens."""
        if not token or len(token) > _MAX_TOKEN_LENGTH:
            return None
        try:
            payload: object = self._serializer.loads(token)
        except BadData:
            return None
        if not isinstance(payload, dict) or payload.get("srv") != self.server.instance:
            return None
        session_id = payload.get("sid")
        return session_id if isinstance(session_id, str) and session_id else None

    def session_from_scope(self, scope: Scope) -> str | None:
        """The session named by the request's token header (None: absent, repeated or bad)."""
        values = [value for name, value in scope.get("headers", ()) if name == _TOKEN_HEADER_BYTES]
        if len(values) != 1:
            return None
        return self.session_from_token(values[0].decode("latin-1"))

    def connection_info(self, session_id: str) -> dict[str, Any]:
        """What the seed reply carries under `mcp`: where to connect and the header to send."""
        return {
            "server_name": self.server.instance,
            "url_path": self.path,
            "transport": "streamable-http",
            "headers": {TOKEN_HEADER: self.token_for(session_id)},
        }

    # -- serving ------------------------------------------------------------------------

    def mount(self, app: Starlette) -> None:
        """Serve the endpoint at exactly `path` and run the SDK inside the app's lifespan.

        A `Route` (not a `Mount`): a mount at `/mcp` matches only `/mcp/...`, and the router
        would answer `POST /mcp` with a 307 to `/mcp/`. The lifespan composes with whatever
        is installed now; `install_checkpointing`, called later, wraps this one in turn.
        """
        app.router.routes.append(Route(self.path, endpoint=self, include_in_schema=False))
        original = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(lifespan_app: Any) -> AsyncIterator[Any]:
            async with original(lifespan_app) as state, self.running():
                yield state

        app.router.lifespan_context = lifespan

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run a fresh session manager (its task group) until the context exits.

        A manager runs only once, so each lifespan gets its own.
        """
        manager = StreamableHTTPSessionManager(
            app=self.mcp_server,
            json_response=True,
            stateless=True,
            # The signed session token is the credential; the server is reached under
            # whatever host name the deployment gives it, so no Host/Origin allow-list.
            security_settings=None,
        )
        async with manager.run():
            self._manager = manager
            try:
                yield
            finally:
                self._manager = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        manager = self._manager
        if manager is None:
            response = JSONResponse(
                {"error": {"code": "mcp_not_running", "detail": "the MCP endpoint is not running"}},
                status_code=503,
            )
            await response(scope, receive, send)
            return
        await manager.handle_request(scope, receive, send)

    # -- MCP handlers -------------------------------------------------------------------

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return self._listing.model_copy(deep=True)

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        tool = self._tools.get(params.name)
        if tool is None:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}")
        request = ctx.request
        session_id = None
        if isinstance(request, Request):
            tokens = request.headers.getlist(TOKEN_HEADER)
            if len(tokens) == 1:
                session_id = self.session_from_token(tokens[0])
        if session_id is None:
            return _tool_error(_INVALID_TOKEN)
        arguments: dict[str, Any] = params.arguments or {}
        try:
            args: Any = (
                tool.args_model.model_validate(arguments)
                if tool.args_model is not None
                else arguments
            )
        except ValidationError as exc:
            return _tool_error(f"invalid arguments for {tool.name}: {exc}")
        try:
            result = await tool.call(session_id, args)
        except HTTPException as exc:
            return _tool_error(str(exc.detail))
        except Exception:
            log.exception("MCP tool %s raised", tool.name)
            return _tool_error(f"tool {tool.name} failed")
        text = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=result if isinstance(result, dict) else None,
        )


def _package_version() -> str:
    try:
        return importlib.metadata.version("rollout-checkpoint")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _input_schema(tool: Tool) -> dict[str, Any]:
    if tool.args_model is None:
        return {"type": "object"}
    return tool.args_model.model_json_schema()


def _tool_error(message: str) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)], is_error=True
    )
