"""The coordinator's HTTP port (`coordinator --http-address`): the history API and the fleet as
JSON, for browsers, dashboards and `curl`, next to the gRPC port and in the same event loop.

    GET /checkpoints?status=&operation=&page_size=&page_token=   ListCheckpointsResponse
    GET /checkpoints/latest?status=&operation=                   the same, page_size 1
    GET /checkpoints/{id}                                        GetCheckpointResponse
    GET /fleet                                                   ListParticipantsResponse (*)

Each answer is the proto3 JSON mapping (lowerCamelCase) of the very message the gRPC method
returns, computed by the same servicer method: the two ports cannot drift apart. (*) but for
`/fleet`: the members as the coordinator knows them, never discovered afresh
(`CoordinatorServicer.known_participants`), so a page that polls it costs no member a call. A refusal
is `{"error": {"code", "reason", "message"}}` with the gRPC status code's name, the
`ErrorInfo` reason the gRPC port would send, and its message, under the HTTP status that
code maps to (google.rpc's mapping: INVALID_ARGUMENT 400, NOT_FOUND 404, ...).

The port is behind the gRPC port's bearer token (`BearerTokenMiddleware`): it serves the same
history and fleet, so it must not be the open door beside a locked one. `coordinator_app`
builds the whole app from a coordinator; `api_routes` are its routes alone, for an app that
adds its own (static pages) and wraps them all in the middleware itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import code_pb2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_checkpoint.client.coordinator.calls import status_of
from rollout_checkpoint.client.coordinator.history_api import (
    MAX_PAGE_SIZE,
    OPERATIONS,
    STATUSES,
)
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, invalid_request
from rollout_checkpoint.server.core.rpc.auth import refusal_log, token_matches
from rollout_checkpoint.server.core.rpc.status import error_info
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

if TYPE_CHECKING:
    from rollout_checkpoint.client.coordinator.service import Coordinator, CoordinatorServicer

log = logging.getLogger(__name__)

HTTP_STATUS = {
    "OK": 200,
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
}
"""google.rpc's mapping of a status code to an HTTP status (google/rpc/code.proto)."""
_CODE_NAMES = {
    value.number: value.name for value in code_pb2.DESCRIPTOR.enum_types_by_name["Code"].values
}


def error_response(error: BaseException) -> JSONResponse:
    """The JSON refusal of `error`: what the gRPC port would send for it, as JSON."""
    status = status_of(error)
    code = _CODE_NAMES.get(status.code, "UNKNOWN")
    info = error_info(status)
    body = {"code": code, "reason": info.reason if info else "", "message": status.message}
    return JSONResponse({"error": body}, status_code=HTTP_STATUS.get(code, 500))


class AttemptJson:
    """The JSON of `Attempt` messages, each computed once (by its bytes, so equal messages
    share it): json_format spends ~0.2 ms per attempt, which made a page of 50 cost ten
    times its gRPC answer. Bounded: emptied when it holds `LIMIT` (a dashboard's pages are
    far fewer)."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._json: dict[bytes, dict[str, Any]] = {}

    def of(self, attempt: cpb.Attempt) -> dict[str, Any]:
        key = attempt.SerializeToString(deterministic=True)
        cached = self._json.get(key)
        if cached is None:
            if len(self._json) >= self.LIMIT:
                self._json.clear()
            cached = self._json[key] = json_format.MessageToDict(attempt)
        return cached

    def page(self, response: cpb.ListCheckpointsResponse) -> dict[str, Any]:
        """`MessageToDict(response)`, with each attempt's JSON from the cache."""
        rest = cpb.ListCheckpointsResponse()
        rest.CopyFrom(response)
        del rest.checkpoints[:]
        document = json_format.MessageToDict(rest)
        if response.checkpoints:
            document["checkpoints"] = [self.of(a) for a in response.checkpoints]
        return document


