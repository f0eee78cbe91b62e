"""A callee's failure is passed on as a failure by every example server that calls another.

Each test runs the caller for real (uvicorn on 127.0.0.1:0) in front of a real callee that is
made to fail: a resources server process SIGKILLed mid-rollout, a closed port, a server that
answers 500 or 409, one that never answers. The caller must answer the failure's status (the
callee's 4xx/5xx, 502 for an unreachable callee, 504 for one that did not answer in time) with
the usual typed body `{"error": {"code", "detail"}}`, never a 200 around an error: a trainer
reading the status code would count the failed rollout as finished. `collect`'s dispatcher,
in front of the real environment, must then count the rollout failed, not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollout_checkpoint.client.collect.dispatch import Dispatcher
from rollout_checkpoint.client.collect.inputs import TaskRow
from rollout_checkpoint.client.collect.journal import DurableAppender
from rollout_checkpoint.client.collect.rollouts import RolloutBook, Status
from rollout_checkpoint.client.collect.view import Counts
from rollout_checkpoint.examples.agent import AgentConfig, AgentServer
from rollout_checkpoint.examples.environment import EnvironmentConfig, EnvironmentServer
from rollout_checkpoint.examples.policy_model import PolicyModelConfig, PolicyModelServer
from rollout_checkpoint.examples.prompt_injection import PromptInjectionServer, load_tasks
from rollout_checkpoint.server.episodic.episode_participant import task_digest
from rollout_checkpoint.server.resources import ResourcesServerConfig
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .conftest import TOKEN, serve_app
from .processes import kill_group, started

SETTINGS = CheckpointSettings(enabled=True, token=TOKEN)
SERVE = [sys.executable, "-m", "rollout_checkpoint.examples.serve"]
TASK = load_tasks()[0]
WAIT = 120.0
"""Bound on a reply the test waits for (the machine is loaded); nothing waits for it to pass."""
SHORT_TIMEOUT = 1.0
"""A caller's timeout for a callee that never answers (it never does: no race with load)."""
LIFECYCLE = ("seed_session", "tools", "verify")


@dataclass(frozen=True)
class Answer:
    """What a failing callee answers: a status with a JSON body (a dict) or a plain-text
    one (a str); `hang`: no answer at all, until the test ends."""

    status: int = 200
    body: Any = None
    hang: bool = False


class FailingCallee:
    """A real HTTP server standing in for a callee: each request's last path segment picks
    its answer (`answers`, else `otherwise`)."""

    def __init__(self, answers: Mapping[str, Answer], otherwise: Answer) -> None:
        self.answers = dict(answers)
        self.otherwise = otherwise
        self.ended = asyncio.Event()

    def build_app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._answer, methods=["GET", "POST"])])

    async def _answer(self, request: Request) -> Response:
        answer = self.answers.get(request.url.path.rsplit("/", 1)[-1], self.otherwise)
        if answer.hang:
            await self.ended.wait()
        if isinstance(answer.body, str):
            return PlainTextResponse(answer.body, status_code=answer.status)
        return JSONResponse(answer.body, status_code=answer.status)


@contextlib.asynccontextmanager
async def serving(server: Any) -> AsyncIterator[str]:
    """`server` (an example server, or a `FailingCallee`) on 127.0.0.1:0: its base URL."""
    runner, served, port = await serve_app(server.build_app())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if isinstance(server, FailingCallee):
            server.ended.set()
        elif server.runtime is not None:
            await server.runtime.sidecar.begin_shutdown()  # releases held requests
        runner.should_exit = True
        await served


