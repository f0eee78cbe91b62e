"""Discovery: the fleet file's members found live, with their kinds and boot ids.

Discovery calls GetParticipant on every member at once, with bounded tries: an unreachable
member fails discovery naming it, because a checkpoint that silently skipped a member would
be unsafe to restore.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet.spec import FleetSpec
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.v1 import types_pb2

Kind: TypeAlias = "types_pb2.ParticipantKind.ValueType"

STAGE_ORDER: tuple[Kind, ...] = (
    types_pb2.PARTICIPANT_KIND_ENVIRONMENT,
    types_pb2.PARTICIPANT_KIND_MODEL,
    types_pb2.PARTICIPANT_KIND_AGENT,
    types_pb2.PARTICIPANT_KIND_RESOURCES,
)
"""Prepare order. Environments park their episodes first; the policy model then holds its
responses so agents waiting on it reach a boundary; resources go last because agents and
environments call them until they park."""

KIND_NAMES: dict[Kind, str] = {
    types_pb2.PARTICIPANT_KIND_ENVIRONMENT: "environment",
    types_pb2.PARTICIPANT_KIND_MODEL: "model",
    types_pb2.PARTICIPANT_KIND_AGENT: "agent",
    types_pb2.PARTICIPANT_KIND_RESOURCES: "resources",
}


@dataclass
class Member:
    """A discovered fleet member and its client."""

    name: str
    """The member's fleet-file name."""
    address: str
    """Its sidecar's gRPC address."""
    kind: Kind
    """Its participant kind, which places it in the prepare order (`STAGE_ORDER`)."""
    instance: str
    """The instance name it reported: its part's directory under its kind."""
    boot_id: str
    """The boot id of the process discovery found; a new one is a new process, whose state is
    gone."""
    client: ParticipantClient
    """The member's client (closed with the fleet)."""
    prepare_fence: bool = False
    """The member honours `PrepareRequest.expected_boot_id` (GetParticipant says so)."""
    state_checked_boot_id: str = ""
    """The boot id of the process whose status this controller read and found not awaiting
    its restore (`checkpoint.refuse_members_awaiting_restore`); empty until then. Prepare
    is fenced to it (`PrepareRequest.expected_boot_id`), so for a member with
    `prepare_fence` the status needs no reading again while the process stays the same one:
    a replacement refuses the Prepare (BOOT_ID_MISMATCH) instead of being prepared in its
    place. A member without it is read before every checkpoint."""

    @property
    def kind_name(self) -> str:
        """The kind as a word (`environment`, `model`, `agent`, `resources`)."""
        return KIND_NAMES.get(self.kind, "unknown")

    @property
    def stage(self) -> int:
        """The member's position in the prepare order (`STAGE_ORDER`), from 0."""
        return STAGE_ORDER.index(self.kind)


class DiscoveryError(Exception):
    """Discovery failed. `failures` describes each failure; `errors` keeps the members' own
    ControlErrors, which tell a member that refused (a wrong token) from one that is down."""

    def __init__(
        self, failures: dict[str, str], errors: dict[str, ControlError] | None = None
    ) -> None:
        super().__init__(
            "discovery failed: " + "; ".join(f"{n}: {m}" for n, m in sorted(failures.items()))
        )
        self.failures = failures
        self.errors = dict(errors or {})

    @property
    def refused(self) -> bool:
        """Whether a member decided against the call, rather than not being reached."""
        return any(error.decided_by_server for error in self.errors.values())


class Fleet:
    """The discovered members, sorted by (prepare stage, name)."""

    def __init__(self, spec: FleetSpec, members: Sequence[Member]) -> None:
        self.spec = spec
        self.members = sorted(members, key=lambda m: (m.stage, m.name))

    @classmethod
    async def discover(
        cls, spec: FleetSpec, *, tries: int = 3, try_timeout: float = 5.0, backoff: float = 0.5
    ) -> Fleet:
        """GetParticipant on every member (`spec.fan_out` at once), each up to `tries` times (`try_timeout`
        seconds per try, linear `backoff` between), and the fleet of what answered.

        Raises `DiscoveryError` naming every member that failed (a member that refused, e.g.
        a wrong token, is not retried: `refused` tells it from one that is down), reported an
        unknown kind, or, for a fleet of agents without a policy model, unless the spec
        allows it; the clients are closed then. Close the fleet when done (`async with`)."""
        credentials = spec.credentials()
        clients = {
            m.name: spec.client(m, timeout=try_timeout, credentials=credentials)
            for m in spec.members
        }
        slots = asyncio.Semaphore(spec.fan_out)

        async def describe(client: ParticipantClient) -> Any:
            async with slots:
                return await _describe(client, tries, backoff)

        results = await asyncio.gather(
            *(describe(clients[m.name]) for m in spec.members), return_exceptions=True
        )
        failures: dict[str, str] = {}
        errors: dict[str, ControlError] = {}
        members: list[Member] = []
        for member_spec, result in zip(spec.members, results, strict=True):
            if isinstance(result, BaseException):
                failures[member_spec.name] = str(result)
                if isinstance(result, ControlError):
                    errors[member_spec.name] = result
            elif result.kind not in STAGE_ORDER:
                failures[member_spec.name] = f"unknown participant kind {result.kind}"
            else:
                client = clients[member_spec.name]
                members.append(
                    Member(
                        member_spec.name,
                        member_spec.address,
                        result.kind,
                        result.instance,
                        result.boot_id,
                        client,
                        prepare_fence=result.prepare_fence,
                    )
                )
        kinds = {m.kind for m in members}
        agents_alone = (
            types_pb2.PARTICIPANT_KIND_AGENT in kinds
            and types_pb2.PARTICIPANT_KIND_MODEL not in kinds
        )
        if not failures and agents_alone and not spec.allow_agents_without_model:
            failures["fleet"] = (
                "agents but no policy model participant (set allow_agents_without_model)"
            )
        if failures:
            await asyncio.gather(*(c.close() for c in clients.values()))
            raise DiscoveryError(failures, errors)
        return cls(spec, members)

    async def close(self) -> None:
        """Close every member's channel; idempotent."""
        await asyncio.gather(*(m.client.close() for m in self.members))

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *args: object) -> None:
        await self.close()

    def stages(self) -> list[tuple[Kind, list[Member]]]:
        """Members grouped by stage, in prepare order (stages without members left out)."""
        return [
            (kind, [m for m in self.members if m.kind == kind])
            for kind in STAGE_ORDER
            if any(m.kind == kind for m in self.members)
        ]

    def member(self, name: str) -> Member:
        """The member of this fleet-file name; KeyError when there is none."""
        for member in self.members:
            if member.name == name:
                return member
        raise KeyError(name)


async def _describe(client: ParticipantClient, tries: int, backoff: float) -> Any:
    last: Exception | None = None
    for attempt in range(tries):
        try:
            return await client.get_participant()
        except ControlError as error:
            if error.decided_by_server:
                raise  # a refusal (a wrong token) will not change on a retry
            last = error
        if attempt + 1 < tries:
            await asyncio.sleep(backoff * (attempt + 1))
    assert last is not None
    raise last
