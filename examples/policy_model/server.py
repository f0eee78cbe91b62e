"""The policy model as a FastAPI app: the scripted routes, and its model participant's backend.

The server is the backend (`stage`) because only it knows how far each call's generation got:
a checkpoint can then cut a generation mid-way and a restore continue it from the staged
tokens, rather than generate the whole call again. In proxy mode the routes are
`upstream.UpstreamProxy`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Scope

from rollout_checkpoint.server.model.generation_cuts import GenerationPrefix, call_of, prefix_of
from rollout_checkpoint.server.model.participant import (
    GENERATION_PATHS,
    ModelAdmissionMiddleware,
    ModelParticipant,
)
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware

from ..prompt_injection import load_tasks
from .config import PolicyModelConfig
from .generation import (
    GatePoint,
    Generation,
    GenerationStats,
    continued_final_message,
    generation_text,
    split_tokens,
)
from .policy import Decision, PolicyError, ScriptedPolicy, compact_json
from .recording import RecordingMiddleware, rollout_of
from .replies import error_reply, json_object_of
from .upstream import ProxyGeneration, UpstreamProxy


class PolicyModelServer:
    """The scripted policy model (or, with `upstream`, a proxy) as a FastAPI app."""

    def __init__(self, config: PolicyModelConfig | None = None) -> None:
        self.config = config or PolicyModelConfig()
        self.instance = self.config.instance
        tasks = self.config.tasks if self.config.tasks is not None else tuple(load_tasks())
        self.policy = ScriptedPolicy(tasks, fall_one_in=self.config.fall_one_in)
        self.participant: ModelParticipant | None = None
        self.runtime: CheckpointRuntime | None = None
        self.stats = GenerationStats()
        self._generations: weakref.WeakKeyDictionary[object, Generation | ProxyGeneration] = (
            weakref.WeakKeyDictionary()
        )
        """The generations in progress, by the model participant's call (`call_of`)."""
        self.upstream = (
            UpstreamProxy(self.config, self._generations)
            if self.config.upstream is not None
            else None
        )
        """Proxy mode's routes (None: the scripted model answers)."""

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
        if self.upstream is not None:
            for path in sorted(GENERATION_PATHS):
                app.add_api_route(path, self.upstream.route, methods=["POST"])
            app.add_api_route("/v1/models", self.upstream.route, methods=["GET"])
        else:
            app.add_api_route("/v1/chat/completions", self._chat_route, methods=["POST"])
            app.add_api_route("/v1/models", self._models_route, methods=["GET"])
            app.add_api_route("/scripted/stats", self._stats_route, methods=["GET"])
        if self.config.recording is not None:  # innermost: the ledger sees what it answers
            app.add_middleware(
                RecordingMiddleware,
                recording=self.config.recording,
                replay_latency=self.config.replay_latency,
            )
        if self.checkpoint_enabled:
            assert self.config.checkpoint is not None
            cuts = not self.proxy or self.config.upstream_continuation == "vllm"
            # Incremental: a ledger without a new delivery is referenced in the last part
            # (safe whatever the server behind it does: `ModelParticipant.export_changes`).
            self.participant = ModelParticipant(
                self.instance, backend=self if cuts else None, incremental=True
            )
            app.add_middleware(ModelAdmissionMiddleware, participant=self.participant)
            app.add_middleware(RolloutPrefixMiddleware)
            self.runtime = install_checkpointing(
                app, self.participant, self.config.checkpoint, clock=self.config.clock
            )
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as running:
            if self.config.recording is not None:
                await running.enter_async_context(self.config.recording.running())
            if self.upstream is not None:
                await running.enter_async_context(self.upstream.running())
            yield

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
        return Response(compact_json(body), media_type="application/json")

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
        return Response(compact_json(body), media_type="application/json")

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
            body = json_object_of(await request.body())
            final_prefix = continued_final_message(body)
            if final_prefix is not None:  # vLLM's continuation: the rest of that message
                body = dict(body, messages=body["messages"][:-1])
            rollout_id = rollout_of(request.scope, body)
            decision, reply = self.policy.completion(body, rollout_id, model=self.config.model_name)
        except PolicyError as exc:
            return error_reply(400, exc.code, exc.detail)
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
        return Response(compact_json(reply), media_type="application/json")

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
            return f"data: {compact_json(event)}\n\n".encode()

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
            yield f"data: {compact_json(usage)}\n\n".encode()
        yield b"data: [DONE]\n\n"
