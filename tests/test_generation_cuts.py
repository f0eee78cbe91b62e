"""Generation cuts on the scripted policy model (server/model/generation_cuts.py).

Each server runs under uvicorn on 127.0.0.1:0 in the test loop, with its own sidecar; the
generations that a test must catch mid-way wait on a token gate (after their k-th token),
never on a sleep. The control plane runs on a manual clock, so a Prepare's deadline is the
test's own figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.policy_model import (
    GatePoint,
    PolicyModelConfig,
    PolicyModelServer,
    generation_text,
    split_tokens,
)
from rollout_checkpoint.server.core.clock import ManualClock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.server.model.generation_cuts import (
    GenerationCut,
    GenerationPrefix,
    conversation_digest,
)
from rollout_checkpoint.server.model.participant import ModelParticipant
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, drain, serve_app
from .test_policy_model import CLINIC, POLICY, after, chat, rollouts

PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED
STAGING = types_pb2.BLOCKER_REASON_STAGING_GENERATION_CUTS
WAIT = 30.0


class TokenGate:
    """Holds a rollout's generation right after its k-th token, until released."""

    def __init__(self) -> None:
        self.holds: dict[tuple[str, int], tuple[asyncio.Event, asyncio.Event]] = {}

    def hold(self, rollout: str, token: int) -> asyncio.Event:
        reached, release = asyncio.Event(), asyncio.Event()
        self.holds[(rollout, token)] = (reached, release)
        return release

    async def reached(self, rollout: str, token: int) -> None:
        async with asyncio.timeout(WAIT):
            await self.holds[(rollout, token)][0].wait()

    async def __call__(self, point: GatePoint) -> None:
        held = self.holds.get((point.rollout_id, point.token)) if point.phase == "token" else None
        if held is not None:
            held[0].set()
            await held[1].wait()

    def release_all(self) -> None:
        for _, release in self.holds.values():
            release.set()


@dataclass
class Model:
    server: PolicyModelServer
    clock: ManualClock
    http: httpx.AsyncClient
    client: ParticipantClient
    gate: TokenGate
    calls: list[asyncio.Future[httpx.Response]] = field(default_factory=list)

    @property
    def participant(self) -> ModelParticipant:
        assert self.server.participant is not None
        return self.server.participant

    def deadline(self, seconds: float = 60) -> float:
        return self.clock.now() + seconds

    def start(self, rollout: str, body: dict[str, Any]) -> asyncio.Future[httpx.Response]:
        call = asyncio.ensure_future(
            self.http.post(f"/ng-rollout/{rollout}/v1/chat/completions", json=body)
        )
        self.calls.append(call)
        return call

    async def prepared(self, checkpoint_id: str, seconds: float = 60) -> list[Any]:
        progress = await drain(self.client.prepare(checkpoint_id, self.deadline(seconds)))
        assert progress[-1].state == PREPARED, progress[-1]
        return progress


@contextlib.asynccontextmanager
async def model(upstream: str | None = None, gate: TokenGate | None = None) -> AsyncIterator[Model]:
    """A checkpointed scripted model; with `upstream`, a proxy to that server whose
    continuation is vLLM's."""
    clock = ManualClock()
    gate = gate or TokenGate()
    server = PolicyModelServer(
        PolicyModelConfig(
            checkpoint=CheckpointSettings(enabled=True, token=TOKEN),
            latency=0.0,
            gate=gate,
            clock=clock,
            upstream=upstream,
            upstream_continuation="vllm",
        )
    )
    runner, serving, port = await serve_app(server.build_app())
    assert server.runtime is not None
    m = Model(
        server,
        clock,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT),
        ParticipantClient(server.runtime.address, TOKEN, clock=clock.now),
        gate,
    )
    try:
        yield m
    finally:
        await server.runtime.sidecar.begin_shutdown()
        gate.release_all()
        for call in m.calls:
            call.cancel()
            with contextlib.suppress(BaseException):
                await call
        await m.http.aclose()
        await m.client.close()
        runner.should_exit = True
        await serving


def records(ckpt: Path) -> dict[str, dict[str, Any]]:
    # The runtime's reader: the model checkpoints incrementally (reference lines).
    _, records = LocalStorage().read_part(str(ckpt), "model", "policy_model", lambda _r: True)
    found = {}
    for record in records:
        found[EpisodeId.from_json(record.pop("episode_id")).capture_key] = record
    return found


