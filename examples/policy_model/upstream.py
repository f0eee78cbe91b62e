"""Proxy mode: a real OpenAI-compatible server behind the policy model's admission gate.

Apart from the scripted model because nothing is generated here: calls are forwarded and
answered as the upstream answers them, except that an upstream that fails or times out is
answered with the policy model's own typed errors (502, 504), so an agent tells a dead
upstream from a refused request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from rollout_checkpoint.server.core.keep_alive import client_limits
from rollout_checkpoint.server.model.generation_cuts import GenerationPrefix, call_of, prefix_of

from ..relay import timed_out
from .config import PolicyModelConfig
from .generation import Generation
from .policy import PolicyError, compact_json
from .replies import error_reply, json_object_of

log = logging.getLogger(__name__)


_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
        "content-encoding",
        "cookie",
        "set-cookie",
        "date",
        "server",
    }
)


class UpstreamProxy:
    """The policy model's routes in proxy mode: each call forwarded to the upstream (rollout
    prefix stripped, body untouched, streaming passed through), while the admission gate and
    the held responses stay in front of it, in the policy model's app. So a real model
    replaces the scripted one by configuration.

    It shares the server's generations (by the model participant's call): with
    `upstream_continuation = "vllm"` a chat call is streamed from the upstream so the content
    generated so far is what a cut stages, exactly as for a scripted generation."""

    def __init__(
        self,
        config: PolicyModelConfig,
        generations: weakref.WeakKeyDictionary[object, Generation | ProxyGeneration],
    ) -> None:
        assert config.upstream is not None
        self.config = config
        self.client: httpx.AsyncClient | None = None
        """The upstream connections, open while the app runs (`running`)."""
        self._generations = generations

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The upstream client for the app's lifetime: closed at shutdown, so no connection
        outlives the server (nor is one opened before the app starts)."""
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.upstream_timeout, connect=10.0),
            limits=client_limits(max_connections=1000, max_keepalive_connections=100),
        )
        try:
            yield
        finally:
            client, self.client = self.client, None
            await client.aclose()

    def upstream_url(self, path: str) -> str:
        """The upstream URL of a (prefix-stripped) path; a base ending in `/v1` is not doubled."""
        assert self.config.upstream is not None
        base = self.config.upstream.rstrip("/")
        if base.endswith("/v1") and path.startswith("/v1/"):
            path = path[len("/v1") :]
        return base + path

    async def route(self, request: Request) -> Response:
        """Every route of proxy mode: a generation call or `/v1/models`, passed upstream."""
        client = self.client
        if client is None:
            return error_reply(503, "upstream_not_ready", "the upstream client is not running")
        body = await request.body()
        call = call_of(request.scope)
        if (
            self.config.upstream_continuation == "vllm"
            and call is not None
            and request.scope["path"] == "/v1/chat/completions"
        ):
            try:
                parsed = json_object_of(body)
            except PolicyError:
                parsed = None
            if parsed is not None and parsed.get("stream") is not True:
                return await self._cuttable(client, request, call, parsed)
        try:
            wants_stream = json.loads(body).get("stream") is True if body else False
        except (ValueError, AttributeError, RecursionError):
            wants_stream = False
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["accept-encoding"] = "identity"
        if self.config.upstream_api_key:
            headers["authorization"] = f"Bearer {self.config.upstream_api_key}"
        upstream_request = client.build_request(
            request.method,
            self.upstream_url(request.scope["path"]),
            content=body,
            headers=headers,
            params=request.query_params,
        )
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("upstream %s failed: %r", upstream_request.url, exc)
            return _upstream_failed(exc)
        reply_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        content_type = upstream.headers.get("content-type", "")
        if wants_stream and content_type.startswith("text/event-stream"):
            return StreamingResponse(
                _relay(upstream),
                status_code=upstream.status_code,
                headers=reply_headers,
                background=BackgroundTask(upstream.aclose),
            )
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            log.warning("upstream %s failed mid-response: %r", upstream_request.url, exc)
            return _upstream_failed(exc)
        finally:
            await upstream.aclose()
        if _untyped_failure(upstream):
            return _upstream_answered(upstream.status_code, content)
        return Response(content, status_code=upstream.status_code, headers=reply_headers)

    async def _cuttable(
        self, client: httpx.AsyncClient, request: Request, call: object, body: dict[str, Any]
    ) -> Response:
        """A non-streaming chat call that a generation cut may stage: streamed from the
        upstream (so the content generated so far is known here) and answered as one
        `chat.completion`. A restored cut's prefix goes upstream as the final assistant
        message to continue (vLLM); the reply's content is the prefix and its continuation.
        An upstream that refuses the continuation (4xx) is asked again without it."""
        prefix = prefix_of(request.scope)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["accept-encoding"] = "identity"
        if self.config.upstream_api_key:
            headers["authorization"] = f"Bearer {self.config.upstream_api_key}"
        url = self.upstream_url(request.scope["path"])
        while True:
            upstream_body = dict(body, stream=True, stream_options={"include_usage": True})
            if prefix is not None:
                upstream_body["messages"] = [
                    *body.get("messages", []),
                    {"role": "assistant", "content": prefix.text},
                ]
                upstream_body["continue_final_message"] = True
                upstream_body["add_generation_prompt"] = False
            generation = ProxyGeneration(prefix)
            self._generations[call] = generation
            try:
                async with client.stream("POST", url, json=upstream_body, headers=headers) as up:
                    if up.status_code != 200:
                        content = await up.aread()
                        if prefix is not None and 400 <= up.status_code < 500:
                            log.warning(
                                "upstream refused a continuation (HTTP %d): generating again",
                                up.status_code,
                            )
                            prefix = None
                            continue
                        if _untyped_failure(up):
                            return _upstream_answered(up.status_code, content)
                        return Response(
                            content,
                            status_code=up.status_code,
                            media_type=up.headers.get("content-type"),
                        )
                    async for line in up.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            generation.add(json.loads(line[len("data: ") :]))
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("upstream %s failed: %r", url, exc)
                return _upstream_failed(exc)
            return Response(compact_json(generation.completion()), media_type="application/json")


