"""THE checkpoint storage format: names, paths and the part manifest's schema, once.

    <root>/LATEST                                                 id of the latest publication
    <root>/<checkpoint_id>/checkpoint.json                        the fleet manifest (last)
    <root>/<checkpoint_id>/participants/<kind>/<instance>/manifest.json
    <root>/<checkpoint_id>/participants/<kind>/<instance>/records-<sha256>.jsonl

A participant's *part* is complete iff its `manifest.json` exists; a *checkpoint* is published
iff its fleet manifest `checkpoint.json` exists. The participant runtime writes and reads
parts (`part_storage`); controllers publish and verify checkpoints
(`client.checkpointing.publication`). Both take every name, pattern and the part manifest's
schema from here. Pure: no I/O.
"""

from __future__ import annotations

import builtins
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

SCHEMA_VERSION = 1

PARTICIPANTS_DIR = "participants"
MANIFEST_NAME = "manifest.json"
FLEET_MANIFEST_NAME = "checkpoint.json"
LATEST_NAME = "LATEST"

RECORDS_NAME = re.compile(r"^records-([0-9a-f]{64})\.jsonl$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Temporary names all start with a dot, which no checkpoint id, kind or instance can
# (ID_PATTERN), so they never collide with a published name and sweeps recognise them exactly.
PART_TEMPORARY_NAME = re.compile(r"^\.(records|manifest)-[0-9a-f]{16}\.tmp$")
FLEET_TEMPORARY_NAME = re.compile(r"^\.checkpoint\.json\.[0-9a-f]{16}\.tmp$")
LATEST_TEMPORARY_NAME = re.compile(r"^\.LATEST\.[0-9a-f]{16}\.tmp$")
TRASH_NAME = re.compile(r"^\.trash\.[0-9a-f]{16}$")

# A part manifest is a few hundred bytes; a larger file under its name is not one (and reading
# a hostile multi-gigabyte file into memory must not be the way to find that out).
MANIFEST_LIMIT = 1 << 16
LATEST_LIMIT = 1024


def records_name(sha256: str) -> str:
    """`records-<sha256>.jsonl`: a records file is named by its content's digest."""
    return f"records-{sha256}.jsonl"


def part_temporary_name(what: str, token: str) -> str:
    """`.records-<16 hex>.tmp` or `.manifest-<16 hex>.tmp` (what: "records" or "manifest")."""
    return f".{what}-{token}.tmp"


def fleet_temporary_name(token: str) -> str:
    return f".checkpoint.json.{token}.tmp"


def latest_temporary_name(token: str) -> str:
    return f".LATEST.{token}.tmp"


def trash_name(token: str) -> str:
    return f".trash.{token}"


def part_components(kind: str, instance: str) -> tuple[str, str, str]:
    """The directory names of a part below its checkpoint directory, outermost first."""
    return (PARTICIPANTS_DIR, kind, instance)


def part_path(checkpoint_dir: str, kind: str, instance: str) -> str:
    """`<checkpoint_dir>/participants/<kind>/<instance>` (the ONE path builder of a part).

    `checkpoint_dir` "" gives the path relative to the checkpoint directory."""
    relative = "/".join(part_components(kind, instance))
    return f"{checkpoint_dir.rstrip('/')}/{relative}" if checkpoint_dir else relative


def part_manifest_path(kind: str, instance: str) -> str:
    """The part's manifest relative to its checkpoint directory (what the fleet manifest lists)."""
    return f"{part_path('', kind, instance)}/{MANIFEST_NAME}"


@dataclass(frozen=True, slots=True)
class StoredManifest:
    """A part's `manifest.json`: which records file is the part, and its digest, count, size."""

    schema_version: int
    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int
    bytes: int  # the records file's size; the name is the manifest's field name

    def encode(self) -> builtins.bytes:
        """The canonical bytes (sorted keys): the same manifest is always the same file."""
        return (json.dumps(asdict(self), sort_keys=True, indent=2) + "\n").encode()

    @classmethod
    def decode(cls, raw: builtins.bytes) -> StoredManifest:
        """Parse and validate a part manifest; ValueError says what is wrong."""
        fields = load_json(raw)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        exact_fields(fields, _MANIFEST_FIELDS, "participant manifest")
        for name in ("schema_version", "record_count", "bytes"):
            value = fields[name]
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative integer")
        if fields["schema_version"] != SCHEMA_VERSION:
            raise ValueError(f"unsupported schema_version {fields['schema_version']}")
        for name in ("kind", "instance", "checkpoint_id", "records_file", "records_sha256"):
            if not isinstance(fields[name], str):
                raise ValueError(f"{name} must be a string")
        if not SHA256.fullmatch(fields["records_sha256"]):
            raise ValueError("records_sha256 must be 64 lowercase hex digits")
        match = RECORDS_NAME.fullmatch(fields["records_file"])
        if match is None or match.group(1) != fields["records_sha256"]:
            raise ValueError("records_file must be exactly records-<records_sha256>.jsonl")
        return cls(**fields)


_MANIFEST_FIELDS = frozenset(StoredManifest.__dataclass_fields__)


_decode = msgspec.json.Decoder().decode


def load_json(data: builtins.bytes) -> Any:
    """Strict JSON: NaN and Infinity refused, nesting deeper than the parser goes a ValueError.

    Parsed by msgspec: a restore parses every record, and msgspec makes the values
    `json.loads` makes (big integers exact, the last of duplicate keys win) with fewer
    allocations (it caches short keys), so in less time and memory; orjson parses as fast
    but turns integers past 64 bits into floats. It is also stricter than `json.loads` in
    three ways, all text no writer of ours produces: a number that overflows to infinity
    (`1e999`), a lone surrogate escape and a byte-order mark are refused. So whatever this
    returns holds only finite numbers and valid text, which lets a restore install decoded
    state without walking it again. Refused input is parsed again by `json.loads` only to
    give its message."""
    try:
        return _decode(data)
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        json.loads(data, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc
    raise ValueError("a number out of range, a lone surrogate or a byte-order mark is not JSON")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def exact_fields(fields: dict[str, Any], expected: frozenset[str], what: str) -> None:
    """ValueError unless `fields` has exactly the keys `expected` (schema 1 has no optionals)."""
    if set(fields) != expected:
        missing = sorted(expected - set(fields))
        extra = sorted(set(fields) - expected)
        raise ValueError(
            f"{what} fields differ from schema {SCHEMA_VERSION} (missing {missing}, "
            f"unexpected {extra})"
        )
