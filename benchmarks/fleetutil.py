"""Fleets of real example servers, session seeding over HTTP, and the coordinator process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from grpc import aio

from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import timestamp
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .common import Processes, Server
from .httpraw import Connection

SEED_CONNECTIONS = 16


@dataclass
class Group:
    """One participant of each kind: environment -> agent -> policy model + resources."""

    environment: Server
    model: Server
    agent: Server
    resources: Server

    @property
    def servers(self) -> list[Server]:
        return [self.environment, self.model, self.agent, self.resources]


async def start_groups(
    processes: Processes,
    count: int,
    resources: str = "prompt_injection",
    *,
    tag: str = "",
    model_latency: float = 0.05,
) -> list[Group]:
    """`count` groups, callees first (every caller's URLs are known when it starts)."""
    first = await processes.serve_many(
        [
            spec
            for g in range(count)
            for spec in (
                (f"{tag}model-{g}", "policy_model", ("--latency", str(model_latency))),
                (f"{tag}{resources.replace('_', '-')}-{g}", resources, ()),
            )
        ]
    )
    models, stores = first[0::2], first[1::2]
    agents = await processes.serve_many(
        [
            (
                f"{tag}agent-{g}",
                "agent",
                ("--model-url", models[g].url, "--resources", f"{resources}={stores[g].url}"),
            )
            for g in range(count)
        ]
    )
    environments = await processes.serve_many(
        [
            (
                f"{tag}environment-{g}",
                "environment",
                ("--agent-url", agents[g].url, "--resources-server", resources),
            )
            for g in range(count)
        ]
    )
    return [Group(environments[g], models[g], agents[g], stores[g]) for g in range(count)]


def fleet_spec(servers: Sequence[Server], token: str) -> FleetSpec:
    members = []
    for server in servers:
        assert server.grpc is not None, f"{server.name} runs without a sidecar"
        members.append(MemberSpec(server.name, server.grpc))
    return FleetSpec(members=tuple(members), token=token)


async def discover(servers: Sequence[Server], token: str) -> Fleet:
    return await Fleet.discover(fleet_spec(servers, token))


async def seed_sessions(
    address: str,
    indices: Sequence[int],
    rollout_id: Callable[[int], str],
    body: Callable[[int], bytes],
    *,
    connections: int = SEED_CONNECTIONS,
) -> dict[int, str]:
    """Seed one session per index over HTTP, `connections` at a time; index -> its cookie.

    Each seed goes to `/ng-rollout/<rollout>-a1/seed_session` without a cookie, so the
    server starts a new session for it (attempt 1 of its own rollout)."""
    cookies: dict[int, str] = {}
    queue = list(reversed(indices))

    async def work() -> None:
        connection = await Connection.open(address)
        try:
            while queue:
                index = queue.pop()
                reply = await connection.request(
                    "POST", f"/ng-rollout/{rollout_id(index)}-a1/seed_session", body(index)
                )
                if reply.status != 200:
                    raise RuntimeError(f"seed {index}: HTTP {reply.status} {reply.body[:200]!r}")
                cookie = reply.cookie()
                assert cookie is not None, "seed_session set no session cookie"
                cookies[index] = cookie
        finally:
            await connection.close()

    await asyncio.gather(*(work() for _ in range(min(connections, len(indices)) or 1)))
    return cookies


# -- the coordinator ------------------------------------------------------------------------


def start_coordinator(
    processes: Processes, servers: Sequence[Server], name: str = "coordinator"
) -> Server:
    """`rollout-checkpoint coordinator --fleet FILE` over these servers, as its own process."""
    return launch_coordinator(processes, fleet_spec(servers, processes.token).members, name)


def launch_coordinator(
    processes: Processes,
    members: Sequence[MemberSpec],
    name: str = "coordinator",
    settings: Sequence[str] = (),
) -> Server:
    """`rollout-checkpoint coordinator` over `members`, as its own process; `settings` are
    more top-level fleet-file lines (`checkpoint_root = "..."`, `fan_out = 64`)."""
    directory = processes.workdir / name
    directory.mkdir(parents=True, exist_ok=True)
    token_file = directory / "token"
    token_file.write_text(processes.token)
    token_file.chmod(0o600)
    lines = ['token_file = "token"', *settings]
    for member in members:
        lines += ["[[participants]]", f'name = "{member.name}"', f'address = "{member.address}"']
    fleet_file = directory / "fleet.toml"
    fleet_file.write_text("\n".join(lines) + "\n")
    return processes.launch(
        name,
        [
            "-m",
            "rollout_checkpoint.client.cli.main",
            "coordinator",
            "--fleet",
            str(fleet_file),
            "--grpc-address",
            "127.0.0.1:0",
        ],
    )


class CoordinatorClient:
    """A controller of the CoordinatorService (what a trainer in any language would call)."""

    def __init__(self, address: str, token: str) -> None:
        self.channel = aio.insecure_channel(address)
        self.stub = cpb_grpc.CoordinatorServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)

    async def prepare(
        self, checkpoint_id: str, deadline: float
    ) -> AsyncIterator[cpb.CoordinatorServicePrepareResponse]:
        request = cpb.CoordinatorServicePrepareRequest(
            checkpoint_id=checkpoint_id, deadline=timestamp(deadline)
        )
        call = self.stub.Prepare(request, metadata=self.metadata, timeout=120)
        async for message in call:
            yield message

    async def resume(self, checkpoint_id: str, deadline: float) -> None:
        request = cpb.CoordinatorServiceResumeRequest(
            checkpoint_id=checkpoint_id, deadline=timestamp(deadline)
        )
        await self.stub.Resume(request, metadata=self.metadata, timeout=60)

    async def close(self) -> None:
        await self.channel.close()


PREPARED_OUTCOME = cpb.FLEET_PREPARE_OUTCOME_PREPARED
