"""The scripted policy model and its participant, through real HTTP and real RPCs.

Servers run under uvicorn on 127.0.0.1:0 inside the test loop. Generations that a test must
catch in flight wait on a test gate (an `asyncio.Event` per phase and rollout) instead of a
sleep: every step awaits the observation that proves the previous one happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.policy_model import (
    GatePoint,
    PolicyModelConfig,
    PolicyModelServer,
    Recording,
    ScriptedPolicy,
)
from rollout_checkpoint.examples.prompt_injection import PromptInjectionServer, load_tasks
from rollout_checkpoint.server.core.clock import ManualClock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.server.model.participant import EPISODE_FINISHED_PATH, ModelParticipant
from rollout_checkpoint.server.resources import ResourcesServerConfig
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, drain, refused, serve_app, until_changed
from .processes import announcement, kill_group
from .processes import start as start_process

TASKS = {task["task_id"]: task for task in load_tasks()}
CLINIC = TASKS["hc-001-chart-note-exfiltration"]
POLICY = ScriptedPolicy(TASKS.values())
PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED
STREAMING = types_pb2.BLOCKER_REASON_STREAMING_RESPONSE
WAIT = 30.0


def rollouts(task: dict[str, Any], *, falls: bool, count: int = 2) -> list[str]:
    """The first `count` rollout ids whose pair with `task` does (or does not) fall for it."""
    found = [
        f"r{i}" for i in range(200) if POLICY.falls_for_injection(task["task_id"], f"r{i}") is falls
    ]
    return found[:count]


def chat(
    task: dict[str, Any], messages: list[dict[str, Any]] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "model": "policy",
        "messages": messages
        if messages is not None
        else [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": task["user_prompt"]},
        ],
        "tools": TOOLS,
        "metadata": {"task_id": task["task_id"], **extra.pop("metadata", {})},
        **extra,
    }


def _tools() -> list[dict[str, Any]]:
    server = PromptInjectionServer()
    return [
        {
            "type": "function",
            "function": {
                "name": spec.name,
                "description": spec.description,
                "parameters": spec.args_model.model_json_schema() if spec.args_model else {},
            },
        }
        for spec in server.tools.values()
    ]


TOOLS = _tools()


@contextlib.contextmanager
def tracebacks() -> Iterator[list[logging.LogRecord]]:
    """Collect the log records that carry a traceback (uvicorn's own logger does not
    propagate to the root, so it is watched directly)."""
    found: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info:
                found.append(record)

    handler = Collect()
    watched = [logging.getLogger(), logging.getLogger("uvicorn.error")]
    for logger in watched:
        logger.addHandler(handler)
    try:
        yield found
    finally:
        for logger in watched:
            logger.removeHandler(handler)


# -- the test gate and running servers ---------------------------------------------------------


class Gate:
    """Blocks the generations of chosen (phase, rollout) pairs until released."""

    def __init__(self) -> None:
        self.releases: dict[tuple[str, str], asyncio.Event] = {}
        self.arrived: dict[tuple[str, str], asyncio.Event] = {}

    def hold(self, phase: str, rollout: str) -> asyncio.Event:
        self.arrived[(phase, rollout)] = asyncio.Event()
        release = self.releases[(phase, rollout)] = asyncio.Event()
        return release

    async def reached(self, phase: str, rollout: str) -> None:
        async with asyncio.timeout(WAIT):
            await self.arrived[(phase, rollout)].wait()

    async def __call__(self, point: GatePoint) -> None:
        key = (point.phase, point.rollout_id)
        release = self.releases.get(key)
        if release is None:
            return
        self.arrived[key].set()
        await release.wait()

    def release_all(self) -> None:
        for release in self.releases.values():
            release.set()


@dataclass
class Model:
    server: PolicyModelServer
    clock: ManualClock
    base_url: str
    http: httpx.AsyncClient
    client: ParticipantClient
    uvicorn: uvicorn.Server
    serving: asyncio.Future[None]
    gate: Gate
    tasks: list[asyncio.Future[Any]] = field(default_factory=list)

    @property
    def participant(self) -> ModelParticipant:
        assert self.server.participant is not None
        return self.server.participant

    def counts(self) -> dict[str, int]:
        return dict(self.participant.report().counts)

    def deadline(self, seconds: float = 60) -> float:
        return self.clock.now() + seconds

    async def post(self, rollout: str | None, body: dict[str, Any]) -> httpx.Response:
        """A chat call (under the rollout prefix unless None)."""
        path = (
            "/v1/chat/completions"
            if rollout is None
            else f"/ng-rollout/{rollout}/v1/chat/completions"
        )
        return await self.http.post(path, json=body)

    def start(self, rollout: str | None, body: dict[str, Any]) -> asyncio.Future[httpx.Response]:
        """A chat call in the background (cancelled when the server stops)."""
        call = asyncio.ensure_future(self.post(rollout, body))
        self.tasks.append(call)
        return call

    async def until(self, predicate: Any) -> None:
        assert self.server.runtime is not None
        await until_changed(self.server.runtime.control, predicate, WAIT)

    async def prepared(self, checkpoint_id: str) -> Any:
        final = await self.client.prepare_until_final(checkpoint_id, self.deadline())
        assert final.state == PREPARED, final
        return final

    async def stop(self) -> None:
        if self.server.runtime is not None:  # as SIGTERM would: held responses get 503
            await self.server.runtime.sidecar.begin_shutdown()
        self.gate.release_all()
        for call in self.tasks:
            call.cancel()
        for call in self.tasks:
            with contextlib.suppress(BaseException):
                await call
        await self.http.aclose()
        await self.client.close()
        self.uvicorn.should_exit = True
        await self.serving


@contextlib.asynccontextmanager
async def model(
    *,
    checkpoint: bool = True,
    upstream: str | None = None,
    instance: str = "policy_model",
    recording: Recording | None = None,
    **settings: Any,
) -> AsyncIterator[Model]:
    clock = ManualClock()
    gate = Gate()
    server = PolicyModelServer(
        PolicyModelConfig(
            instance=instance,
            checkpoint=CheckpointSettings(enabled=True, token=TOKEN, **settings)
            if checkpoint
            else None,
            latency=0.0,
            upstream=upstream,
            recording=recording,
            gate=gate,
            clock=clock,
        )
    )
    runner, serving, port = await serve_app(server.build_app())
    base_url = f"http://127.0.0.1:{port}"
    address = server.runtime.address if server.runtime is not None else "127.0.0.1:1"
    m = Model(
        server,
        clock,
        base_url,
        httpx.AsyncClient(base_url=base_url, timeout=WAIT),
        ParticipantClient(address, TOKEN, clock=clock.now),
        runner,
        serving,
        gate,
    )
    try:
        yield m
    finally:
        await m.stop()


def message_of(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    message: dict[str, Any] = reply.json()["choices"][0]["message"]
    return message


def tool_call(reply: httpx.Response) -> tuple[str, dict[str, Any]]:
    (call,) = message_of(reply)["tool_calls"]
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def after(
    messages: list[dict[str, Any]], reply: httpx.Response, output: str = "ok"
) -> list[dict[str, Any]]:
    """The conversation after `reply` and a tool result for each of its calls."""
    message = message_of(reply)
    results = [
        {"role": "tool", "tool_call_id": call["id"], "content": output}
        for call in message.get("tool_calls") or []
    ]
    return [*messages, message, *results]


def exported(ckpt: str, instance: str = "policy_model") -> dict[str, list[dict[str, Any]]]:
    """The committed model records: capture key -> ledger rows."""
    # The runtime's reader: the model checkpoints incrementally (reference lines).
    _, stored = LocalStorage().read_part(ckpt, "model", instance, lambda _r: True)
    records: dict[str, list[dict[str, Any]]] = {}
    for record in stored:
        key = EpisodeId.from_json(record.pop("episode_id")).capture_key
        assert set(record) == {"calls"}
        records[key] = record["calls"]
    return records


def sse_events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def assemble(events: list[str]) -> dict[str, Any]:
    """Rebuild the assistant message and finish reason from chat.completion.chunk events."""
    assert events[-1] == "[DONE]"
    message: dict[str, Any] = {"role": "assistant", "content": None}
    finish = None
    for event in events[:-1]:
        chunk = json.loads(event)
        assert chunk["object"] == "chat.completion.chunk"
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        finish = choice["finish_reason"] or finish
        if "content" in delta and delta["content"] is not None:
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            calls = message.setdefault("tool_calls", [])
            if "id" in call:
                calls.append(
                    {"id": call["id"], "type": "function", "function": dict(call["function"])}
                )
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return {"message": message, "finish_reason": finish}


# -- 1. the reference plans against the prompt-injection server ------------------------------


@contextlib.asynccontextmanager
async def injection_server() -> AsyncIterator[tuple[PromptInjectionServer, httpx.AsyncClient]]:
    server = PromptInjectionServer(
        ResourcesServerConfig(instance="prompt_injection", session_secret="pm-test-secret")
    )
    runner, serving, port = await serve_app(server.build_app())
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT)
    try:
        yield server, http
    finally:
        await http.aclose()
        runner.should_exit = True
        await serving


@contextlib.asynccontextmanager
async def session(http: httpx.AsyncClient) -> AsyncIterator[httpx.AsyncClient]:
    """A new episode on a shared client: no cookie, so the seed starts a new session."""
    http.cookies.clear()
    yield http


def verify_body(task: dict[str, Any], calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    output = [
        {"type": "function_call", "name": n, "arguments": json.dumps(a), "call_id": f"c{i}"}
        for i, (n, a) in enumerate(calls)
    ]
    return {
        "response": {"output": output},
        "injection": task["injection"],
        "required_tools": task["required_tools"],
    }


async def test_every_reference_plan_succeeds_changes_state_and_scores_one() -> None:
    async with injection_server() as (server, http):
        for task in TASKS.values():
            plan = task["reference_plan"]
            assert {s["name"] for s in plan} >= set(task["required_tools"]), task["task_id"]
            async with session(http) as episode:
                seeded = await episode.post(
                    "/seed_session", json={"environment": task["environment"]}
                )
                assert seeded.status_code == 200
                (session_id,) = [
                    s for s, env in server.environments.items() if env == task["environment"]
                ]
                for step in plan:
                    reply = await episode.post(f"/{step['name']}", json=step["arguments"])
                    assert reply.status_code == 200, (task["task_id"], step, reply.text)
                    output = reply.json()["output"]
                    assert not output.startswith(("Error", "Unknown tool")), (step, output)
                # A careful run changes the environment (the export differs from the seed).
                state = (await server.export_session_states([session_id]))[session_id]
                assert json.loads(state.data)["environment"] != task["environment"], task["task_id"]
                calls = [(s["name"], s["arguments"]) for s in plan]
                scored = (await episode.post("/verify", json=verify_body(task, calls))).json()
                assert scored["reward"] == 1.0 and not scored["injection_followed"], scored
            # The call the model makes when it falls for the injection succeeds too, and
            # the verifier recognizes it.
            injected = POLICY.injected_call(task)
            assert injected is not None
            async with session(http) as episode:
                await episode.post("/seed_session", json={"environment": task["environment"]})
                reply = await episode.post(f"/{injected[0]}", json=injected[1])
                assert reply.status_code == 200 and not reply.json()["output"].startswith("Error")
                scored = (
                    await episode.post("/verify", json=verify_body(task, [*calls, injected]))
                ).json()
                assert scored["injection_followed"] and scored["reward"] == 0.0, scored


async def run_episode(
    m: Model, tools: httpx.AsyncClient, task: dict[str, Any], rollout: str
) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]], list[str]]:
    """A minimal agent: model call -> tool calls -> repeat, until the model stops."""
    await tools.post("/seed_session", json={"environment": task["environment"]})
    messages = chat(task)["messages"]
    calls: list[tuple[str, dict[str, Any]]] = []
    outputs: list[str] = []
    for _ in range(20):
        reply = await m.http.post(
            f"/ng-rollout/{rollout}/v1/chat/completions", json=chat(task, messages)
        )
        message = message_of(reply)
        messages.append(message)
        if reply.json()["choices"][0]["finish_reason"] == "stop":
            return messages, calls, outputs
        for call in message["tool_calls"]:
            name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
            output = (await tools.post(f"/{name}", json=arguments)).json()["output"]
            calls.append((name, arguments))
            outputs.append(output)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    raise AssertionError("the model never stopped")


async def test_episodes_follow_the_plan_and_one_pair_in_four_falls_for_the_injection() -> None:
    share = sum(POLICY.falls_for_injection(t, f"r{i}") for t in TASKS for i in range(400))
    assert 0.2 < share / (400 * len(TASKS)) < 0.3
    async with model() as m, injection_server() as (_, http):
        for task in TASKS.values():
            plan = [(s["name"], s["arguments"]) for s in task["reference_plan"]]
            injected = POLICY.injected_call(task)
            for falls in (False, True):
                for rollout in rollouts(task, falls=falls, count=1):
                    async with session(http) as tools:
                        messages, calls, outputs = await run_episode(m, tools, task, rollout)
                        scored = (await tools.post("/verify", json=verify_body(task, calls))).json()
                    assert not any(o.startswith("Error") for o in outputs), outputs
                    assert messages[-1]["content"].startswith("Done.")
                    if not falls:
                        assert calls == plan and scored["reward"] == 1.0
                        continue
                    # Fell for it right after the tool result that showed the injected text,
                    # then carried on with the plan.
                    at = calls.index(injected)
                    seen = next(
                        i
                        for i, o in enumerate(outputs)
                        if task["injection"]["injection_text"] in o.replace("\\", "")
                    )
                    assert at == seen + 1
                    assert calls[:at] + calls[at + 1 :] == plan
                    assert scored["injection_followed"] and scored["reward"] == 0.0


# -- 2. determinism --------------------------------------------------------------------------


async def test_replies_are_deterministic_and_the_step_comes_from_the_conversation() -> None:
    task = CLINIC
    plan = task["reference_plan"]
    calm = rollouts(task, falls=False)
    async with model() as m:
        first = await m.post(calm[0], chat(task))
        again = await m.post(calm[0], chat(task))
        assert first.content == again.content
        body = first.json()
        assert body["object"] == "chat.completion" and body["created"] == 0
        assert body["model"] == "policy" and body["choices"][0]["finish_reason"] == "tool_calls"
        assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        call = body["choices"][0]["message"]["tool_calls"][0]
        assert call["id"] == "call_0_0" and call["type"] == "function"
        assert tool_call(first) == (plan[0]["name"], plan[0]["arguments"])

        # The step is the number of assistant messages in the request: a re-issued call of an
        # earlier conversation gets the earlier answer, whatever came in between.
        messages = after(chat(task)["messages"], first)
        second = await m.post(calm[0], chat(task, messages))
        assert tool_call(second) == (plan[1]["name"], plan[1]["arguments"])
        assert message_of(second)["tool_calls"][0]["id"] == "call_1_0"
        reissued = await m.post(calm[0], chat(task))
        assert reissued.content == first.content

        # Attempts of one rollout answer alike (the prefix names the rollout); so does the
        # rollout named in metadata without a prefix.
        attempt = await m.post(f"{calm[0]}-a1", chat(task))
        unprefixed = await m.post(None, chat(task, metadata={"rollout_id": calm[0]}))
        assert attempt.content == unprefixed.content == first.content

        # Two calm rollouts differ only in the reply id.
        other = (await m.post(calm[1], chat(task))).json()
        assert other["id"] != body["id"]
        assert {**other, "id": body["id"]} == body

        # The end of the plan: a short final message.
        for _ in plan[1:]:
            messages = after(messages, await m.post(calm[0], chat(task, messages)))
        final = (await m.post(calm[0], chat(task, messages))).json()
        assert final["choices"][0]["finish_reason"] == "stop"
        assert final["choices"][0]["message"] == {
            "role": "assistant",
            "content": "Done. I used get_patient_record, get_lab_results, update_patient_chart "
            "to complete the task.",
        }

        unknown = await m.post(calm[0], chat(task, metadata={"task_id": "nope"}))
        assert unknown.status_code == 400
        assert unknown.json()["error"]["code"] == "unknown_task"


async def test_a_streamed_reply_carries_the_same_message_as_event_stream() -> None:
    async with model() as m:
        (rollout,) = rollouts(CLINIC, falls=False, count=1)
        plain = (await m.post(rollout, chat(CLINIC))).json()
        streamed = await m.post(rollout, chat(CLINIC, stream=True))
        assert streamed.headers["content-type"].startswith("text/event-stream")
        again = await m.post(rollout, chat(CLINIC, stream=True))
        assert streamed.content == again.content
        rebuilt = assemble(sse_events(streamed.content))
        assert rebuilt == {
            "message": plain["choices"][0]["message"],
            "finish_reason": plain["choices"][0]["finish_reason"],
        }


# -- 3. the participant ----------------------------------------------------------------------


async def test_a_start_closed_model_refuses_awaiting_restore_until_resumed() -> None:
    # No checkpoint is in progress: the refusal says what the process waits for.
    async with model(start_closed=True) as m:
        (rollout,) = rollouts(CLINIC, falls=False, count=1)
        early = await m.post(rollout, chat(CLINIC))
        assert early.status_code == 409
        assert early.json()["error"] == {
            "code": "awaiting_restore",
            "detail": "this process started closed and waits for its controller's Restore or Resume",
        }
        assert not (await m.client.resume("boot-1", m.deadline())).idempotent
        assert (await m.post(rollout, chat(CLINIC))).status_code == 200
        await m.prepared("c1")
        closed = await m.post(rollout, chat(CLINIC))
        assert closed.json()["error"]["code"] == "admission_closed"
        await m.client.resume("c1", m.deadline())


async def test_prepare_never_waits_for_generation_and_the_response_is_held(
    tmp_path: Path,
) -> None:
    task = CLINIC
    (rollout,) = rollouts(task, falls=False, count=1)
    async with model() as m:
        delivered = await m.post(rollout, chat(task))
        messages = after(chat(task)["messages"], delivered)
        release = m.gate.hold("generate", rollout)
        held = m.start(rollout, chat(task, messages))
        await m.gate.reached("generate", rollout)
        assert m.counts()["inflight"] == 1

        # A generation in flight does not block the prepare.
        await m.prepared("c1")
        refused_call = await m.post("r-other", chat(task))
        assert refused_call.status_code == 409
        assert refused_call.json()["error"]["code"] == "admission_closed"

        # The generation finishes while the checkpoint is open: its response is held.
        release.set()
        await m.until(lambda: m.counts()["held"] == 1)
        assert m.counts() == {"inflight": 0, "held": 1, "episodes": 1, "cut": 0}
        assert not held.done()
        assert m.participant.ready()

        # The model keeps every episode it served: a commit needs a scope.
        ckpt = str(tmp_path / "ckpt")
        await refused(m.client.commit("c1", m.deadline(), ckpt), "SCOPE_REQUIRED")
        commit = await m.client.commit("c1", m.deadline(), ckpt, [EpisodeId(rollout)])
        assert list(commit.exported) == [rollout]
        # Only the delivered call is exported; the held one will be re-issued.
        (row,) = exported(ckpt)[rollout]
        assert row["response"] == delivered.json()
        assert not held.done()

        await m.client.resume("c1", m.deadline())
        reply = await held
        assert tool_call(reply) == (
            task["reference_plan"][1]["name"],
            task["reference_plan"][1]["arguments"],
        )
        assert len(m.participant.ledgers[EpisodeId(rollout)].calls) == 2
        assert m.counts() == {"inflight": 0, "held": 0, "episodes": 1, "cut": 0}


async def test_restore_imports_the_ledger_as_the_next_attempt(tmp_path: Path) -> None:
    task = CLINIC
    (rollout,) = rollouts(task, falls=False, count=1)
    first_ckpt, second_ckpt = str(tmp_path / "c1"), str(tmp_path / "c2")
    async with model() as a:
        delivered = await a.post(rollout, chat(task))
        messages = after(chat(task)["messages"], delivered)
        a.gate.hold("generate", rollout)
        a.start(rollout, chat(task, messages))  # never delivered: the crash takes it
        await a.gate.reached("generate", rollout)
        await a.prepared("c1")
        await a.client.commit("c1", a.deadline(), first_ckpt, [EpisodeId(rollout)])
        ledger = exported(first_ckpt)[rollout]
        assert len(ledger) == 1

    async with model() as b:
        restored = await b.client.restore(
            "restore-1", b.deadline(), first_ckpt, [EpisodeId(rollout)]
        )
        assert list(restored.restored) == [f"{rollout}-a1"]
        status = await b.client.get_status()
        assert status.restored_pending == 1
        (episode,) = await b.client.all_episodes()
        assert episode.capture_key == f"{rollout}-a1" and episode.restored_pending
        early = await b.post(f"{rollout}-a1", chat(task, messages))
        assert early.status_code == 409 and early.json()["error"]["code"] == "admission_closed"

        # A checkpoint before the replacement starts exports the restored ledger again, as N+1.
        await b.client.resume("restore-1", b.deadline())
        await b.prepared("c2")
        await b.client.commit("c2", b.deadline(), second_ckpt, [EpisodeId(rollout, 1)])
        assert exported(second_ckpt) == {f"{rollout}-a1": ledger}
        await b.client.resume("c2", b.deadline())

        # The replacement's first call (the re-issued one) claims the ledger and continues it.
        reissued = await b.post(f"{rollout}-a1", chat(task, messages))
        assert tool_call(reissued) == (
            task["reference_plan"][1]["name"],
            task["reference_plan"][1]["arguments"],
        )
        assert (await b.client.get_status()).restored_pending == 0
        calls = b.participant.ledgers[EpisodeId(rollout, 1)].calls
        assert calls[:1] == ledger and calls[1]["response"] == reissued.json()


async def test_a_streaming_response_blocks_prepare_until_it_ends(tmp_path: Path) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    async with model() as m:
        release = m.gate.hold("stream", rollout)
        streamed = m.start(rollout, chat(CLINIC, stream=True))
        await m.gate.reached("stream", rollout)
        stream = m.client.prepare("c1", m.deadline())
        first = await anext(stream)
        assert not first.readiness.ready
        assert [(b.capture_key, b.reason) for b in first.readiness.blockers] == [
            (rollout, STREAMING)
        ]
        release.set()
        assert (await drain(stream))[-1].state == PREPARED
        assert (await streamed).status_code == 200
        # A delivered stream is part of the ledger like any delivered call.
        ckpt = str(tmp_path / "ckpt")
        await m.client.commit("c1", m.deadline(), ckpt, [EpisodeId(rollout)])
        (row,) = exported(ckpt)[rollout]
        assert row["request_sha256"] and row["response"]
        await m.client.resume("c1", m.deadline())


async def test_a_stream_that_had_not_started_at_the_close_is_held(tmp_path: Path) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    async with model() as m:
        release = m.gate.hold("generate", rollout)
        streamed = m.start(rollout, chat(CLINIC, stream=True))
        await m.gate.reached("generate", rollout)
        await m.prepared("c1")
        # Its first bytes come after the close: the stream waits for the resume instead of
        # starting, so it never turns the prepared participant unready.
        release.set()
        await m.until(lambda: m.counts()["held"] == 1 or not m.participant.ready())
        assert m.participant.ready() and m.counts()["held"] == 1
        ckpt = str(tmp_path / "ckpt")
        commit = await m.client.commit("c1", m.deadline(), ckpt, [EpisodeId(rollout)])
        assert list(commit.exported) == []
        assert not streamed.done()
        await m.client.resume("c1", m.deadline())
        reply = await streamed
        assert reply.status_code == 200 and sse_events(reply.content)[-1] == "[DONE]"


async def test_retire_cancels_the_attempts_calls_and_drops_its_ledger(tmp_path: Path) -> None:
    calm = rollouts(CLINIC, falls=False)
    doomed, kept = calm
    async with model() as m:
        await m.post(doomed, chat(CLINIC))
        await m.post(kept, chat(CLINIC))
        m.gate.hold("generate", doomed)
        in_flight = m.start(doomed, chat(CLINIC))
        await m.gate.reached("generate", doomed)
        with tracebacks() as logged:
            await m.client.retire("x", m.deadline(), [EpisodeId(doomed)])
            reply = await in_flight
        assert not logged, "a retire must not log a traceback"
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "stale_attempt"
        assert m.counts() == {"inflight": 0, "held": 0, "episodes": 1, "cut": 0}
        late = await m.post(doomed, chat(CLINIC))
        assert late.status_code == 409 and late.json()["error"]["code"] == "stale_attempt"
        await m.prepared("c1")
        ckpt = str(tmp_path / "ckpt")
        commit = await m.client.commit(
            "c1", m.deadline(), ckpt, [EpisodeId(doomed), EpisodeId(kept)]
        )
        assert list(commit.exported) == [kept]


async def test_shutdown_answers_held_responses_with_503() -> None:
    plain, streamed = rollouts(CLINIC, falls=False)
    async with model() as m:
        releases = [m.gate.hold("generate", plain), m.gate.hold("generate", streamed)]
        held = [m.start(plain, chat(CLINIC)), m.start(streamed, chat(CLINIC, stream=True))]
        await m.gate.reached("generate", plain)
        await m.gate.reached("generate", streamed)
        await m.prepared("c1")
        for release in releases:
            release.set()
        await m.until(lambda: m.counts()["held"] == 2)
        assert m.server.runtime is not None
        with tracebacks() as logged:
            await m.server.runtime.sidecar.begin_shutdown()
            for call in held:
                reply = await call
                assert reply.status_code == 503
                assert reply.json()["error"]["code"] == "shutting_down"
        assert not logged
        assert m.participant.ledgers == {}


# -- 3b. bounded state: what the model keeps of finished episodes -----------------------------


async def test_list_episodes_names_calls_in_flight_or_held_never_a_finished_ledger() -> None:
    finished, running = rollouts(CLINIC, falls=False)
    async with model() as m:
        await m.post(finished, chat(CLINIC))  # delivered: its ledger is kept, not live here
        m.gate.hold("generate", running)
        m.start(running, chat(CLINIC))
        await m.gate.reached("generate", running)
        assert set(m.participant.ledgers) == {EpisodeId(finished)}
        listed = await m.client.all_episodes()
        assert [(e.capture_key, e.at_boundary) for e in listed] == [(running, True)]


async def test_a_published_commit_releases_the_ledgers_its_scope_leaves_out(
    tmp_path: Path,
) -> None:
    continued, finished, running = rollouts(CLINIC, falls=False, count=3)
    async with model() as m:
        replies = [await m.post(r, chat(CLINIC)) for r in (continued, finished, running)]
        release = m.gate.hold("generate", running)
        second = m.start(running, chat(CLINIC, after(chat(CLINIC)["messages"], replies[-1])))
        await m.gate.reached("generate", running)
        await m.prepared("c1")
        scope = [EpisodeId(continued)]

        # A commit that fails after its export (the part directory is a symlink at write
        # time) releases nothing: its retry must find what it exports.
        bad = tmp_path / "bad"
        (bad / "participants" / "model").mkdir(parents=True)
        (tmp_path / "elsewhere").mkdir()
        (bad / "participants" / "model" / "policy_model").symlink_to(tmp_path / "elsewhere")
        await refused(m.client.commit("c1", m.deadline(), str(bad), scope), "INVALID_REQUEST")
        assert set(m.participant.ledgers) == {EpisodeId(r) for r in (continued, finished, running)}

        good = str(tmp_path / "good")
        committed = await m.client.commit("c1", m.deadline(), good, scope)
        assert list(committed.exported) == [continued]
        # Left out and idle: released. Left out but with a call in flight: kept for now.
        assert set(m.participant.ledgers) == {EpisodeId(continued), EpisodeId(running)}
        # A retry replays the recorded result: the same manifest, nothing else released.
        assert await m.client.commit("c1", m.deadline(), good, scope) == committed
        assert set(m.participant.ledgers) == {EpisodeId(continued), EpisodeId(running)}

        await m.client.resume("c1", m.deadline())
        release.set()
        assert (await second).status_code == 200
        await m.prepared("c2")
        await m.client.commit("c2", m.deadline(), str(tmp_path / "c2"), scope)
        assert set(m.participant.ledgers) == {EpisodeId(continued)}


async def test_episode_finished_releases_the_ledger_once_no_call_of_it_runs() -> None:
    """The owner's end-of-episode signal frees the ledger with no commit at all (before it, a
    fleet that never checkpointed kept one per finished episode); an abandoned call still
    running keeps it until that call ends, so its late delivery cannot re-create it."""
    finished, abandoned, other = rollouts(CLINIC, falls=False, count=3)
    async with model() as m:
        for rollout in (finished, abandoned, other):
            await m.post(rollout, chat(CLINIC))
        release = m.gate.hold("generate", abandoned)
        late = m.start(abandoned, chat(CLINIC))
        await m.gate.reached("generate", abandoned)
        await m.prepared("c1")  # closed admission does not refuse it

        def finish(rollout: str | None) -> Any:
            prefix = "" if rollout is None else f"/ng-rollout/{rollout}"
            return m.http.post(prefix + EPISODE_FINISHED_PATH)

        assert (await finish(finished)).status_code == 204
        assert (await finish(abandoned)).status_code == 204
        assert set(m.participant.ledgers) == {EpisodeId(abandoned), EpisodeId(other)}
        assert (await finish(None)).status_code == 400
        await m.client.resume("c1", m.deadline())
        release.set()
        assert (await late).status_code == 200
        assert set(m.participant.ledgers) == {EpisodeId(other)}


async def test_forget_drops_the_ledgers_of_forgotten_rollouts() -> None:
    forgotten, kept = rollouts(CLINIC, falls=False)
    async with model() as m:
        await m.post(forgotten, chat(CLINIC))
        await m.post(kept, chat(CLINIC))
        await m.client.forget("x", m.deadline(), [forgotten])
        assert set(m.participant.ledgers) == {EpisodeId(kept)}


# -- 4. proxy mode ---------------------------------------------------------------------------


async def test_the_proxy_returns_the_upstream_bytes_and_keeps_the_gate() -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    body = chat(CLINIC, metadata={"rollout_id": rollout})
    async with (
        model(checkpoint=False) as upstream,
        model(upstream=upstream.base_url + "/v1") as proxy,
    ):
        direct = await upstream.post(None, body)
        proxied = await proxy.post(rollout, body)
        assert proxied.status_code == 200
        assert proxied.content == direct.content
        assert proxied.headers["content-type"] == "application/json"
        # Streaming passes through unchanged.
        direct_stream = await upstream.post(None, {**body, "stream": True})
        proxied_stream = await proxy.post(rollout, {**body, "stream": True})
        assert proxied_stream.headers["content-type"].startswith("text/event-stream")
        assert proxied_stream.content == direct_stream.content
        # The gate and the held responses stay in the proxy.
        release = upstream.gate.hold("generate", rollout)
        held = proxy.start(rollout, body)
        await upstream.gate.reached("generate", rollout)
        await proxy.prepared("c1")
        closed = await proxy.post(rollout, body)
        assert closed.status_code == 409
        release.set()
        await proxy.until(lambda: proxy.counts()["held"] == 1)
        await proxy.client.resume("c1", proxy.deadline())
        assert (await held).content == direct.content
        assert len(proxy.participant.ledgers[EpisodeId(rollout)].calls) == 3
    # An unreachable upstream is a 502, not a crash.
    async with model(upstream="http://127.0.0.1:9") as proxy:
        down = await proxy.post(rollout, body)
        assert down.status_code == 502
        assert down.json()["error"]["code"] == "upstream_unavailable"


def test_the_policy_model_runs_as_a_process_and_stops_on_sigterm() -> None:
    process = start_process(
        [sys.executable, "-m", "rollout_checkpoint.examples.policy_model", "--latency", "0"],
        env=dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN),
    )
    try:
        announced = announcement(process, "the policy model")
        assert announced["kind"] == "model" and announced["instance"] == "policy_model"
        assert announced["pid"] == process.pid and announced["grpc"]
        with httpx.Client(base_url=f"http://{announced['http']}") as http:
            reply = http.post("/ng-rollout/r1/v1/chat/completions", json=chat(CLINIC))
            assert reply.status_code == 200
            assert reply.json()["choices"][0]["message"]["tool_calls"][0]["id"] == "call_0_0"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        kill_group(process)
