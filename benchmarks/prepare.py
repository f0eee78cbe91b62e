"""Benchmark 1: prepare reaction of a 4-member fleet (environment, policy model, agent, resources).

The resources member (the prompt-injection server) holds N live sessions, seeded over HTTP
beforehand (concurrently). Measured at the controller, both through the participant RPCs
(the coordination library, streams to every member) and through the CoordinatorService (a
separate `rollout-checkpoint coordinator` process):

* idle: nothing in flight; from the Prepare call to PREPARED at the controller;
* held: M tool calls in flight at the resources server, held open by their client (the head
  is sent, the body withheld) and released at a known moment once the resources member is
  PREPARING and waiting for them; from the last reply arriving to PREPARED at the
  controller: the control plane's own reaction;
* rollouts: M rollouts in flight through the whole fleet (environment -> agent -> policy
  model with 50 ms per generation -> resources tools); from the Prepare call to PREPARED
  (the figure NeMo Gym quotes: a 4-server fleet, 59 rollouts in flight, 36 ms).
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.v1 import types_pb2

from .common import BenchResult, deadline_in, ms, now, ratios, wait_for
from .fleetutil import (
    PREPARED_OUTCOME,
    CoordinatorClient,
    Group,
    discover,
    seed_sessions,
    start_coordinator,
    start_groups,
)
from .httpraw import Connection, json_body
from .states import task_environments, task_rows

PREPARING = types_pb2.PARTICIPANT_STATE_PREPARING
PREPARED_STATE = types_pb2.PARTICIPANT_STATE_PREPARED
TIMEOUT = 120.0


@dataclass
class Progress:
    """What a prepare driver reports: when the resources member began waiting, when each
    member was first seen PREPARED, and the end."""

    resources_waiting: asyncio.Event = field(default_factory=asyncio.Event)
    member_prepared_at: dict[str, float] = field(default_factory=dict)
    prepared_at: float = 0.0
    prepared: bool = False

    def seen(self, name: str, state: int) -> None:
        if state == PREPARED_STATE and name not in self.member_prepared_at:
            self.member_prepared_at[name] = now()


def session_rollout(index: int) -> str:
    return f"s{index:05d}"


class Controllers:
    """The two ways a controller prepares the fleet: library streams or the coordinator."""

    def __init__(self, fleet: Fleet, coordinator: CoordinatorClient, resources: str) -> None:
        self.fleet = fleet
        self.coordinator = coordinator
        self.resources = resources
        self.count = 0

    def new_id(self, label: str) -> str:
        self.count += 1
        return f"bench-{label}-{self.count}"

    async def prepare_library(self, checkpoint_id: str, progress: Progress) -> None:
        async for snapshot in fanout.prepare(self.fleet, checkpoint_id, deadline_in(TIMEOUT)):
            if snapshot.outcome is not None:
                progress.prepared_at = now()
                progress.prepared = snapshot.prepared
                break
            for member in snapshot.members:
                progress.seen(member.name, member.state)
                if member.name == self.resources and member.reached and member.state == PREPARING:
                    progress.resources_waiting.set()

    async def prepare_coordinator(self, checkpoint_id: str, progress: Progress) -> None:
        stream: AsyncIterator[Any] = self.coordinator.prepare(checkpoint_id, deadline_in(TIMEOUT))
        async for message in stream:
            if message.final:
                progress.prepared_at = now()
                progress.prepared = message.progress.outcome == PREPARED_OUTCOME
                break
            for member in message.progress.members:
                progress.seen(member.name, member.state)
                if member.name == self.resources and member.reached and member.state == PREPARING:
                    progress.resources_waiting.set()

    async def resume_library(self, checkpoint_id: str) -> None:
        await fanout.resume(self.fleet, checkpoint_id, deadline_in(TIMEOUT))

    async def resume_coordinator(self, checkpoint_id: str) -> None:
        await self.coordinator.resume(checkpoint_id, deadline_in(TIMEOUT))

    def via(
        self, name: str
    ) -> tuple[Callable[[str, Progress], Awaitable[None]], Callable[[str], Awaitable[None]]]:
        if name == "library":
            return self.prepare_library, self.resume_library
        return self.prepare_coordinator, self.resume_coordinator


VIAS = ("library", "coordinator")
VIA_LABEL = {"library": "participant RPCs", "coordinator": "CoordinatorService"}


async def idle_once(controllers: Controllers, via: str) -> float:
    prepare, resume = controllers.via(via)
    checkpoint_id = controllers.new_id(f"idle-{via}")
    progress = Progress()
    started = now()
    await prepare(checkpoint_id, progress)
    elapsed = progress.prepared_at - started
    await resume(checkpoint_id)
    if not progress.prepared:
        raise RuntimeError("the idle fleet did not get prepared")
    return elapsed


async def held_once(
    controllers: Controllers,
    via: str,
    connections: list[Connection],
    cookies: dict[int, str],
    inflight: Callable[[], Awaitable[int]],
) -> tuple[float, float]:
    """(last reply -> PREPARED, release -> PREPARED) with len(connections) calls held open."""
    prepare, resume = controllers.via(via)
    body = b"{}"
    for index, connection in enumerate(connections):
        path = f"/ng-rollout/{session_rollout(index)}-a1/get_messages"
        connection.write(connection.head("POST", path, len(body), cookie=cookies[index]))
    await asyncio.gather(*(c.drain() for c in connections))

    async def all_held() -> bool:
        return await inflight() >= len(connections)

    await wait_for(all_held, interval=0.002, within=TIMEOUT)
    checkpoint_id = controllers.new_id(f"held-{via}")
    progress = Progress()
    driver = asyncio.ensure_future(prepare(checkpoint_id, progress))
    try:
        async with asyncio.timeout(TIMEOUT):
            await asyncio.wait(
                {driver, asyncio.ensure_future(progress.resources_waiting.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
        if driver.done():
            driver.result()
            raise RuntimeError("the prepare ended before the held calls were released")

        async def finish(connection: Connection) -> float:
            reply = await connection.read_response()
            if reply.status != 200:
                raise RuntimeError(f"a held call answered {reply.status}: {reply.body[:200]!r}")
            return now()

        released = now()
        for connection in connections:
            connection.write(body)
        last_reply = max(await asyncio.gather(*(finish(c) for c in connections)))
        async with asyncio.timeout(TIMEOUT):
            await driver
    finally:
        if not driver.done():
            driver.cancel()
    await resume(checkpoint_id)
    if not progress.prepared:
        raise RuntimeError("the fleet did not get prepared after the release")
    return progress.prepared_at - last_reply, progress.prepared_at - released


class RolloutLoad:
    """`count` rollouts kept in flight through the fleet (closed loop), as a collector does.

    Each worker sends `POST /ng-rollout/<id>/run` to the environment and, when the reply
    arrives, the next rollout; the workers start spread over one model latency, so the
    rollouts are at every step at once rather than in lockstep. No new rollout is sent while
    a checkpoint is open (a collector holds dispatch too); the ones in flight continue after
    the resume."""

    def __init__(self, group: Group, count: int, spread: float) -> None:
        self.group = group
        self.count = count
        self.spread = spread
        self.dispatch_open = asyncio.Event()
        self.dispatch_open.set()
        self.stopping = False
        self.finished = 0
        self.in_flight = 0
        self._tasks = [json.loads(text) for text in task_rows()]
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._workers = [asyncio.ensure_future(self._work(i)) for i in range(self.count)]

    async def _work(self, worker: int) -> None:
        await asyncio.sleep(self.spread * worker / self.count)
        connection = await Connection.open(self.group.environment.http)
        try:
            number = 0
            while not self.stopping:
                await self.dispatch_open.wait()
                if self.stopping:
                    return
                number += 1
                rollout = f"w{worker}n{number}"
                task = self._tasks[(worker + number) % len(self._tasks)]
                self.in_flight += 1
                try:
                    reply = await connection.request(
                        "POST", f"/ng-rollout/{rollout}/run", json_body({"task": task})
                    )
                finally:
                    self.in_flight -= 1
                if reply.status == 409:  # sent as a checkpoint closed admission: send it later
                    await asyncio.sleep(0.01)
                    continue
                if reply.status != 200:
                    raise RuntimeError(
                        f"rollout {rollout}: HTTP {reply.status} {reply.body[:200]!r}"
                    )
                self.finished += 1
        finally:
            await connection.close()

    async def steady(self) -> None:
        """Wait until every worker has a rollout in flight."""
        async with asyncio.timeout(TIMEOUT):
            while self.in_flight < self.count:
                for worker in self._workers:
                    if worker.done():
                        worker.result()
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.stopping = True
        self.dispatch_open.set()
        async with asyncio.timeout(TIMEOUT):
            await asyncio.gather(*self._workers)


async def rollouts_once(
    controllers: Controllers, via: str, group: Group, load: RolloutLoad
) -> tuple[float, float]:
    """Prepare with the load's rollouts in flight: (Prepare call -> PREPARED, of which the
    agent stage: the model PREPARED -> the agent PREPARED)."""
    prepare, resume = controllers.via(via)
    await load.steady()
    checkpoint_id = controllers.new_id(f"rollouts-{via}")
    progress = Progress()
    load.dispatch_open.clear()
    started = now()
    try:
        await prepare(checkpoint_id, progress)
    finally:
        await resume(checkpoint_id)
        load.dispatch_open.set()
    if not progress.prepared:
        raise RuntimeError("the fleet with rollouts in flight did not get prepared")
    reached = progress.member_prepared_at
    agent_stage = reached[group.agent.name] - reached[group.model.name]
    return progress.prepared_at - started, agent_stage


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    result = BenchResult(
        "prepare",
        "1. Prepare reaction (4-member fleet)",
        "A fleet of one environment, policy model, agent and prompt-injection resources server "
        "(separate processes); the resources server holds N live sessions seeded over HTTP. "
        "idle: Prepare call -> PREPARED at the controller, nothing in flight. held: M tool calls "
        "held open at the resources server and released once it waits for them; last reply -> "
        "PREPARED (the control plane's reaction). rollouts: M rollouts kept in flight through "
        "the fleet (a closed loop, spread over the steps, the scripted model answering after a "
        "fixed latency); Prepare call -> PREPARED, and of it the agent stage (waiting for the "
        "agent's running steps). Each through the participant RPCs (coordination library) and "
        "through the CoordinatorService (its own process).",
        params={
            "sessions": params.sessions,
            "inflight": params.inflight,
            "repeats": params.repeats,
            "rollout_repeats": params.rollout_repeats,
            "model_latency": params.model_latency,
        },
    )
    processes = ctx.processes
    ctx.say("prepare: starting a 4-member fleet and a coordinator")
    group = (await start_groups(processes, 1, tag="prep-", model_latency=params.model_latency))[0]
    coordinator_server = await asyncio.to_thread(start_coordinator, processes, group.servers)
    assert coordinator_server.grpc is not None, "the coordinator announced no gRPC address"
    coordinator = CoordinatorClient(coordinator_server.grpc, processes.token)
    fleet = await discover(group.servers, processes.token)
    controllers = Controllers(fleet, coordinator, group.resources.name)
    resources = fleet.member(group.resources.name).client
    bodies = [json_body({"environment": json.loads(text)}) for text in task_environments()]
    cookies: dict[int, str] = {}

    async def inflight() -> int:
        return int((await resources.get_status()).readiness.counts.get("inflight", 0))

    try:
        # Warm every channel and code path once (not measured).
        for via in VIAS:
            await idle_once(controllers, via)
        seeded = 0
        for sessions in sorted(params.sessions):
            ctx.say(f"prepare: seeding sessions up to {sessions}")
            cookies.update(
                await seed_sessions(
                    group.resources.http,
                    range(seeded, sessions),
                    session_rollout,
                    lambda i: bodies[i % len(bodies)],
                )
            )
            seeded = sessions
            counts = (await resources.get_status()).readiness.counts
            if counts.get("sessions") != sessions:
                raise RuntimeError(f"the resources server tracks {counts.get('sessions')} sessions")
            idle: dict[str, list[float]] = {v: [] for v in VIAS}
            held: dict[str, list[float]] = {v: [] for v in VIAS}
            released: dict[str, list[float]] = {v: [] for v in VIAS}
            held_count = min(params.inflight, sessions)
            connections = [await Connection.open(group.resources.http) for _ in range(held_count)]
            try:
                for _ in range(params.repeats):
                    for via in VIAS:
                        idle[via].append(await idle_once(controllers, via))
                    for via in VIAS:
                        reaction, since_release = await held_once(
                            controllers, via, connections, cookies, inflight
                        )
                        held[via].append(reaction)
                        released[via].append(since_release)
            finally:
                await asyncio.gather(*(c.close() for c in connections))
            for via in VIAS:
                label = VIA_LABEL[via]
                result.figure(
                    f"N={sessions:,}, idle, {label}",
                    "Prepare call -> PREPARED",
                    "ms",
                    map(ms, idle[via]),
                )
                result.figure(
                    f"N={sessions:,}, M={held_count} held calls, {label}",
                    "last reply -> PREPARED",
                    "ms",
                    map(ms, held[via]),
                    note=f"release -> PREPARED median {ms(statistics.median(released[via])):.2f} ms",
                )
            result.ratio(
                f"N={sessions:,} idle: CoordinatorService / participant RPCs",
                "coordinator idle prepare",
                "library idle prepare",
                ratios(idle["coordinator"], idle["library"]),
            )
        count = params.inflight
        ctx.say(f"prepare: {count} rollouts in flight through the fleet")
        rollout_times: dict[str, list[float]] = {v: [] for v in VIAS}
        agent_stage: dict[str, list[float]] = {v: [] for v in VIAS}
        load = RolloutLoad(group, count, spread=params.model_latency)
        load.start()
        try:
            for round_number in range(params.rollout_repeats):
                for via in VIAS:
                    # Land each prepare at another phase of the rollouts' steps.
                    await asyncio.sleep(params.model_latency * (1 + (round_number % 3) / 3))
                    elapsed, agent = await rollouts_once(controllers, via, group, load)
                    rollout_times[via].append(elapsed)
                    agent_stage[via].append(agent)
        finally:
            await load.stop()
        for via in VIAS:
            case = (
                f"N={seeded:,}, M={count} rollouts in flight "
                f"({params.model_latency:g} s per model call), {VIA_LABEL[via]}"
            )
            result.figure(
                case,
                "Prepare call -> PREPARED",
                "ms",
                map(ms, rollout_times[via]),
                note=f"{load.finished} rollouts finished during the run",
            )
            result.figure(
                case,
                "of which the agent stage (its in-flight steps)",
                "ms",
                map(ms, agent_stage[via]),
            )
    finally:
        await fleet.close()
        await coordinator.close()
        processes.stop_servers([*group.servers, coordinator_server])
    return result