class BearerTokenMiddleware:
    """The gRPC port's bearer-token rule over HTTP (pure ASGI, so it also covers what an app
    mounts later): `Authorization: Bearer <token>` compared in constant time, or a 401 with
    a JSON error and `WWW-Authenticate`, logged at most once a minute. No token configured:
    open, like the gRPC port. Paths starting with one of `open_prefixes` need no token."""

    def __init__(self, app: ASGIApp, token: str, open_prefixes: Collection[str] = ()) -> None:
        self.app = app
        self._token = token
        self._open = tuple(open_prefixes)
        self._on_refusal = refusal_log(log)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        self._on_refusal(f"HTTP {scope.get('path', '')}")
        refusal = error_response(
            CheckpointError(Reason.TOKEN_INVALID, "missing or invalid bearer token")
        )
        refusal.headers["WWW-Authenticate"] = 'Bearer realm="rollout-checkpoint"'
        await refusal(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        if not self._token or str(scope.get("path", "")).startswith(self._open):
            return True
        presented = ""
        for key, value in scope.get("headers", ()):
            if key == b"authorization":
                presented = value.decode("latin-1")
                break
        scheme, _, token = presented.partition(" ")
        # Compare even when the scheme is wrong, so timing says nothing about which part failed.
        matches = token_matches(token.strip(), self._token)
        return scheme.lower() == "bearer" and matches


Handler = Callable[[Request], Awaitable[Message]]


def _answering(
    handler: Handler, json_of: Callable[[Any], dict[str, Any]] = json_format.MessageToDict
) -> Callable[[Request], Awaitable[Response]]:
    """`handler`'s message as JSON (`json_of`), or whatever it raised as the JSON refusal.
    The JSON is built and encoded on a thread: a page of 1,000 attempts or a 1,000-member
    GetCheckpoint is tens of milliseconds of json_format, which on the loop would stall
    every RPC of the coordinator (a checkpoint's among them)."""

    async def endpoint(request: Request) -> Response:
        try:
            message = await handler(request)
            return await asyncio.to_thread(lambda: JSONResponse(json_of(message)))
        except Exception as error:  # every failure answers; status_of logs the unexpected
            return error_response(error)

    return endpoint


def _choice(request: Request, name: str, values: Mapping[Any, str], prefix: str) -> Any:
    """An enum query parameter: its short name (`failed`) or its proto name, any case;
    absent or empty: UNSPECIFIED (0)."""
    text = request.query_params.get(name, "").strip().lower()
    if not text:
        return 0
    for value, short in values.items():
        if text in (short, f"{prefix}{short}"):
            return value
    raise invalid_request(name, f"must be one of {', '.join(sorted(values.values()))}")


def _page_size(request: Request) -> int:
    text = request.query_params.get("page_size", "")
    if not text:
        return 0
    try:
        size = int(text)
    except ValueError:
        raise invalid_request("page_size", "is not an integer") from None
    if size < 0:
        raise invalid_request("page_size", "must not be negative")
    return min(size, MAX_PAGE_SIZE)


def _list_request(request: Request, page_size: int | None = None) -> cpb.ListCheckpointsRequest:
    return cpb.ListCheckpointsRequest(
        page_size=_page_size(request) if page_size is None else page_size,
        page_token=request.query_params.get("page_token", ""),
        status=_choice(request, "status", STATUSES, "attempt_status_"),
        operation=_choice(request, "operation", OPERATIONS, "attempt_operation_"),
    )


def api_routes(servicer: CoordinatorServicer) -> list[Route]:
    """The JSON routes, each answered by the servicer's gRPC method of the same meaning."""
    attempts = AttemptJson()

    async def list_checkpoints(request: Request) -> Message:
        return await servicer.list_checkpoints(_list_request(request))

    async def latest(request: Request) -> Message:
        return await servicer.list_checkpoints(_list_request(request, page_size=1))

    async def get_checkpoint(request: Request) -> Message:
        return await servicer.get_checkpoint(cpb.GetCheckpointRequest(id=request.path_params["id"]))

    async def not_an_id(request: Request) -> Message:
        # A `/` (or its escape) in an id: no checkpoint id has one, and none is looked up.
        raise invalid_request("id", "is not a checkpoint id")

    async def fleet(request: Request) -> Message:
        return await servicer.known_participants()

    return [
        Route("/checkpoints", _answering(list_checkpoints, attempts.page), methods=["GET"]),
        Route("/checkpoints/latest", _answering(latest, attempts.page), methods=["GET"]),
        Route("/checkpoints/{id}", _answering(get_checkpoint), methods=["GET"]),
        Route("/checkpoints/{rest:path}", _answering(not_an_id), methods=["GET"]),
        Route("/fleet", _answering(fleet), methods=["GET"]),
    ]


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in the same JSON shape."""
    assert isinstance(error, HTTPException)
    code = {404: "NOT_FOUND", 405: "UNIMPLEMENTED"}.get(error.status_code, "INVALID_ARGUMENT")
    body = {"code": code, "reason": Reason.INVALID_REQUEST.value, "message": str(error.detail)}
    return JSONResponse({"error": body}, status_code=error.status_code)


def coordinator_app(coordinator: Coordinator, open_prefixes: Collection[str] = ()) -> Starlette:
    """The coordinator's HTTP app: `api_routes` behind the fleet's token. An app built here
    may `mount` more (static files) before the coordinator starts; paths under
    `open_prefixes` are served without the token."""
    return Starlette(
        routes=api_routes(coordinator.servicer),
        middleware=[
            Middleware(
                BearerTokenMiddleware,
                token=coordinator.servicer.spec.token,
                open_prefixes=open_prefixes,
            )
        ],
        exception_handlers={HTTPException: _http_error},
    )
