"""The fleet file: the members a controller drives, its token, TLS and checkpoint root.

A fleet file (TOML or YAML) names every participant and its sidecar address, where the token
comes from, TLS, and the controller's checkpoint root:

    token_env = "ROLLOUT_CHECKPOINT_TOKEN"     # or token_file = "/run/secrets/token"
    checkpoint_root = "/checkpoints/run-7"    # where published checkpoints live (or s3://b/p)
    keep = 2                                   # published checkpoints kept
    async_commit = false                       # resume before the parts are durable
    [[participants]]
    name = "counter"
    address = "127.0.0.1:9001"
    command = ["rollout-checkpoint", "serve", "counter", "--grpc-address", "127.0.0.1:9001"]
    env = { ROLLOUT_CHECKPOINT_LEASE_GRACE_SECONDS = "60" }   # optional
    url = "http://127.0.0.1:8001"             # optional: its HTTP base URL

A participant's `command` (optional) is how a controller that kills and replaces members starts
it (`client/fleet/launch.py`): an argv list, run without a shell in the fleet file's folder, with
the controller's environment plus `env`. It is a list, never a string: a string would have to be
split by some shell's rules, and a path or an argument with a space would then start another
program than the one written. A replacement is the same command with
`ROLLOUT_CHECKPOINT_START_CLOSED=true` added, so it serves nothing before its restore.

A participant's `url` (optional, `http://` or `https://`) is its HTTP base URL, for a tool that
calls the member's own HTTP API beside its sidecar (`certify` reads the policy model's replay
statistics there). Without it, a tool takes the `--http-address HOST:PORT` of its `command`.

It is read whole and checked before any member is called (`FleetConfigError`): a typo found
after the fleet closed for a checkpoint would leave it closed for nothing.
"""

from __future__ import annotations

import os
import tomllib
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import is_valid_id
from rollout_checkpoint.server.core.object_store import is_object_url, parse_object_url


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
    """One fleet member as the fleet file names it: its name, its sidecar's address and, when
    a controller is to start it, its command."""

    name: str
    """The member's name in the fleet file: unique, a valid id, what every report names."""
    address: str
    """Its sidecar's gRPC address (`host:port`)."""
    command: tuple[str, ...] = ()
    """The argv that starts it (no shell); empty: the member is started by someone else."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables its command runs with, over the controller's own environment."""
    directory: str | None = None
    """The folder its command runs in (the fleet file's, so a relative path in the command
    means what it means beside the file); None without a command."""
    url: str | None = None
    """Its HTTP base URL (`http://` or `https://`, no trailing slash), when the fleet file
    gives one."""


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
    members = [_member_from(entry, base) for entry in data.get("participants") or []]
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


_PARTICIPANT_KEYS = {"name", "address", "command", "env", "url"}


def _member_from(entry: Any, base: Path) -> MemberSpec:
    if (
        not isinstance(entry, dict)
        or not {"name", "address"} <= set(entry)
        or not set(entry) <= _PARTICIPANT_KEYS
    ):
        raise FleetConfigError(
            "each participant has a name and an address, and optionally a command and an env "
            "(and a url)"
        )
    name = str(entry["name"])
    if not is_valid_id(name):
        raise FleetConfigError(f"participant name {entry['name']!r} is not a valid name")
    command = _command(name, entry["command"]) if "command" in entry else ()
    return MemberSpec(
        name,
        str(entry["address"]),
        command=command,
        env=_environment(name, entry.get("env", {})),
        directory=str(base.resolve()) if command else None,
        url=_url(name, entry["url"]) if "url" in entry else None,
    )


def _url(name: str, url: Any) -> str:
    """An absolute http(s) URL with a host: anything else would only fail at the first call,
    long after the fleet was started for it."""
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise FleetConfigError(
            f"participant {name}: url is an http:// or https:// URL with a host, "
            f'e.g. "http://127.0.0.1:8102"'
        )
    return str(url).rstrip("/")


def _command(name: str, command: Any) -> tuple[str, ...]:
    if isinstance(command, str):
        raise FleetConfigError(
            f"participant {name}: command is a list of arguments, e.g. "
            f'["rollout-checkpoint", "serve", "counter"], not a string: it is run without a '
            f"shell, so nothing would split it"
        )
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        raise FleetConfigError(f"participant {name}: command is a list of strings")
    if not command or not command[0]:
        raise FleetConfigError(f"participant {name}: command names a program to run")
    return tuple(command)


def _environment(name: str, env: Any) -> dict[str, str]:
    if not isinstance(env, dict) or not all(
        isinstance(key, str) and key and "=" not in key and isinstance(value, str)
        for key, value in env.items()
    ):
        raise FleetConfigError(
            f"participant {name}: env is a table of variable names to strings "
            f'(quote numbers and booleans: "60", "true")'
        )
    return dict(env)


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
