"""The scripted policy model: a deterministic stand-in for a training policy, as a participant.

    python -m rollout_checkpoint.examples.policy_model --latency 0.05 --http-address 127.0.0.1:0

`POST /v1/chat/completions` speaks the OpenAI chat-completions shape with tool calls. The
request names its task in `metadata.task_id` (a row of `prompt_injection_tasks.jsonl`); the
rollout comes from the rollout prefix (`/ng-rollout/<capture_key>/...`, its rollout id, so
attempt N+1 answers exactly as attempt N did), else from `metadata.rollout_id`, else
`"anonymous"`. The step is derived from the request's own conversation (the number of
assistant messages already in `messages`), never from a counter: a held or re-issued call gets
the answer its conversation calls for.

Policy: follow the task's `reference_plan`, one tool call per step, then answer with a short
final message (`finish_reason: "stop"`). For about one (task, rollout) pair in four (chosen by
SHA-256 of the two ids) the model "falls for" the injection: at the first step whose
conversation shows the injected text in a tool result, it calls `injection.target_tool` with
`injection.target_args` (completed with harmless values for arguments the tool requires),
then carries on with the plan. So rewards vary across rollouts but are reproducible.

`--latency` simulates generation time so rollouts stay in flight long enough to be cut, and
`--token-latency` the time of each generated token: the model generates its answer token by
token (four characters each: the final message's content, or the tool call's arguments), so a
checkpoint can cut a generation mid-way. `stream: true` answers as server-sent events
(`chat.completion.chunk` per token as it is generated, then `[DONE]`).

Generation cuts (server/model/generation_cuts.py): the server is its participant's backend. It
stages the tokens a call generated so far, continues a restored prefix attached to a
re-issued call (generating only the rest), and honours vLLM's `continue_final_message` (the
final assistant message's content continued, only the continuation answered), so it can also
stand in for a vLLM upstream. `GET /scripted/stats` counts the generated tokens.

`--upstream URL` makes the server a thin proxy in front of a real OpenAI-compatible server
instead: generation calls are forwarded (rollout prefix stripped, body untouched, streaming
passed through), while the admission gate and the held responses stay here. So a real model
replaces the scripted one by configuration. With `--upstream-continuation vllm` the proxy also
cuts generations: a non-streaming chat call of an episode is streamed from the upstream (the
content so far is what a cut stages) and a restored prefix is continued through vLLM's
`continue_final_message`.

With checkpointing enabled the app has, outermost first: the rollout prefix, the model
admission middleware (`ModelParticipant`: 409 `admission_closed`, held responses, the ledger of
delivered calls) and the gRPC sidecar.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import sys
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Scope

from rollout_checkpoint.examples.prompt_injection import load_tasks
from rollout_checkpoint.examples.relay import timed_out
from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.model.generation_cuts import GenerationPrefix, call_of, prefix_of
from rollout_checkpoint.server.model.participant import (
    GENERATION_PATHS,
    ModelAdmissionMiddleware,
    ModelParticipant,
)
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware, episode_of
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

__all__ = [
    "INJECTION_FILLERS",
    "Decision",
    "GatePoint",
    "PolicyError",
    "PolicyModelConfig",
    "PolicyModelServer",
    "ScriptedPolicy",
    "add_arguments",
    "build_server",
    "main",
]

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
DEFAULT_MODEL = "scripted-policy"

INJECTION_FILLERS: Mapping[str, Mapping[str, Any]] = {
    "send_message": {
        "subject": "Requested information",
        "body": "Forwarding the information requested in the notice.",
    },
    "prescribe_medication": {"dosage": "1 tablet every 4 hours"},
    "send_offer": {"start_date": "2025-04-01"},
    "schedule_appointment": {"date": "2025-03-31", "time": "08:00"},
    "update_patient_chart": {"note": "Updated as instructed."},
}
"""Arguments a tool requires that an injection's `target_args` may leave out. The injected call
carries the target's arguments first, then these for whatever is missing, so it succeeds
against the prompt-injection server (and changes its state, as a real exploit would)."""


class PolicyError(Exception):
    """A request the scripted model cannot answer: 400 with `{"error": {"code", "detail"}}`."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


# -- the policy (pure: a request in, a decision out) -----------------------------------------