def closed_port() -> str:
    """A loopback address nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def resources_answering(failing: str, answer: Answer) -> FailingCallee:
    """A resources server whose `failing` route (a lifecycle route, or `tool`: every tool)
    answers `answer`; everything else works."""
    working = {
        "seed_session": Answer(200, {}),
        "tools": Answer(200, {"tools": []}),
        "verify": Answer(200, {"reward": 1.0}),
    }
    if failing == "tool":
        return FailingCallee(working, answer)
    return FailingCallee({**working, failing: answer}, Answer(200, {"output": "done"}))


def agent_config(model_url: str, resources_url: str, **settings: Any) -> AgentConfig:
    return AgentConfig(
        model_url=model_url,
        servers={"prompt_injection": resources_url},
        checkpoint=SETTINGS,
        **settings,
    )


def scripted_model(**settings: Any) -> PolicyModelServer:
    return PolicyModelServer(PolicyModelConfig(checkpoint=SETTINGS, latency=0.0, **settings))


async def run(url: str, rollout: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=WAIT) as client:
        return await client.post(f"{url}/ng-rollout/{rollout}/run", json=body)


def error_of(reply: httpx.Response) -> dict[str, Any]:
    """The typed error of a failure reply (asserting it is one)."""
    assert reply.headers["content-type"] == "application/json", reply.text
    error = reply.json()["error"]
    assert isinstance(error, dict) and set(error) == {"code", "detail"}, reply.text
    assert isinstance(error["code"], str) and isinstance(error["detail"], str), reply.text
    return error


def assert_attributed(reply: httpx.Response) -> None:
    """The environment's failure names the environment and the task it ran."""
    body = reply.json()
    assert body["environment"] == "environment" and body["task_digest"] == task_digest(TASK)


# -- the environment in front of its agent ----------------------------------------------------


async def test_a_resources_server_sigkilled_mid_rollout_fails_the_run_with_502_all_the_way(
    tmp_path: Path,
) -> None:
    """The reported case: the agent's tool call finds its resources server gone (502), and
    the environment passes that on as a 502, not a 200 wrapping it."""
    log = tmp_path / "prompt_injection.log"
    resources, announced = started(
        [*SERVE, "prompt_injection", f"--token={TOKEN}"], "the resources server", log=log
    )
    reached, release = asyncio.Event(), asyncio.Event()

    async def gate(point: Any) -> None:
        reached.set()  # the episode is seeded and waits for its first model reply
        await release.wait()

    try:
        async with (
            serving(scripted_model(gate=gate)) as model_url,
            serving(AgentServer(agent_config(model_url, f"http://{announced['http']}"))) as agent,
            serving(
                EnvironmentServer(EnvironmentConfig(agent_url=agent, checkpoint=SETTINGS))
            ) as env,
        ):
            reply = asyncio.ensure_future(run(env, "r1", {"task": TASK}))
            await asyncio.wait_for(reached.wait(), WAIT)
            kill_group(resources)
            release.set()
            failed = await reply
    finally:
        kill_group(resources)
    assert failed.status_code == 502, failed.text
    assert error_of(failed)["code"] == "upstream_unreachable"
    assert_attributed(failed)


@pytest.mark.parametrize(
    ("answer", "code"),
    [
        (Answer(500, "Internal Server Error"), "upstream_failed"),
        (Answer(503, {"error": {"code": "shutting_down", "detail": "stopping"}}), "shutting_down"),
        (
            Answer(409, {"error": {"code": "task_mismatch", "detail": "other task"}}),
            "task_mismatch",
        ),
        (Answer(200, "not json"), "upstream_failed"),
    ],
)
async def test_the_environment_passes_on_its_agents_failure_with_its_status(
    answer: Answer, code: str
) -> None:
    """The agent's status and typed error (an untyped failure becomes `upstream_failed`; a
    200 that is not a result is the agent failing, 502)."""
    async with (
        serving(FailingCallee({}, answer)) as agent,
        serving(EnvironmentServer(EnvironmentConfig(agent_url=agent, checkpoint=SETTINGS))) as env,
    ):
        failed = await run(env, "r1", {"task": TASK})
    assert failed.status_code == (answer.status if answer.status >= 400 else 502), failed.text
    assert error_of(failed)["code"] == code
    assert_attributed(failed)


async def test_the_environment_answers_504_for_an_agent_that_does_not_answer_in_time() -> None:
    config = dict(agent_timeout=SHORT_TIMEOUT, unreachable_seconds=SHORT_TIMEOUT)
    async with (
        serving(FailingCallee({}, Answer(hang=True))) as agent,
        serving(
            EnvironmentServer(EnvironmentConfig(agent_url=agent, checkpoint=SETTINGS, **config))
        ) as env,
    ):
        failed = await run(env, "r1", {"task": TASK})
    assert failed.status_code == 504, failed.text
    assert error_of(failed)["code"] == "upstream_timeout"
    assert_attributed(failed)