@dataclass
class ProxyGeneration:
    """A chat completion streamed from the upstream, assembled as it comes: the content
    deltas (about a token each) are what a cut stages; once a tool call started, nothing is
    (a partial tool call cannot be continued as an assistant message)."""

    prefix: GenerationPrefix | None
    content: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    first: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: Any = None

    def add(self, event: Mapping[str, Any]) -> None:
        if not self.first:
            self.first = {k: event.get(k) for k in ("id", "created", "model")}
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(str(delta["content"]))
            for part in delta.get("tool_calls") or []:
                index = int(part.get("index", 0))
                while len(self.tool_calls) <= index:
                    self.tool_calls.append(
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                target = self.tool_calls[index]
                target["id"] = part.get("id") or target["id"]
                function = part.get("function") or {}
                target["function"]["name"] += function.get("name") or ""
                target["function"]["arguments"] += function.get("arguments") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def staged(self) -> GenerationPrefix | None:
        if self.tool_calls:
            return None
        base_text = self.prefix.text if self.prefix is not None else ""
        base_tokens = self.prefix.tokens if self.prefix is not None else 0
        if not self.content and not base_tokens:
            return None
        return GenerationPrefix(base_text + "".join(self.content), base_tokens + len(self.content))

    def completion(self) -> dict[str, Any]:
        """The `chat.completion` the caller asked for: a continued prefix comes first."""
        text = "".join(self.content)
        if self.prefix is not None and not self.tool_calls:
            text = self.prefix.text + text
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return {
            "id": self.first.get("id"),
            "object": "chat.completion",
            "created": self.first.get("created") or 0,
            "model": self.first.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                }
            ],
            "usage": self.usage,
        }


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for part in upstream.aiter_bytes():
            yield part
    except httpx.HTTPError as exc:  # the stream ends short; the client sees no [DONE]
        log.warning("upstream stream failed: %s", exc)
    finally:
        await upstream.aclose()


def _upstream_failed(exc: Exception) -> Response:
    """The proxy's reply to a call the upstream did not answer: 504 `upstream_timeout` when
    it took the call and did not answer in time (it is alive: a caller may wait longer),
    else 502 `upstream_unavailable` (unreachable, went away mid-reply, or garbled it)."""
    if isinstance(exc, httpx.TransportError) and timed_out(exc):
        detail = f"the upstream model server did not answer in time ({type(exc).__name__})"
        return error_reply(504, "upstream_timeout", detail)
    detail = f"the upstream model server failed: {type(exc).__name__} {exc}".rstrip()
    return error_reply(502, "upstream_unavailable", detail)


def _untyped_failure(upstream: httpx.Response) -> bool:
    """An upstream failure whose body is not JSON (a gateway's HTML page, a plain-text 500):
    passed on as it is, its caller could not read it as an error."""
    content_type = upstream.headers.get("content-type", "")
    return upstream.status_code >= 400 and not content_type.startswith("application/json")


def _upstream_answered(status: int, content: bytes) -> Response:
    """An untyped upstream failure as the usual typed error, with the upstream's status."""
    text = content[:200].decode("utf-8", errors="replace")
    return error_reply(
        status, "upstream_failed", f"the upstream model server answered {status}: {text}"
    )