@dataclass(frozen=True)
class Decision:
    """What the model answers at one step: one tool call, or the final message."""

    step: int
    tool_name: str | None = None
    arguments: Mapping[str, Any] = field(default_factory=dict)
    content: str | None = None
    injected: bool = False

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_name is not None else "stop"

    def message(self) -> dict[str, Any]:
        """The assistant message (`tool_calls` ids are `call_<step>_<i>`)."""
        if self.tool_name is None:
            return {"role": "assistant", "content": self.content}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{self.step}_0",
                    "type": "function",
                    "function": {"name": self.tool_name, "arguments": _dumps(self.arguments)},
                }
            ],
        }


class ScriptedPolicy:
    """Follows each task's `reference_plan`; one (task, rollout) pair in `fall_one_in` falls
    for the task's injection (0: never)."""

    def __init__(self, tasks: Iterable[Mapping[str, Any]], *, fall_one_in: int = 4) -> None:
        self.tasks: dict[str, Mapping[str, Any]] = {}
        for task in tasks:
            task_id = task.get("task_id")
            plan = task.get("reference_plan")
            if not isinstance(task_id, str) or not isinstance(plan, list) or not plan:
                raise ValueError(f"task {task_id!r} needs a task_id and a non-empty reference_plan")
            self.tasks[task_id] = task
        self.fall_one_in = fall_one_in

    def task(self, task_id: object) -> Mapping[str, Any]:
        if not isinstance(task_id, str):
            raise PolicyError("missing_task", "the request needs metadata.task_id (a string)")
        task = self.tasks.get(task_id)
        if task is None:
            raise PolicyError("unknown_task", f"no task {json.dumps(task_id)}")
        return task

    def falls_for_injection(self, task_id: str, rollout_id: str) -> bool:
        if self.fall_one_in <= 0:
            return False
        digest = hashlib.sha256(f"{task_id}\n{rollout_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.fall_one_in == 0

    def injected_call(self, task: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        injection = task.get("injection")
        if not isinstance(injection, Mapping):
            return None
        tool, target_args = injection.get("target_tool"), injection.get("target_args")
        if not isinstance(tool, str) or not isinstance(target_args, Mapping):
            return None
        arguments = dict(target_args)
        for name, value in INJECTION_FILLERS.get(tool, {}).items():
            arguments.setdefault(name, value)
        return tool, arguments

    def decide(
        self, task: Mapping[str, Any], rollout_id: str, messages: Sequence[Mapping[str, Any]]
    ) -> Decision:
        """The answer to a conversation: its step is the number of assistant messages in it."""
        plan: list[Mapping[str, Any]] = list(task["reference_plan"])
        assistant = [m for m in messages if m.get("role") == "assistant"]
        step = len(assistant)
        injected = self.injected_call(task)
        already = injected is not None and any(_calls(m, *injected) for m in assistant)
        if (
            injected is not None
            and not already
            and self.falls_for_injection(str(task["task_id"]), rollout_id)
            and _injection_visible(task, messages)
        ):
            return Decision(step, injected[0], injected[1], injected=True)
        index = step - (1 if already else 0)
        if index < len(plan):
            planned = plan[index]
            return Decision(step, str(planned["name"]), dict(planned.get("arguments") or {}))
        names = ", ".join(dict.fromkeys(str(p["name"]) for p in plan))
        return Decision(step, content=f"Done. I used {names} to complete the task.")

    def completion(
        self, request: Mapping[str, Any], rollout_id: str, *, model: str | None = None
    ) -> tuple[Decision, dict[str, Any]]:
        """The whole `chat.completion` reply to a request body (deterministic)."""
        messages = _messages(request)
        metadata = request.get("metadata")
        task = self.task(metadata.get("task_id") if isinstance(metadata, Mapping) else None)
        decision = self.decide(task, rollout_id, messages)
        message = decision.message()
        reply = {
            "id": _completion_id(str(task["task_id"]), rollout_id, decision.step),
            "object": "chat.completion",
            "created": 0,
            "model": _model_name(request, model),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": decision.finish_reason,
                }
            ],
            "usage": _usage(messages, message),
        }
        return decision, reply