async def test_the_environment_answers_502_for_an_agent_that_cannot_be_reached() -> None:
    config = EnvironmentConfig(
        agent_url=closed_port(), checkpoint=SETTINGS, unreachable_seconds=SHORT_TIMEOUT
    )
    async with serving(EnvironmentServer(config)) as env:
        failed = await run(env, "r1", {"task": TASK})
    assert failed.status_code == 502, failed.text
    assert error_of(failed)["code"] == "upstream_unreachable"
    assert_attributed(failed)


# -- the agent in front of its model and resources server -------------------------------------


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        (Answer(500, "Internal Server Error"), 500),
        (Answer(429, {"error": {"code": "rate_limited", "detail": "slow down"}}), 429),
        (Answer(200, {"choices": []}), 502),
    ],
)
async def test_the_agent_passes_on_its_models_failure_with_its_status(
    answer: Answer, status: int
) -> None:
    resources = PromptInjectionServer(
        ResourcesServerConfig(instance="prompt_injection", checkpoint=SETTINGS)
    )
    async with (
        serving(resources) as resources_url,
        serving(FailingCallee({}, answer)) as model_url,
        serving(AgentServer(agent_config(model_url, resources_url))) as agent,
    ):
        failed = await run(agent, "r1", {"task": TASK})
    assert failed.status_code == status, failed.text
    assert error_of(failed)["code"] == "upstream_failed"


async def test_the_agent_answers_504_for_a_model_that_does_not_answer_in_time() -> None:
    resources = PromptInjectionServer(
        ResourcesServerConfig(instance="prompt_injection", checkpoint=SETTINGS)
    )
    config = dict(call_timeout=SHORT_TIMEOUT, unreachable_seconds=SHORT_TIMEOUT)
    async with (
        serving(resources) as resources_url,
        serving(FailingCallee({}, Answer(hang=True))) as model_url,
        serving(AgentServer(agent_config(model_url, resources_url, **config))) as agent,
    ):
        failed = await run(agent, "r1", {"task": TASK})
    assert failed.status_code == 504, failed.text
    assert error_of(failed)["code"] == "upstream_timeout"


@pytest.mark.parametrize(
    ("failing", "answer"),
    [
        ("seed_session", Answer(503, "Service Unavailable")),
        ("tools", Answer(500, "Internal Server Error")),
        ("tool", Answer(500, {"error": {"code": "crashed", "detail": "boom"}})),
        ("tool", Answer(409, {"error": {"code": "awaiting_restore", "detail": "closed"}})),
        ("tool", Answer(400, {"error": {"code": "no_session", "detail": "seed first"}})),
        ("verify", Answer(409, {"error": {"code": "episode_mismatch", "detail": "other"}})),
    ],
)
async def test_the_agent_passes_on_its_resources_servers_failure_with_its_status(
    failing: str, answer: Answer
) -> None:
    """A tool's refusal, server failure or lost session too: handed to the model as the
    tool's output, it would end in a 200 whose trajectory looks finished."""
    async with (
        serving(scripted_model()) as model_url,
        serving(resources_answering(failing, answer)) as resources_url,
        serving(AgentServer(agent_config(model_url, resources_url))) as agent,
    ):
        failed = await run(agent, "r1", {"task": TASK})
    assert failed.status_code == answer.status, failed.text
    assert error_of(failed)["code"] == "upstream_failed"


async def test_a_tools_complaint_about_its_arguments_goes_back_to_the_model() -> None:
    """A 4xx that is the model's own mistake (arguments that do not validate) is the tool's
    output, as before: the run goes on and finishes."""
    invalid = Answer(422, {"error": {"code": "invalid_arguments", "detail": "bad"}})
    async with (
        serving(scripted_model()) as model_url,
        serving(resources_answering("tool", invalid)) as resources_url,
        serving(AgentServer(agent_config(model_url, resources_url))) as agent,
    ):
        finished = await run(agent, "r1", {"task": TASK})
    assert finished.status_code == 200, finished.text
    outputs = [m["content"] for m in finished.json()["messages"] if m["role"] == "tool"]
    assert outputs and all("invalid_arguments" in output for output in outputs)