async def final_call(m: Model, rollout: str) -> dict[str, Any]:
    """The body of `rollout`'s last call (its final message: the longest generation), after
    the earlier calls were delivered. It names the rollout in its metadata too: an upstream
    behind the proxy never sees the rollout prefix."""
    named = {"metadata": {"rollout_id": rollout}}
    body = chat(CLINIC, **named)
    for _ in range(len(CLINIC["reference_plan"])):
        reply = await m.http.post(f"/ng-rollout/{rollout}/v1/chat/completions", json=body)
        body = chat(CLINIC, after(body["messages"], reply), **named)
    return body


def final_tokens(body: dict[str, Any], rollout: str) -> int:
    decision = POLICY.decide(CLINIC, rollout, body["messages"])
    assert decision.tool_name is None
    return len(split_tokens(generation_text(decision)))


async def checkpoint_cut_at(
    m: Model, rollout: str, body: dict[str, Any], token: int, ckpt: Path
) -> asyncio.Future[httpx.Response]:
    """Start `body`, cut it after `token` tokens (prepare, commit), leave the model closed."""
    m.gate.hold(rollout, token)
    call = m.start(rollout, body)
    await m.gate.reached(rollout, token)
    await m.prepared("c1")
    await m.client.commit("c1", m.deadline(), str(ckpt), [EpisodeId(rollout)])
    return call


async def test_a_cut_call_continues_after_restore_generating_only_the_rest(
    tmp_path: Path,
) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    ckpt = tmp_path / "c1"
    async with model() as baseline:
        body = await final_call(baseline, rollout)
        before = baseline.server.stats.generated_tokens
        whole = await baseline.http.post(f"/ng-rollout/{rollout}/v1/chat/completions", json=body)
        total = final_tokens(body, rollout)
        assert baseline.server.stats.generated_tokens - before == total > 4

    async with model() as a:
        body = await final_call(a, rollout)
        await checkpoint_cut_at(a, rollout, body, 3, ckpt)
        (record,) = records(ckpt).values()
        assert record["generation_cut"] == {
            "conversation_sha256": conversation_digest(json.dumps(body).encode()),
            "text": generation_text(POLICY.decide(CLINIC, rollout, body["messages"]))[:12],
            "tokens": 3,
        }

    async with model() as b:
        await b.client.restore("r1", b.deadline(), str(ckpt), [EpisodeId(rollout)])
        await b.client.resume("r1", b.deadline())
        # The re-issued call: its transport differs (key order), its conversation does not.
        reissued = dict(reversed(list(body.items())))
        reply = await b.http.post(f"/ng-rollout/{rollout}-a1/v1/chat/completions", json=reissued)
        assert reply.json() == whole.json()
        assert b.server.stats.generated_tokens == total - 3
        assert b.server.stats.continued_calls == 1


@contextlib.asynccontextmanager
async def upstream(gate: TokenGate) -> AsyncIterator[tuple[PolicyModelServer, str]]:
    """The scripted model as an OpenAI-compatible upstream (no checkpointing): it streams
    token by token and honours vLLM's `continue_final_message`."""
    server = PolicyModelServer(PolicyModelConfig(latency=0.0, gate=gate))
    runner, serving, port = await serve_app(server.build_app())
    try:
        yield server, f"http://127.0.0.1:{port}/v1"
    finally:
        gate.release_all()
        runner.should_exit = True
        await serving


async def test_the_proxy_stages_the_streamed_content_and_vllm_continues_it(
    tmp_path: Path,
) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    ckpt = tmp_path / "c1"
    gate = TokenGate()
    async with upstream(gate) as (server, url), model(url, gate) as a:
        body = await final_call(a, rollout)
        total = final_tokens(body, rollout)
        # The upstream holds the final message once it streamed 3 tokens: what reached the
        # proxy by the close is staged (the last may still be on the wire).
        await checkpoint_cut_at(a, rollout, body, 3, ckpt)
        (record,) = records(ckpt).values()
        cut = record["generation_cut"]["tokens"]
        assert 1 <= cut <= 3

    gate = TokenGate()
    async with upstream(gate) as (server, url), model(url, gate) as b:
        await b.client.restore("r1", b.deadline(), str(ckpt), [EpisodeId(rollout)])
        await b.client.resume("r1", b.deadline())
        reply = await b.http.post(f"/ng-rollout/{rollout}-a1/v1/chat/completions", json=body)
        decision = POLICY.decide(CLINIC, rollout, body["messages"])
        assert reply.json()["choices"][0]["message"] == decision.message()
        assert server.stats.generated_tokens == total - cut
        assert server.stats.continued_calls == 1


