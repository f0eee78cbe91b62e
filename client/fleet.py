"""A fleet: its file, its members, and their discovery.

A fleet file (TOML or YAML) names every participant and its sidecar address, where the token
comes from, TLS, and the controller's checkpoint root:

    token_env = "ROLLOUT_CHECKPOINT_TOKEN"     # or token_file = "/run/secrets/token"
    checkpoint_root = "/checkpoints/run-7"    # where published checkpoints live (or s3://b/p)
    keep = 2                                   # published checkpoints kept
    async_commit = false                       # resume before the parts are durable
    [[participants]]
    name = "counter"
    address = "127.0.0.1:9001"

Discovery calls GetParticipant on every member at once, with bounded tries: an unreachable
member fails discovery naming it, because a checkpoint that silently skipped a member would
be unsafe to restore.
"""

from __future__ import annotations

import asyncio
import os
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import is_valid_id
from rollout_checkpoint.server.core.object_store import is_object_url, parse_object_url
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


class FleetConfigError(ValueError):
    """The fleet file is invalid."""


DEFAULT_FAN_OUT = 64
"""Calls a controller makes at once within one stage (the fleet file's `fan_out`).

Unbounded, a 1,000-member stage would open 1,000 calls in one burst: the controller's event
loop and the gRPC completion queue serialize them anyway, every call's timeout starts in the
burst, and a deadline could pass for the last members while the first are still answering.
64 keeps a fleet of 1,000 on one core busy without a burst; raise it for slow members."""


@dataclass(frozen=True)
class MemberSpec:
    """One fleet member as the fleet file names it: its name and its sidecar's address."""

    name: str
    address: str