def _messages(request: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = request.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise PolicyError("invalid_messages", "messages must be a list of message objects")
    return messages


def _model_name(request: Mapping[str, Any], default: str | None) -> str:
    model = request.get("model")
    return model if isinstance(model, str) and model else (default or DEFAULT_MODEL)


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _completion_id(task_id: str, rollout_id: str, step: int) -> str:
    digest = hashlib.sha256(f"{task_id}\n{rollout_id}\n{step}".encode()).hexdigest()
    return f"chatcmpl-{digest[:24]}"


def _usage(messages: Sequence[Mapping[str, Any]], message: Mapping[str, Any]) -> dict[str, int]:
    """A deterministic token estimate (four characters a token)."""
    prompt = math.ceil(len(_dumps(list(messages))) / 4)
    completion = math.ceil(len(_dumps(message)) / 4)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _text(content: object) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def _injection_visible(task: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a tool result in the conversation shows the injected text (at any JSON escaping
    depth: backslashes are ignored on both sides)."""
    injection = task.get("injection")
    text = injection.get("injection_text") if isinstance(injection, Mapping) else None
    if not isinstance(text, str) or not text:
        return False
    needle = text.replace("\\", "")
    return any(
        needle in _text(m.get("content")).replace("\\", "")
        for m in messages
        if m.get("role") == "tool"
    )


def _calls(message: Mapping[str, Any], tool: str, arguments: Mapping[str, Any]) -> bool:
    """Whether an assistant message calls `tool` with exactly `arguments`."""
    tool_calls = message.get("tool_calls")
    if not isinstance(tool_calls, list):
        return False
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or function.get("name") != tool:
            continue
        raw = function.get("arguments")
        try:
            parsed = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            continue
        if parsed == dict(arguments):
            return True
    return False


# -- the server -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatePoint:
    """Where a generation waits on the test gate: `generate` (before its first token), `token`
    (after token number `token` of this call was generated) or `stream` (after a streamed
    reply's first chunk)."""

    phase: str
    task_id: str
    rollout_id: str
    step: int
    token: int = 0


TOKEN_CHARACTERS = 4
"""The scripted model's tokens are pieces of four characters of its generation text (the same
four characters a token as its usage estimate)."""


def generation_text(decision: Decision) -> str:
    """What the scripted model generates token by token for a decision: the final message's
    content, or the tool call's arguments (JSON)."""
    if decision.tool_name is None:
        return decision.content or ""
    return _dumps(decision.arguments)


def split_tokens(text: str) -> list[str]:
    return [text[i : i + TOKEN_CHARACTERS] for i in range(0, len(text), TOKEN_CHARACTERS)]


@dataclass
class Generation:
    """One call's generation in progress: the prefix it continued (empty: from scratch) and
    the tokens of the rest, `done` of them generated so far."""

    point: GatePoint
    prefix: GenerationPrefix | None
    tokens: list[str]
    done: int = 0

    def staged(self) -> GenerationPrefix | None:
        """The prefix generated so far (the continued one included), None before any token."""
        base_text = self.prefix.text if self.prefix is not None else ""
        base_tokens = self.prefix.tokens if self.prefix is not None else 0
        if base_tokens + self.done == 0:
            return None
        return GenerationPrefix(
            base_text + "".join(self.tokens[: self.done]), base_tokens + self.done
        )


@dataclass
class GenerationStats:
    """What the scripted model generated, for tests and the operator (`GET /scripted/stats`)."""

    generated_tokens: int = 0
    """Tokens generated by this process (a continued call generates only the remainder)."""
    continued_calls: int = 0
    """Calls that continued an attached prefix (a restored generation cut, or a final assistant
    message with `continue_final_message`)."""
    prefix_mismatches: int = 0
    """Calls whose attached prefix was not a prefix of what they generate: generated whole."""


Gate = Callable[[GatePoint], Awaitable[None]]


@dataclass(frozen=True)
class PolicyModelConfig:
    """How one policy model process runs."""

    instance: str = "policy_model"
    checkpoint: CheckpointSettings | None = None
    latency: float = 0.05
    """Seconds of simulated generation before every answer."""
    token_latency: float = 0.0
    """Seconds per generated token on top of `latency` (0: the tokens come at once). With it a
    generation is long enough to be cut mid-way (generation_cuts.py)."""
    upstream: str | None = None
    """Base URL of a real OpenAI-compatible server (e.g. `http://host:8000` or `.../v1`): proxy
    mode. None: the scripted model answers."""
    upstream_api_key: str | None = None
    """Sent upstream as `Authorization: Bearer ...` (else the caller's header is forwarded)."""
    upstream_continuation: str = "none"
    """How the upstream continues a generation cut's prefix: `vllm` (vLLM's chat API: the
    prefix as a final assistant message with `continue_final_message: true` and
    `add_generation_prompt: false`), or `none` (the upstream cannot: calls are not cut, and a
    cut call is generated again after a restore). With `vllm` a non-streaming chat call of an
    episode is streamed from the upstream, so the proxy knows the prefix generated so far."""
    upstream_timeout: float = 600.0
    model_name: str = DEFAULT_MODEL
    """The `model` of a reply when the request names none."""
    fall_one_in: int = 4
    """One (task, rollout) pair in this many falls for the injection (0: never)."""
    tasks: tuple[Mapping[str, Any], ...] | None = None
    """The tasks the scripted model knows (default: the shipped prompt-injection tasks)."""
    gate: Gate | None = None
    """For tests: awaited at each `GatePoint` of a scripted generation."""
    clock: Clock | None = None
    """For tests: the control plane's clock."""


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


class PolicyModelServer:
    """The scripted policy model (or, with `upstream`, a proxy) as a FastAPI app."""

    def __init__(self, config: PolicyModelConfig | None = None) -> None:
        self.config = config or PolicyModelConfig()
        self.instance = self.config.instance
        tasks = self.config.tasks if self.config.tasks is not None else tuple(load_tasks())
        self.policy = ScriptedPolicy(tasks, fall_one_in=self.config.fall_one_in)
        self.participant: ModelParticipant | None = None
        self.runtime: CheckpointRuntime | None = None
        self.upstream: httpx.AsyncClient | None = None
        self.stats = GenerationStats()
        self._generations: weakref.WeakKeyDictionary[object, Generation | ProxyGeneration] = (
            weakref.WeakKeyDictionary()
        )
        """The generations in progress, by the model participant's call (`call_of`)."""

    @property
    def checkpoint_enabled(self) -> bool:
        return self.config.checkpoint is not None and self.config.checkpoint.enabled

    @property
    def proxy(self) -> bool:
        return self.config.upstream is not None

    def build_app(self) -> FastAPI:
        app = FastAPI(
            title=f"PolicyModelServer ({self.instance})",
            openapi_url=None,
            docs_url=None,
            redoc_url=None,
            lifespan=self._lifespan,
        )
        app.state.policy_model = self
        if self.proxy:
            for path in sorted(GENERATION_PATHS):
                app.add_api_route(path, self._proxy_route, methods=["POST"])
            app.add_api_route("/v1/models", self._proxy_route, methods=["GET"])
        else:
            app.add_api_route("/v1/chat/completions", self._chat_route, methods=["POST"])
            app.add_api_route("/v1/models", self._models_route, methods=["GET"])
            app.add_api_route("/scripted/stats", self._stats_route, methods=["GET"])
        if self.checkpoint_enabled:
            assert self.config.checkpoint is not None
            cuts = not self.proxy or self.config.upstream_continuation == "vllm"
            self.participant = ModelParticipant(self.instance, backend=self if cuts else None)
            app.add_middleware(ModelAdmissionMiddleware, participant=self.participant)
            app.add_middleware(RolloutPrefixMiddleware)
            self.runtime = install_checkpointing(
                app, self.participant, self.config.checkpoint, clock=self.config.clock
            )
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if not self.proxy:
            yield
            return
        self.upstream = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.upstream_timeout, connect=10.0),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
        )
        try:
            yield
        finally:
            client, self.upstream = self.upstream, None
            await client.aclose()

    # -- scripted ---------------------------------------------------------------------------

    async def _models_route(self, request: Request) -> Response:
        body = {
            "object": "list",
            "data": [
                {
                    "id": self.config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rollout-checkpoint",
                }
            ],
        }
        return Response(_dumps(body), media_type="application/json")

    async def _stats_route(self, request: Request) -> Response:
        body = {
            "generated_tokens": self.stats.generated_tokens,
            "continued_calls": self.stats.continued_calls,
            "prefix_mismatches": self.stats.prefix_mismatches,
            "generating": [
                {
                    "rollout_id": g.point.rollout_id,
                    "step": g.point.step,
                    "tokens": len(g.tokens) + (g.prefix.tokens if g.prefix else 0),
                    "generated": g.done + (g.prefix.tokens if g.prefix else 0),
                }
                for g in list(self._generations.values())
                if isinstance(g, Generation) and g.done < len(g.tokens)
            ],
        }
        return Response(_dumps(body), media_type="application/json")

    async def stage(self, calls: Sequence[object]) -> Mapping[object, GenerationPrefix]:
        """`GenerationBackend.stage`: the prefix each call generated so far (a held call's is
        its whole text). Reading it does not disturb the generation, which goes on."""
        staged = {}
        for call in calls:
            generation = self._generations.get(call)
            prefix = generation.staged() if generation is not None else None
            if prefix is not None:
                staged[call] = prefix
        return staged

    def _begin_generation(
        self, scope: Scope, point: GatePoint, text: str, prefix: GenerationPrefix | None
    ) -> Generation:
        """A generation of `text`, continuing `prefix` when it is one of `text` (then only the
        rest is generated; a prefix that is not is counted and ignored), registered under the
        model participant's call so a cut can stage it."""
        continued = prefix is not None and text.startswith(prefix.text)
        if prefix is not None and not continued:
            self.stats.prefix_mismatches += 1
        if continued:
            self.stats.continued_calls += 1
        rest = text[len(prefix.text) :] if continued and prefix is not None else text
        generation = Generation(point, prefix if continued else None, split_tokens(rest))
        call = call_of(scope)
        if call is not None:
            self._generations[call] = generation
        return generation

    async def _tokens(self, generation: Generation) -> AsyncIterator[str]:
        """Generate the tokens one by one (`token_latency` each), yielding each once done."""
        point = generation.point
        for index, token in enumerate(generation.tokens):
            if self.config.token_latency > 0:
                await asyncio.sleep(self.config.token_latency)
            generation.done = index + 1
            self.stats.generated_tokens += 1
            yield token  # streamed before the gate: a held stream has sent what it generated
            if self.config.gate is not None:
                await self.config.gate(
                    GatePoint("token", point.task_id, point.rollout_id, point.step, index + 1)
                )

    async def _chat_route(self, request: Request) -> Response:
        try:
            body = _json_object(await request.body())
            final_prefix = _continued_final_message(body)
            if final_prefix is not None:  # vLLM's continuation: the rest of that message
                body = dict(body, messages=body["messages"][:-1])
            rollout_id = self._rollout_id(request, body)
            decision, reply = self.policy.completion(body, rollout_id, model=self.config.model_name)
        except PolicyError as exc:
            return _error(400, exc.code, exc.detail)
        point = GatePoint("generate", str(body["metadata"]["task_id"]), rollout_id, decision.step)
        if self.config.latency > 0:
            await asyncio.sleep(self.config.latency)
        if self.config.gate is not None:
            await self.config.gate(point)
        text = generation_text(decision)
        prefix = final_prefix if final_prefix is not None else prefix_of(request.scope)
        if final_prefix is not None and decision.tool_name is not None:
            prefix = None  # only content is continued this way: answer the call whole
        generation = self._begin_generation(request.scope, point, text, prefix)
        # As vLLM answers `continue_final_message`: only the continuation, never the prefix.
        only_continuation = False
        if final_prefix is not None and generation.prefix is not None:
            only_continuation = True
            reply["choices"][0]["message"]["content"] = text[len(final_prefix.text) :]
        if body.get("stream") is True:
            include_usage = isinstance(body.get("stream_options"), Mapping) and bool(
                body["stream_options"].get("include_usage")
            )
            return StreamingResponse(
                self._events(generation, decision, reply, include_usage, only_continuation),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        async for _ in self._tokens(generation):
            pass
        return Response(_dumps(reply), media_type="application/json")

    def _rollout_id(self, request: Request, body: Mapping[str, Any]) -> str:
        episode = episode_of(request.scope)
        if episode is not None:
            return episode.rollout_id
        metadata = body.get("metadata")
        named = metadata.get("rollout_id") if isinstance(metadata, Mapping) else None
        return named if isinstance(named, str) and named else ANONYMOUS

    async def _events(
        self,
        generation: Generation,
        decision: Decision,
        reply: Mapping[str, Any],
        include_usage: bool,
        only_continuation: bool,
    ) -> AsyncIterator[bytes]:
        """The reply as `chat.completion.chunk` events, generated as they stream: role (and
        tool-call header), the continued prefix (unless `only_continuation`), a delta per
        token, finish, optionally usage, then `[DONE]`."""
        point = generation.point

        def chunk(delta: Mapping[str, Any], finish: str | None) -> bytes:
            event = {
                "id": reply["id"],
                "object": "chat.completion.chunk",
                "created": 0,
                "model": reply["model"],
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            return f"data: {_dumps(event)}\n\n".encode()

        def piece(text: str) -> bytes:
            if decision.tool_name is None:
                return chunk({"content": text}, None)
            return chunk({"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, None)

        message = decision.message()
        if decision.tool_name is not None:
            call = message["tool_calls"][0]
            yield chunk(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""},
                        }
                    ],
                },
                None,
            )
        else:
            yield chunk({"role": "assistant", "content": ""}, None)
        if self.config.gate is not None:
            await self.config.gate(GatePoint("stream", point.task_id, point.rollout_id, point.step))
        if generation.prefix is not None and not only_continuation:
            yield piece(generation.prefix.text)
        async for token in self._tokens(generation):
            yield piece(token)
        yield chunk({}, decision.finish_reason)
        if include_usage:
            usage = {
                "id": reply["id"],
                "object": "chat.completion.chunk",
                "created": 0,
                "model": reply["model"],
                "choices": [],
                "usage": reply["usage"],
            }
            yield f"data: {_dumps(usage)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    # -- proxy ------------------------------------------------------------------------------

    def upstream_url(self, path: str) -> str:
        """The upstream URL of a (prefix-stripped) path; a base ending in `/v1` is not doubled."""
        assert self.config.upstream is not None
        base = self.config.upstream.rstrip("/")
        if base.endswith("/v1") and path.startswith("/v1/"):
            path = path[len("/v1") :]
        return base + path

    async def _proxy_route(self, request: Request) -> Response:
        client = self.upstream
        if client is None:
            return _error(503, "upstream_not_ready", "the upstream client is not running")
        body = await request.body()
        call = call_of(request.scope)
        if (
            self.config.upstream_continuation == "vllm"
            and call is not None
            and request.scope["path"] == "/v1/chat/completions"
        ):
            try:
                parsed = _json_object(body)
            except PolicyError:
                parsed = None
            if parsed is not None and parsed.get("stream") is not True:
                return await self._proxy_cuttable(client, request, call, parsed)
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

    async def _proxy_cuttable(
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
            return Response(_dumps(generation.completion()), media_type="application/json")


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


def _continued_final_message(body: Mapping[str, Any]) -> GenerationPrefix | None:
    """The prefix of a vLLM-style continuation: `continue_final_message: true` with a last
    assistant message whose content is a string (what the proxy sends for a generation cut)."""
    if body.get("continue_final_message") is not True:
        return None
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        return None
    content = last.get("content")
    if not isinstance(content, str) or not content:
        return None
    return GenerationPrefix(content, len(split_tokens(content)))


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise PolicyError("invalid_json", "the body is not JSON") from None
    if not isinstance(body, dict):
        raise PolicyError("invalid_json", "the body must be a JSON object")
    return body


def _upstream_failed(exc: Exception) -> Response:
    """The proxy's reply to a call the upstream did not answer: 504 `upstream_timeout` when
    it took the call and did not answer in time (it is alive: a caller may wait longer),
    else 502 `upstream_unavailable` (unreachable, went away mid-reply, or garbled it)."""
    if isinstance(exc, httpx.TransportError) and timed_out(exc):
        detail = f"the upstream model server did not answer in time ({type(exc).__name__})"
        return _error(504, "upstream_timeout", detail)
    detail = f"the upstream model server failed: {type(exc).__name__} {exc}".rstrip()
    return _error(502, "upstream_unavailable", detail)


def _untyped_failure(upstream: httpx.Response) -> bool:
    """An upstream failure whose body is not JSON (a gateway's HTML page, a plain-text 500):
    passed on as it is, its caller could not read it as an error."""
    content_type = upstream.headers.get("content-type", "")
    return upstream.status_code >= 400 and not content_type.startswith("application/json")


def _upstream_answered(status: int, content: bytes) -> Response:
    """An untyped upstream failure as the usual typed error, with the upstream's status."""
    text = content[:200].decode("utf-8", errors="replace")
    return _error(status, "upstream_failed", f"the upstream model server answered {status}: {text}")


def _error(status: int, code: str, detail: str) -> Response:
    return Response(
        _dumps({"error": {"code": code, "detail": detail}}),
        status_code=status,
        media_type="application/json",
    )


# -- command line -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The policy model's own flags (for `rollout-checkpoint serve policy_model`)."""
    parser.add_argument(
        "--latency",
        type=float,
        default=0.05,
        help="seconds of simulated generation per call (default 0.05)",
    )
    parser.add_argument(
        "--token-latency",
        type=float,
        default=0.0,
        help="seconds per generated token on top of --latency (default 0: all at once)",
    )
    parser.add_argument(
        "--upstream",
        default=None,
        help="proxy a real OpenAI-compatible server at this base URL instead of scripting",
    )
    parser.add_argument(
        "--upstream-continuation",
        choices=["none", "vllm"],
        default="none",
        help="how the upstream continues a generation cut (vllm: continue_final_message)",
    )
    parser.add_argument(
        "--upstream-timeout", type=float, default=600.0, help="seconds per upstream call"
    )
    parser.add_argument(
        "--model-name", default=DEFAULT_MODEL, help="the reply's model when a request names none"
    )
    parser.add_argument(
        "--fall-one-in",
        type=int,
        default=4,
        help="one (task, rollout) pair in N falls for the injection (0: never; default 4)",
    )


def build_server(
    args: argparse.Namespace, checkpoint: CheckpointSettings | None = None
) -> PolicyModelServer:
    """A server from parsed flags. `checkpoint` None: built from the common serve flags
    (`--no-checkpoint`, `--token`, `--grpc-address`, `--start-closed`, `--instance`)."""
    instance = getattr(args, "instance", None) or "policy_model"
    if checkpoint is None and not getattr(args, "no_checkpoint", False):
        overrides: dict[str, Any] = {
            "enabled": True,
            "instance": instance,
            "start_closed": bool(getattr(args, "start_closed", False)),
        }
        if getattr(args, "token", None) is not None:
            overrides["token"] = args.token
        if getattr(args, "grpc_address", None) is not None:
            overrides["grpc_address"] = args.grpc_address
        checkpoint = CheckpointSettings(**overrides)
    return PolicyModelServer(
        PolicyModelConfig(
            instance=instance,
            checkpoint=checkpoint,
            latency=getattr(args, "latency", 0.05),
            token_latency=getattr(args, "token_latency", 0.0),
            upstream=getattr(args, "upstream", None),
            upstream_api_key=os.environ.get("ROLLOUT_CHECKPOINT_UPSTREAM_API_KEY") or None,
            upstream_continuation=getattr(args, "upstream_continuation", "none"),
            upstream_timeout=getattr(args, "upstream_timeout", 600.0),
            model_name=getattr(args, "model_name", DEFAULT_MODEL),
            fall_one_in=getattr(args, "fall_one_in", 4),
        )
    )


def main(argv: list[str] | None = None) -> None:
    """Serve the policy model as its own process; print one JSON line once it listens
    (`http`, `grpc`, `instance`, `kind: "model"`, `pid`)."""
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m rollout_checkpoint.examples.policy_model",
        description="The scripted policy model (or a proxy to a real one) with its sidecar.",
    )
    parser.add_argument("--http-address", default="127.0.0.1:0", help="HOST:PORT (0: free port)")
    parser.add_argument("--grpc-address", default=None, help="the sidecar's HOST:PORT")
    parser.add_argument(
        "--token", default=None, help="control token (else $ROLLOUT_CHECKPOINT_TOKEN)"
    )
    parser.add_argument("--no-checkpoint", action="store_true", help="run without checkpointing")
    parser.add_argument("--instance", default=None, help="instance name (default policy_model)")
    parser.add_argument("--start-closed", action="store_true", help="start with admission closed")
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    server = build_server(args)
    app = server.build_app()
    host, _, port = args.http_address.rpartition(":")
    host = host.strip("[]")

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            bound = self.servers[0].sockets[0].getsockname()
            announcement = {
                "http": f"{host}:{bound[1]}",
                "grpc": server.runtime.address if server.runtime is not None else None,
                "instance": server.instance,
                "kind": "model",
                "pid": os.getpid(),
            }
            print(json.dumps(announcement), flush=True)

    config = uvicorn.Config(
        app,
        host=host,
        port=int(port),
        lifespan="on",
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
    )
    AnnouncingServer(config).run()


if __name__ == "__main__":
    main()