class FailingBackend:
    def __init__(self) -> None:
        self.asked: list[Sequence[object]] = []

    async def stage(self, calls: Sequence[object]) -> Mapping[object, GenerationPrefix]:
        self.asked.append(calls)
        raise RuntimeError("the inference worker is gone")


class SilentBackend:
    """Never answers: the round must end at its bound, not at the Prepare's deadline."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def stage(self, calls: Sequence[object]) -> Mapping[object, GenerationPrefix]:
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
        return {}


async def test_a_failed_staging_costs_only_regeneration(tmp_path: Path) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    ckpt = tmp_path / "c1"
    async with model() as a:
        a.participant.backend = backend = FailingBackend()
        body = await final_call(a, rollout)
        await checkpoint_cut_at(a, rollout, body, 3, ckpt)
        assert len(backend.asked) == 1  # one round
        (record,) = records(ckpt).values()
        assert set(record) == {"calls"} and len(record["calls"]) == len(CLINIC["reference_plan"])

    async with model() as b:
        await b.client.restore("r1", b.deadline(), str(ckpt), [EpisodeId(rollout)])
        await b.client.resume("r1", b.deadline())
        reply = await b.http.post(f"/ng-rollout/{rollout}-a1/v1/chat/completions", json=body)
        assert reply.status_code == 200
        assert b.server.stats.generated_tokens == final_tokens(body, rollout)
        assert b.server.stats.continued_calls == 0


async def test_staging_takes_at_most_half_the_prepare_time_left() -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    async with model() as m:
        m.participant.backend = backend = SilentBackend()
        m.gate.hold(rollout, 1)
        m.start(rollout, chat(CLINIC))
        await m.gate.reached(rollout, 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # The manual clock stands still: only the bound (half of 2 s) can end the round.
        progress = await m.prepared("c1", seconds=2.0)
        elapsed = loop.time() - started
        assert backend.cancelled.is_set()
        assert 0.95 <= elapsed < 2.0, elapsed
        blockers = [(b.capture_key, b.reason) for b in progress[0].readiness.blockers]
        assert blockers == [(rollout, STAGING)]
        assert progress[-1].readiness.counts["cut"] == 0


async def test_one_cut_per_episode_the_call_started_last(tmp_path: Path) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    ckpt = tmp_path / "c1"
    async with model() as m:
        first = await m.http.post(f"/ng-rollout/{rollout}/v1/chat/completions", json=chat(CLINIC))
        second = chat(CLINIC, after(chat(CLINIC)["messages"], first))
        # An abandoned call of the episode and the one its agent issued next, both mid-way.
        m.gate.hold(rollout, 2)
        m.start(rollout, chat(CLINIC))
        await m.gate.reached(rollout, 2)
        await checkpoint_cut_at(m, rollout, second, 1, ckpt)
        assert (await m.client.get_status()).readiness.counts["cut"] == 1
        (record,) = records(ckpt).values()
        cut = record["generation_cut"]
        assert cut["conversation_sha256"] == conversation_digest(json.dumps(second).encode())
        assert cut["tokens"] == 1


async def test_a_conversation_that_differs_gets_no_prefix(tmp_path: Path) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    ckpt, again = tmp_path / "c1", tmp_path / "c2"
    async with model() as a:
        body = await final_call(a, rollout)
        await checkpoint_cut_at(a, rollout, body, 3, ckpt)

    async with model() as b:
        await b.client.restore("r1", b.deadline(), str(ckpt), [EpisodeId(rollout)])
        await b.client.resume("r1", b.deadline())
        other = chat(CLINIC, [*body["messages"][:-1], {"role": "tool", "content": "changed"}])
        reply = await b.http.post(f"/ng-rollout/{rollout}-a1/v1/chat/completions", json=other)
        assert reply.status_code == 200
        assert b.server.stats.continued_calls == b.server.stats.prefix_mismatches == 0
        # The cut went with the claim: a later checkpoint does not carry it forward.
        await b.prepared("c2")
        await b.client.commit("c2", b.deadline(), str(again), [EpisodeId(rollout, 1)])
        (record,) = records(again).values()
        assert "generation_cut" not in record


def test_a_stored_cut_is_exactly_one_nonempty_prefix() -> None:
    good = {"conversation_sha256": "a" * 64, "text": "Done", "tokens": 1}
    assert GenerationCut.from_json(good).to_json() == good
    for bad in (
        {**good, "tokens": 0},
        {**good, "tokens": True},
        {**good, "text": ""},
        {**good, "conversation_sha256": "A" * 64},
        {**good, "extra": 1},
        [good],
    ):
        with pytest.raises(ValueError, match="a generation cut"):
            GenerationCut.from_json(bad)
