"""Episodes across a whole in-process fleet: environment -> agent -> policy model + resources.

Every server is real (uvicorn on 127.0.0.1:0, its own gRPC sidecar); the controller drives
them with the coordination library, as a trainer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.examples import agent as agent_module
from rollout_checkpoint.examples import environment as environment_module
from rollout_checkpoint.examples.agent import AgentConfig, AgentServer
from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.examples.environment import EnvironmentConfig, EnvironmentServer
from rollout_checkpoint.examples.policy_model import PolicyModelConfig, PolicyModelServer
from rollout_checkpoint.examples.prompt_injection import PromptInjectionServer, load_tasks
from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.resources import ResourcesServer, ResourcesServerConfig, VerifyMode
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .clocks import ObservedClock
from .conftest import TOKEN, serve_app, until_changed

SETTINGS = CheckpointSettings(enabled=True, token=TOKEN)


@dataclass
class InProcessFleet:
    urls: dict[str, str]
    servers: dict[str, Any]
    fleet: Fleet
    stops: list[Any] = field(default_factory=list)

    async def run(self, rollout: str, task: dict[str, Any]) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.post(
                f"{self.urls['environment']}/ng-rollout/{rollout}/run", json={"task": task}
            )
            assert response.status_code == 200, response.text
            reply: dict[str, Any] = response.json()
            return reply


@contextlib.asynccontextmanager
async def in_process_fleet(
    resources: ResourcesServer | None = None,
    model_gate: Any = None,
    model_tasks: Any = None,
    clock: Clock | None = None,
) -> AsyncIterator[InProcessFleet]:
    """The fleet; with `clock`, every member's control plane runs on it (the agent and the
    environment take no clock setting: theirs is passed to install_checkpointing here)."""
    on_clock = contextlib.ExitStack()
    if clock is not None:
        for module in (agent_module, environment_module):
            on_clock.enter_context(
                mock.patch.object(
                    module,
                    "install_checkpointing",
                    functools.partial(module.install_checkpointing, clock=clock),
                )
            )
    servers: dict[str, Any] = {}
    urls: dict[str, str] = {}
    running: list[tuple[Any, Any]] = []

    async def start(name: str, server: Any) -> None:
        runner, serving, port = await serve_app(server.build_app())
        running.append((runner, serving))
        servers[name] = server
        urls[name] = f"http://127.0.0.1:{port}"

    try:
        await start(
            "prompt_injection",
            resources
            or PromptInjectionServer(
                ResourcesServerConfig(instance="prompt_injection", checkpoint=SETTINGS)
            ),
        )
        await start(
            "policy_model",
            PolicyModelServer(
                PolicyModelConfig(
                    checkpoint=SETTINGS,
                    latency=0.01,
                    gate=model_gate,
                    tasks=model_tasks,
                    clock=clock,
                )
            ),
        )
        await start(
            "agent",
            AgentServer(
                AgentConfig(
                    model_url=urls["policy_model"],
                    servers={"prompt_injection": urls["prompt_injection"]},
                    checkpoint=SETTINGS,
                )
            ),
        )
        await start(
            "environment",
            EnvironmentServer(EnvironmentConfig(agent_url=urls["agent"], checkpoint=SETTINGS)),
        )
        on_clock.close()
        spec = FleetSpec(
            members=tuple(MemberSpec(n, s.runtime.address) for n, s in servers.items()), token=TOKEN
        )
        async with await Fleet.discover(spec) as fleet:
            yield InProcessFleet(urls, servers, fleet)
    finally:
        on_clock.close()
        for server in servers.values():
            if server.runtime is not None:
                await server.runtime.sidecar.begin_shutdown()  # releases held and waiting requests
        for runner, serving in reversed(running):
            runner.should_exit = True
            await serving


def deadline(seconds: float = 30) -> float:
    return time.time() + seconds


async def test_a_checkpoint_without_a_crash_parks_and_releases_everything(tmp_path: Any) -> None:
    tasks = load_tasks()
    rollouts = {f"q{i}": tasks[i % len(tasks)] for i in range(6)}
    async with in_process_fleet() as baseline_fleet:
        baseline = dict(
            zip(
                rollouts,
                await asyncio.gather(*(baseline_fleet.run(r, t) for r, t in rollouts.items())),
                strict=True,
            )
        )

    hold = asyncio.Event()
    held_once = asyncio.Event()

    async def gate(point: Any) -> None:
        # The first generation waits until the checkpoint is prepared: its response is then
        # completed while the model is closed and must be held, not lost and not repeated.
        if not held_once.is_set():
            held_once.set()
            await hold.wait()

    async with in_process_fleet(model_gate=gate) as f:
        runs = {r: asyncio.ensure_future(f.run(r, t)) for r, t in rollouts.items()}
        await held_once.wait()
        progress = await fanout.prepare_until_done(f.fleet, "c1", deadline())
        assert progress.prepared
        hold.set()
        model = f.servers["policy_model"].participant
        await until_changed(
            f.servers["policy_model"].runtime.control, lambda: any(c.held for c in model.calls)
        )
        status = await f.fleet.member("policy_model").client.get_status()
        assert (
            status.readiness.counts["held"] >= 1
            and status.state == types_pb2.PARTICIPANT_STATE_PREPARED
        )
        in_flight = [EpisodeId(r) for r in rollouts]
        committed = await fanout.commit(f.fleet, "c1", deadline(), str(tmp_path / "c1"), in_flight)
        assert committed.members["agent"].exported  # episodes parked at their boundaries
        # The agent tells the model when each episode finished, and its ledger goes: read
        # each ledger as it is released.
        released: dict[str, int] = {}
        release = model.episode_finished

        def finished(episode: EpisodeId) -> None:
            released[episode.rollout_id] = len(model.ledgers[episode].calls)
            release(episode)

        with mock.patch.object(model, "episode_finished", finished):
            await fanout.resume(f.fleet, "c1", deadline())
            results = {r: await run for r, run in runs.items()}
            control = f.servers["policy_model"].runtime.control
            await until_changed(control, lambda: set(released) == set(rollouts))
        for rollout, reply in results.items():
            assert reply["messages"] == baseline[rollout]["messages"], rollout
            assert reply["reward"] == baseline[rollout]["reward"], rollout
            # Nothing ran twice: one delivered model call per assistant message.
            assert released[rollout] == sum(
                1 for m in reply["messages"] if m["role"] == "assistant"
            ), rollout


class SlowVerifyCounter(CounterServer):
    verify_gate: asyncio.Event
    verify_started: asyncio.Event

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self.verify_started.set()
        await self.verify_gate.wait()
        return await super().verify(session_id, body)


async def verify_during_checkpoint(mode: VerifyMode) -> tuple[Any, dict[str, Any]]:
    """A checkpoint while a verify is in flight. Every member runs on one injected clock, so
    the prepare's deadline passes only when the test moves it: with a verify the agent must
    wait for, once the agent reports that blocker; otherwise never."""
    clock = ObservedClock(time.time())
    server_class = type(f"Counter{mode.value}", (SlowVerifyCounter,), {"checkpoint_verify": mode})
    resources = server_class(
        ResourcesServerConfig(instance="prompt_injection", checkpoint=SETTINGS, clock=clock)
    )
    resources.verify_gate = asyncio.Event()
    resources.verify_started = asyncio.Event()
    task = {
        "task_id": "counting",
        "user_prompt": "count to two",
        "environment": {},
        "reference_plan": [{"name": "increment_counter", "arguments": {"count": 2}}],
        "verify_args": {"expected_count": 2},
    }
    async with in_process_fleet(resources, model_tasks=(task,), clock=clock) as f:
        run = asyncio.ensure_future(f.run("v1", task))
        await resources.verify_started.wait()
        prepare_deadline = clock.now() + 60
        agent_blocked = asyncio.Event()

        def watch(progress: Any) -> None:
            agent = next(m for m in progress.members if m.name == "agent")
            if agent.reached and any(b.capture_key == "v1" for b in agent.readiness.blockers):
                agent_blocked.set()

        preparing = asyncio.ensure_future(
            fanout.prepare_until_done(f.fleet, "c1", prepare_deadline, on_progress=watch)
        )
        if mode is VerifyMode.WAIT:
            blocked = asyncio.ensure_future(agent_blocked.wait())
            await asyncio.wait(
                {blocked, preparing}, timeout=60, return_when=asyncio.FIRST_COMPLETED
            )
            blocked.cancel()
            clock.set(prepare_deadline)  # the agent is still waiting: the deadline passes
        async with asyncio.timeout(60):
            progress = await preparing
        resources.verify_gate.set()
        await fanout.resume(f.fleet, "c1", clock.now() + 60)
        return progress, await run


async def test_a_wait_verify_in_flight_is_waited_for() -> None:
    progress, reply = await verify_during_checkpoint(VerifyMode.WAIT)
    assert progress.outcome == fanout.Outcome.NOT_PREPARED
    agent = next(m for m in progress.members if m.name == "agent")
    assert [b.capture_key for b in agent.readiness.blockers] == ["v1"]
    assert reply["reward"] == 1.0


async def test_a_replay_verify_in_flight_does_not_hold_the_checkpoint() -> None:
    progress, reply = await verify_during_checkpoint(VerifyMode.REPLAY)
    assert progress.prepared
    assert reply["reward"] == 1.0
