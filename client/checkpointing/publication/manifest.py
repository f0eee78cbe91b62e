"""The fleet manifest (`checkpoint.json`): its model, canonical encoding and strict decoding.

The one place the fleet manifest's schema is written down on the controller side; a part's
manifest is `server.core.layout`'s.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.episodes import EpisodeId, is_valid_id
from rollout_checkpoint.server.core.layout import (
    SCHEMA_VERSION,
    exact_fields,
    load_json,
)

_FLEET_FIELDS = frozenset(
    {
        "schema_version",
        "checkpoint_id",
        "created_at",
        "participants",
        "continued",
        "controller_state",
    }
)
_ENTRY_FIELDS = frozenset({"name", "kind", "instance", "manifest", "manifest_sha256"})
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:Z|[+-]\d{2}:\d{2})$")
# The root itself may be a symlink (the caller's choice); nothing below it is followed.


@dataclass(frozen=True, slots=True)
class PublishedParticipant:
    """One fleet member's committed part: what its Commit reply reported."""

    name: str
    """The member's fleet-file name."""
    kind: str
    """Its kind as a word (`environment`, `model`, `agent`, `resources`)."""
    instance: str
    """Its instance: its part's directory under its kind."""
    manifest_sha256: str
    """The digest of its part's manifest as its Commit reported it: what verification holds the part
    to."""

    @property
    def manifest_path(self) -> str:
        """The part's manifest, relative to the checkpoint directory."""
        return layout.part_manifest_path(self.kind, self.instance)

    def problem(self) -> str | None:
        """Why this entry cannot be part of a fleet manifest, or None."""
        for field_name, value in (
            ("name", self.name),
            ("kind", self.kind),
            ("instance", self.instance),
        ):
            if not isinstance(value, str) or not is_valid_id(value):
                return f"participant {field_name} {value!r} is not a valid id"
        if not isinstance(self.manifest_sha256, str) or not layout.SHA256.fullmatch(
            self.manifest_sha256
        ):
            return f"participant {self.name}: manifest_sha256 must be 64 lowercase hex digits"
        return None


@dataclass(frozen=True, slots=True)
class FleetManifest:
    """The content of `checkpoint.json`."""

    checkpoint_id: str
    """The checkpoint's id (its directory's name)."""
    created_at: datetime
    """When it was published (UTC): what orders checkpoints for retention and `LATEST`."""
    participants: tuple[PublishedParticipant, ...]
    """Every member's part, by member."""
    continued: tuple[EpisodeId, ...]
    """The episodes a restore of it continues."""
    controller_state: bytes
    """Opaque bytes the controller published with it (collect's rollout book), returned by a
    restore."""
    schema_version: int = SCHEMA_VERSION
    """The manifest's schema; a reader refuses one it does not know."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object `checkpoint.json` holds (each entry's manifest path derived)."""
        return {
            "schema_version": self.schema_version,
            "checkpoint_id": self.checkpoint_id,
            "created_at": format_time(self.created_at),
            "participants": [
                {
                    "name": p.name,
                    "kind": p.kind,
                    "instance": p.instance,
                    "manifest": p.manifest_path,
                    "manifest_sha256": p.manifest_sha256,
                }
                for p in self.participants
            ],
            "continued": [e.to_json() for e in self.continued],
            "controller_state": base64.b64encode(self.controller_state).decode("ascii"),
        }

    def encode(self) -> bytes:
        """The canonical bytes: sorted keys, so the same manifest is always the same file
        (which is what makes a re-publication comparable byte for byte)."""
        return (json.dumps(self.to_json(), sort_keys=True, indent=2) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> FleetManifest:
        """Parse and validate `checkpoint.json`; ValueError says what is wrong."""
        fields = load_json(data)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        exact_fields(fields, _FLEET_FIELDS, "fleet manifest")
        version = fields["schema_version"]
        if type(version) is not int:
            raise ValueError("schema_version must be an integer")
        if version != SCHEMA_VERSION:
            raise ValueError(f"unsupported schema_version {version} (expected {SCHEMA_VERSION})")
        checkpoint_id = fields["checkpoint_id"]
        if not isinstance(checkpoint_id, str) or not is_valid_id(checkpoint_id):
            raise ValueError("checkpoint_id is not a valid id")
        created_at = parse_time(fields["created_at"])
        participants = _decode_participants(fields["participants"])
        continued = _decode_continued(fields["continued"])
        state = fields["controller_state"]
        if not isinstance(state, str):
            raise ValueError("controller_state must be a base64 string")
        try:
            controller_state = base64.b64decode(state, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"controller_state is not valid base64: {exc}") from exc
        return cls(checkpoint_id, created_at, participants, continued, controller_state, version)


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds: `2025-01-31T12:00:00.000000Z`."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: object) -> datetime:
    """An RFC 3339 timestamp (with `Z` or an offset) as an aware UTC datetime."""
    if not isinstance(value, str) or not _RFC3339.fullmatch(value):
        raise ValueError(f"created_at must be an RFC 3339 timestamp, not {value!r}")
    return datetime.fromisoformat(value).astimezone(UTC)


def _decode_participants(value: object) -> tuple[PublishedParticipant, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("participants must be a non-empty list")
    entries: list[PublishedParticipant] = []
    for item in value:
        if not isinstance(item, dict):
            raise ValueError("a participant entry is not an object")
        exact_fields(item, _ENTRY_FIELDS, "participant entry")
        entry = PublishedParticipant(
            item["name"], item["kind"], item["instance"], item["manifest_sha256"]
        )
        problem = entry.problem()
        if problem is not None:
            raise ValueError(problem)
        # Only this exact relative path is accepted: no `..`, no absolute path, no other
        # file name; the path is derived from kind and instance, never trusted on its own.
        if item["manifest"] != entry.manifest_path:
            raise ValueError(
                f"participant {entry.name}: manifest must be {entry.manifest_path!r}, "
                f"not {item['manifest']!r}"
            )
        entries.append(entry)
    check_unique(entries)
    return tuple(entries)


def _decode_continued(value: object) -> tuple[EpisodeId, ...]:
    if not isinstance(value, list):
        raise ValueError("continued must be a list")
    episodes = tuple(EpisodeId.from_json(item) for item in value)
    if len(set(episodes)) != len(episodes):
        raise ValueError("continued lists an episode twice")
    return episodes


def check_unique(entries: Sequence[PublishedParticipant]) -> None:
    """ValueError when two entries share a name, or a kind and instance: a restore would not
    know which part a member takes."""
    if len({e.name for e in entries}) != len(entries):
        raise ValueError("two participants share a name")
    if len({(e.kind, e.instance) for e in entries}) != len(entries):
        raise ValueError("two participants share a kind and instance")
