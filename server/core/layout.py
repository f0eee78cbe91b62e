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
from dataclasses import dataclass
from typing import Any

import msgspec

SCHEMA_VERSION = 1
CHAIN_SCHEMA_VERSION = 2
"""A part that references records of earlier parts (`PartChain`), its reference lines naming
their episode. A full part keeps version 1, byte for byte: only a part with references needs
a reader that knows them, and a reader of version 1 refuses a version 2 manifest (typed,
DATA_LOSS) instead of taking its reference lines for records. Still read; no longer written."""
COMPACT_CHAIN_SCHEMA_VERSION = 3
"""What a chained part is written as: version 2's manifest, with reference lines that name no
episode (`{"$ref": [...]}`: the referenced record holds it, and its sha256 fixes it). A
reference line was about 143 bytes, a third of them the episode: at 10,000 sessions of 5 KB
with 10 % changed, the references alone were 2.6 % of a full part's bytes. A reader of
version 2 refuses a version 3 manifest (its fields are not version 1's), never misreads it."""
CHAINED_VERSIONS = frozenset({CHAIN_SCHEMA_VERSION, COMPACT_CHAIN_SCHEMA_VERSION})
REFERENCE_FIELD = "$ref"
"""The field of a reference line in a chained records file: `{"$ref": [reference index,
offset, length, sha256 of the line]}` (version 3; version 2 adds the `episode_id`)
(`part_references`)."""

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
class PartReference:
    """A records file of an earlier part that this part's reference lines point into.

    `checkpoint` is the earlier checkpoint's directory name, a sibling of this part's
    checkpoint directory under the same root: one plain name (an id), never a path, so a
    reference cannot leave the root whatever a manifest says. `bytes` is the file's size, and
    `records_file` carries its digest in its name."""

    checkpoint: str
    records_file: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "checkpoint": self.checkpoint,
            "records_file": self.records_file,
        }

    @classmethod
    def from_json(cls, raw: object) -> PartReference:
        if not isinstance(raw, dict) or set(raw) != {"bytes", "checkpoint", "records_file"}:
            raise ValueError("a reference holds exactly bytes, checkpoint and records_file")
        checkpoint, records_file, size = raw["checkpoint"], raw["records_file"], raw["bytes"]
        if not isinstance(checkpoint, str) or not is_reference_name(checkpoint):
            raise ValueError(f"a reference names an invalid checkpoint directory {checkpoint!r}")
        if not isinstance(records_file, str) or not RECORDS_NAME.fullmatch(records_file):
            raise ValueError("a reference names an invalid records file")
        if type(size) is not int or size < 0:
            raise ValueError("a reference's bytes must be a non-negative integer")
        return cls(checkpoint, records_file, size)


_REFERENCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_reference_name(name: str) -> bool:
    """A sibling checkpoint directory's name as a reference may hold it: one component that
    starts with a letter or digit (so never `.`, `..`, empty, absolute or with a slash)."""
    return _REFERENCE_NAME.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class PartChain:
    """What a version 2 manifest adds: how many of the part's lines are its own records and
    how many reference earlier parts (`references`, sorted), the bytes those references
    stand for, and the part's position in its chain (the first part after a full one is 2)."""

    own_records: int
    referenced_records: int
    referenced_bytes: int
    chain_length: int
    references: tuple[PartReference, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "chain_length": self.chain_length,
            "own_records": self.own_records,
            "referenced_bytes": self.referenced_bytes,
            "referenced_records": self.referenced_records,
            "references": [r.to_json() for r in self.references],
        }

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> PartChain:
        for name in ("own_records", "referenced_records", "referenced_bytes", "chain_length"):
            value = fields[name]
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative integer")
        raw_references = fields["references"]
        if not isinstance(raw_references, list) or not raw_references:
            raise ValueError("references must be a non-empty list")
        references = tuple(PartReference.from_json(r) for r in raw_references)
        if fields["chain_length"] < 2 or fields["referenced_records"] < 1:
            raise ValueError("a chained part references at least one record of an earlier part")
        return cls(
            fields["own_records"],
            fields["referenced_records"],
            fields["referenced_bytes"],
            fields["chain_length"],
            references,
        )