@dataclass(frozen=True)
class FleetSpec:
    """A parsed fleet file: the members, the control token, where checkpoints are published
    and how many are kept, and the TLS files of the channels to the members."""

    members: tuple[MemberSpec, ...]
    """`[[participants]]`: at least one, names unique and valid ids."""
    token: str = field(repr=False)
    """The control token, from `token_file` or the variable `token_env` names (default
    `ROLLOUT_CHECKPOINT_TOKEN`); never printed."""
    checkpoint_root: str | None = None
    """Where published checkpoints live (absolute, resolved against the file's folder)."""
    keep: int = 2
    """How many published checkpoints are kept (a positive integer)."""
    tls_ca_file: str | None = None
    """The CA that signs the members' certificates; None: plaintext channels."""
    tls_cert_file: str | None = None
    """The controller's client certificate, for members that require mutual TLS."""
    tls_key_file: str | None = None
    """The private key of `tls_cert_file`."""
    allow_agents_without_model: bool = False
    """Accept a fleet with agents but no policy-model participant (refused by default:
    the agents' model calls would not be part of the cut)."""
    async_commit: bool = False
    """Checkpoints resume the fleet at the snapshot and publish once every part is durable
    (asynchronous commits). Off by default: a synchronous checkpoint is published before the
    fleet runs on, and every participant version honours it."""
    fan_out: int = DEFAULT_FAN_OUT
    """How many members a controller calls at once within one stage (a positive integer)."""

    @classmethod
    def from_addresses(cls, addresses: Iterable[str], token: str, **options: Any) -> FleetSpec:
        """A spec without a fleet file: members named `member-<i>` in the given order;
        `options` are the other fields."""
        members = tuple(MemberSpec(f"member-{i}", address) for i, address in enumerate(addresses))
        return cls(members=members, token=token, **options)

    def client(
        self,
        member: MemberSpec,
        *,
        timeout: float,
        credentials: grpc.ChannelCredentials | None,
    ) -> ParticipantClient:
        """A client of `member` with the fleet's token; `credentials` is `self.credentials()`,
        read once by a caller that makes several (they come from files)."""
        return ParticipantClient(
            member.address, self.token, credentials=credentials, timeout=timeout
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials from the files (None: plaintext). Reads them now, so a
        missing file raises OSError here, before any member is called."""
        if self.tls_ca_file is None:
            return None
        root = Path(self.tls_ca_file).read_bytes()
        key = Path(self.tls_key_file).read_bytes() if self.tls_key_file else None
        cert = Path(self.tls_cert_file).read_bytes() if self.tls_cert_file else None
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=cert
        )


def load_fleet_file(path: str | Path, *, environ: dict[str, str] | None = None) -> FleetSpec:
    """Read a TOML (`.toml`) or YAML (anything else) fleet file; relative paths are the file's."""
    path = Path(path)
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:
        raise FleetConfigError(
            f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise FleetConfigError(f"{path}: a fleet file is a mapping")
    return _spec_from(data, path.parent, os.environ if environ is None else environ)


_KNOWN_KEYS = {
    "participants",
    "fan_out",
    "token_env",
    "token_file",
    "checkpoint_root",
    "keep",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "allow_agents_without_model",
    "async_commit",
}


def _spec_from(
    data: dict[str, Any], base: Path, environ: dict[str, str] | os._Environ[str]
) -> FleetSpec:
    unknown = set(data) - _KNOWN_KEYS
    if unknown:
        raise FleetConfigError(f"unknown fleet file keys: {', '.join(sorted(unknown))}")
    members = []
    for entry in data.get("participants") or []:
        if not isinstance(entry, dict) or set(entry) != {"name", "address"}:
            raise FleetConfigError("each participant has exactly a name and an address")
        if not is_valid_id(str(entry["name"])):
            raise FleetConfigError(f"participant name {entry['name']!r} is not a valid name")
        members.append(MemberSpec(str(entry["name"]), str(entry["address"])))
    if not members:
        raise FleetConfigError("a fleet needs at least one participant")
    if len({m.name for m in members}) != len(members):
        raise FleetConfigError("participant names must be unique")
    token = _token(data, base, environ)

    def resolve(key: str) -> str | None:
        value = data.get(key)
        if value is not None and is_object_url(str(value)):
            # An object-store root: checked, never resolved as a path. It carries no
            # credentials (user info is refused): those come from the environment only.
            try:
                return parse_object_url(str(value)).url
            except ValueError as exc:
                raise FleetConfigError(f"{key} {value!r}: {exc}") from None
        return None if value is None else str((base / str(value)).resolve())

    keep = data.get("keep", 2)
    if type(keep) is not int or keep < 1:
        raise FleetConfigError("keep is a positive integer")
    fan_out = data.get("fan_out", DEFAULT_FAN_OUT)
    if type(fan_out) is not int or fan_out < 1:
        raise FleetConfigError("fan_out is a positive integer")
    async_commit = data.get("async_commit", False)
    if type(async_commit) is not bool:
        raise FleetConfigError("async_commit is true or false")
    return FleetSpec(
        members=tuple(members),
        token=token,
        checkpoint_root=resolve("checkpoint_root"),
        keep=keep,
        async_commit=async_commit,
        tls_ca_file=resolve("tls_ca_file"),
        tls_cert_file=resolve("tls_cert_file"),
        tls_key_file=resolve("tls_key_file"),
        allow_agents_without_model=bool(data.get("allow_agents_without_model", False)),
        fan_out=fan_out,
    )


def _token(data: dict[str, Any], base: Path, environ: dict[str, str] | os._Environ[str]) -> str:
    if "token_file" in data:
        token = (base / str(data["token_file"])).read_text().strip()
    else:
        name = str(data.get("token_env", "ROLLOUT_CHECKPOINT_TOKEN"))
        token = environ.get(name, "")
        if not token:
            raise FleetConfigError(f"no token: set ${name} or token_file in the fleet file")
    if not token:
        raise FleetConfigError("the token file is empty")
    return token


@dataclass
class Member:
    """A discovered fleet member and its client."""

    name: str
    address: str
    kind: Kind
    instance: str
    boot_id: str
    client: ParticipantClient
    prepare_fence: bool = False
    """The member honours `PrepareRequest.expected_boot_id` (GetParticipant says so)."""
    state_checked_boot_id: str = ""
    """The boot id of the process whose status this controller read and found not awaiting
    its restore (`checkpointing.refuse_members_awaiting_restore`); empty until then. Prepare
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