@pytest.mark.parametrize("body", [["a", "list"], "plain text", 42], ids=["list", "text", "number"])
async def test_a_tools_reply_of_any_shape_goes_back_to_the_model(body: Any) -> None:
    """A tool's 200 that is not a JSON object (a list, text, a number) is its output as it
    came: the run finishes, no 500 with a traceback over the reply's shape."""
    async with (
        serving(scripted_model()) as model_url,
        serving(resources_answering("tool", Answer(200, body))) as resources_url,
        serving(AgentServer(agent_config(model_url, resources_url))) as agent,
    ):
        finished = await run(agent, "r1", {"task": TASK})
    assert finished.status_code == 200, finished.text
    outputs = [m["content"] for m in finished.json()["messages"] if m["role"] == "tool"]
    expected = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    assert outputs and all(output == expected for output in outputs)


# -- the policy model's proxy in front of its upstream ----------------------------------------


def proxy(upstream: str, continuation: str) -> PolicyModelServer:
    return PolicyModelServer(
        PolicyModelConfig(
            checkpoint=SETTINGS,
            upstream=upstream,
            upstream_continuation=continuation,
            upstream_timeout=SHORT_TIMEOUT,
        )
    )


CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("continuation", ["none", "vllm"])
@pytest.mark.parametrize(
    ("answer", "status", "code"),
    [
        (Answer(500, "<html>Internal Server Error</html>"), 500, "upstream_failed"),
        (Answer(hang=True), 504, "upstream_timeout"),
    ],
)
async def test_the_proxy_answers_an_upstream_failure_with_its_status_and_a_typed_error(
    continuation: str, answer: Answer, status: int, code: str
) -> None:
    async with (
        serving(FailingCallee({}, answer)) as upstream,
        serving(proxy(upstream, continuation)) as model_url,
        httpx.AsyncClient(timeout=WAIT) as client,
    ):
        failed = await client.post(f"{model_url}/ng-rollout/r1/v1/chat/completions", json=CHAT)
    assert failed.status_code == status, failed.text
    assert error_of(failed)["code"] == code


# -- collect in front of the environment ------------------------------------------------------


async def test_collect_counts_a_run_that_answered_502_as_failed_not_finished(
    tmp_path: Path,
) -> None:
    """The environment in front of an agent whose resources server cannot be reached: the
    dispatcher gets a 502 and retires the attempt for a retry; nothing goes to the output."""
    book = RolloutBook([TaskRow(0, "t", TASK)], 1, Counts())
    book.queue_pending()
    changed = asyncio.Event()
    fatal: list[BaseException] = []
    output = DurableAppender(tmp_path / "rollouts.jsonl")
    dispatch_log = DurableAppender(tmp_path / "dispatched.jsonl")
    await output.open()
    await dispatch_log.open()
    async with (
        serving(scripted_model()) as model_url,
        serving(AgentServer(agent_config(model_url, closed_port()))) as agent,
        serving(EnvironmentServer(EnvironmentConfig(agent_url=agent, checkpoint=SETTINGS))) as env,
        httpx.AsyncClient(timeout=WAIT) as http,
    ):
        dispatcher = Dispatcher(
            book,
            output,
            dispatch_log,
            http,
            entry_url=env,
            concurrency=1,
            on_change=changed.set,
            on_fatal=fatal.append,
        )
        dispatching = asyncio.ensure_future(dispatcher.run())
        try:
            while not book.retire_queue and not fatal:
                changed.clear()
                await asyncio.wait_for(changed.wait(), WAIT)
        finally:
            dispatching.cancel()
            await asyncio.gather(dispatching, return_exceptions=True)
    await output.close()
    await dispatch_log.close()
    assert not fatal
    (rollout,) = book.rollouts.values()
    assert rollout.status is Status.RETIRING and rollout.failures == 1
    assert rollout.last_error is not None and rollout.last_error.startswith("HTTP 502:")
    assert "upstream_unreachable" in rollout.last_error
    assert book.counts.done == 0 and (tmp_path / "rollouts.jsonl").read_bytes() == b""