_CHAIN_FIELDS = frozenset(
    {"own_records", "referenced_records", "referenced_bytes", "chain_length", "references"}
)


@dataclass(frozen=True, slots=True)
class PartRecords:
    """What a part's records cost and what a restore of it reads: the records it `written`
    itself, those it `referenced` in earlier parts, and the parts a restore reads at most
    (`chain_length`, 1 for a full part). What a Commit reply and GetStatus report."""

    written: int
    referenced: int
    chain_length: int

    @property
    def record_count(self) -> int:
        return self.written + self.referenced


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
    chain: PartChain | None = None
    """Set only in a version 2 or 3 manifest: the part references records of earlier parts."""

    @property
    def own_records(self) -> int:
        return self.record_count if self.chain is None else self.chain.own_records

    @property
    def referenced_records(self) -> int:
        return 0 if self.chain is None else self.chain.referenced_records

    @property
    def chain_length(self) -> int:
        """How many parts a restore of this one reads at most (1: a full part)."""
        return 1 if self.chain is None else self.chain.chain_length

    @property
    def records(self) -> PartRecords:
        return PartRecords(self.own_records, self.referenced_records, self.chain_length)

    def encode(self) -> builtins.bytes:
        """The canonical bytes (sorted keys): the same manifest is always the same file. A
        part without references is version 1 exactly as before the chain existed."""
        fields = {
            "schema_version": self.schema_version,
            "kind": self.kind,
            "instance": self.instance,
            "checkpoint_id": self.checkpoint_id,
            "records_file": self.records_file,
            "records_sha256": self.records_sha256,
            "record_count": self.record_count,
            "bytes": self.bytes,
        }
        if self.chain is not None:
            fields.update(self.chain.to_json())
        return (json.dumps(fields, sort_keys=True, indent=2) + "\n").encode()

    @classmethod
    def decode(cls, raw: builtins.bytes) -> StoredManifest:
        """Parse and validate a part manifest; ValueError says what is wrong."""
        fields = load_json(raw)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        version = fields.get("schema_version")
        chained = version in CHAINED_VERSIONS
        expected = _MANIFEST_FIELDS | _CHAIN_FIELDS if chained else _MANIFEST_FIELDS
        exact_fields(fields, expected, "participant manifest")
        for name in ("schema_version", "record_count", "bytes"):
            value = fields[name]
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative integer")
        if version != SCHEMA_VERSION and not chained:
            raise ValueError(f"unsupported schema_version {version}")
        chain = PartChain.from_json(fields) if chained else None
        if (
            chain is not None
            and chain.own_records + chain.referenced_records != fields["record_count"]
        ):
            raise ValueError("own_records and referenced_records must add up to record_count")
        for name in ("kind", "instance", "checkpoint_id", "records_file", "records_sha256"):
            if not isinstance(fields[name], str):
                raise ValueError(f"{name} must be a string")
        if not SHA256.fullmatch(fields["records_sha256"]):
            raise ValueError("records_sha256 must be 64 lowercase hex digits")
        match = RECORDS_NAME.fullmatch(fields["records_file"])
        if match is None or match.group(1) != fields["records_sha256"]:
            raise ValueError("records_file must be exactly records-<records_sha256>.jsonl")
        return cls(
            schema_version=fields["schema_version"],
            kind=fields["kind"],
            instance=fields["instance"],
            checkpoint_id=fields["checkpoint_id"],
            records_file=fields["records_file"],
            records_sha256=fields["records_sha256"],
            record_count=fields["record_count"],
            bytes=fields["bytes"],
            chain=chain,
        )


_V1_ORDER = (
    "schema_version",
    "kind",
    "instance",
    "checkpoint_id",
    "records_file",
    "records_sha256",
    "record_count",
    "bytes",
)
_MANIFEST_FIELDS = frozenset(_V1_ORDER)


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
