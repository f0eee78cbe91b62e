"""The records' JSON codec: what a Commit stores for each exported episode, and reads back.

A part's records are JSON lines, one per episode, `episode_id` first and then the kind's own
fields in their order. The rules each keep a stored checkpoint restorable:

* NaN, Infinity and arbitrary objects are refused at export time (UNSERIALIZABLE_STATE), not
  written: a part that no JSON reader accepts would only fail at restore, when the state it
  held is gone. Big integers are kept exactly (Python's json never rounds them).
* `episode_id` is reserved: a kind field of that name would replace the identity the restore
  selects and retires by.
* `worker` is reserved too, and dropped when read (`LEGACY_WORKER_FIELD`): multi-worker
  servers of an earlier version wrote beside each record the index of the worker that
  exported it. No reader needs it (a session's worker follows from its id), so every
  install path, one process or several workers of any number, reads such a part as if the
  field were not there, and no kind may store a field of that name of its own.
* Serializing is a generator, so the work happens in the writer's thread, not on the event
  loop (a large export must not stall every RPC and request of the process).
* A field's value may be `EncodedJSON`, a value its exporter already serialized (with
  `encode_json`): it is stored as it is, so a state is serialized once per commit, not
  copied through JSON by the hook and serialized again here.

Encoding is orjson's (about 4x the standard library's speed on the example states, and 1.2x
msgspec's), made as strict as `json.dumps(allow_nan=False)`: orjson writes NaN and Infinity as
`null` and cannot write integers past 64 bits, so an output holding `null` is checked for
non-finite floats, and whatever orjson refuses (big integers, subclasses of JSON types,
dataclasses, datetimes) is encoded again by the standard library, which keeps big integers
and refuses the rest as before. One difference remains: orjson writes a `uuid.UUID` and a
plain `enum.Enum` member (as its string and its value), which the standard library refuses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.runtime.participant import ExportRecord, RestoredRecord

_STRICT: Final = (
    orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)
"""Types the standard library refuses (or writes as their base type) go to the fallback."""
LEGACY_WORKER_FIELD: Final = "worker"
"""Written beside a record's fields by multi-worker servers of an earlier version (the index
of the worker that exported it); dropped when read, never written (see the module)."""
RESERVED_FIELDS: Final = frozenset({"episode_id", LEGACY_WORKER_FIELD})
"""Record fields no kind may export: the restore's identity, and the legacy worker index."""


@dataclass(frozen=True, slots=True)
class EncodedJSON:
    """One JSON value, already encoded as UTF-8 on one line (what `encode_json` returns).

    An exporter returns it as a record field's value (a resources server as a session's
    state) to have it stored byte for byte: the copy a hook must make anyway (nothing it
    exports may alias live state) is then the serialization itself. Bytes are independent
    of the live value, so no second copy is needed; the commit refuses one holding a line
    break (UNSERIALIZABLE_STATE), which would tear the records file's lines. The bytes are
    not parsed again: a value that is not JSON fails the restore, not the commit.
    """

    data: bytes


def encode_json(value: object) -> bytes:
    """`value` as compact UTF-8 JSON, key order kept: the JSON `json.dumps(value,
    allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()` returns, faster.
    Byte for byte the same but for some floats, which orjson writes in another notation of
    the same exact value (`1e-7` for `1e-07`, `0.00001751635919944541` for
    `1.751635919944541e-05`): every JSON reader parses both to the same double.

    Raises ValueError (NaN, Infinity, a lone surrogate), TypeError (a value JSON cannot
    carry, a key that is not a string) or RecursionError (nesting deeper than the standard
    library goes), as that call does. Never blocks on I/O, but holds the GIL for the whole
    value: call it in a thread for large states (see the module docstring for the one type
    difference)."""
    try:
        data = orjson.dumps(value, option=_STRICT)
    except TypeError:  # orjson.JSONEncodeError: big integers, subclasses, deep nesting
        pass
    else:
        if b"null" not in data or not _holds_non_finite(value):
            return data
    return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


def _holds_non_finite(value: object) -> bool:
    """Whether a NaN or an Infinity is anywhere in `value` (orjson wrote them as null).
    Iterative, so a deep value cannot overflow the stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _unserializable(record: ExportRecord, why: str) -> CheckpointError:
    return CheckpointError(
        Reason.UNSERIALIZABLE_STATE,
        f"the state of episode {record.episode_id.capture_key} cannot be stored as JSON: {why}",
        metadata={"captureKey": record.episode_id.capture_key},
    )


def _encode_line(record: ExportRecord) -> bytes:
    """`{"episode_id": ..., **fields}` as one line, each `EncodedJSON` value spliced in."""
    parts = [b'{"episode_id":', encode_json(record.episode_id.to_json())]
    for key, value in record.fields.items():
        if not isinstance(key, str):
            raise TypeError(f"a field name must be a string, not {type(key).__name__}")
        parts.append(b",")
        parts.append(encode_json(key))
        parts.append(b":")
        if isinstance(value, EncodedJSON):
            if b"\n" in value.data or b"\r" in value.data:
                raise ValueError(f"the encoded value of {key!r} holds a line break")
            parts.append(value.data)
        else:
            parts.append(encode_json(value))
    parts.append(b"}")
    return b"".join(parts)


def serialize_records(records: Sequence[ExportRecord]) -> Iterator[bytes]:
    """One encoded JSON line per record, key order kept, big integers kept.

    Raises `CheckpointError(UNSERIALIZABLE_STATE)` (while iterated) for a record that uses
    a reserved field (`episode_id`, `worker`) or holds NaN, Infinity or a value JSON cannot
    represent.
    """
    for record in records:
        yield encode_record(record)


def encode_record(record: ExportRecord) -> bytes:
    """One record's line (`serialize_records`), with the same refusals."""
    reserved = RESERVED_FIELDS.intersection(record.fields)
    if reserved:
        raise CheckpointError(
            Reason.UNSERIALIZABLE_STATE,
            f"the record of {record.episode_id.capture_key} uses the reserved field "
            f"{min(reserved)}",
            metadata={"captureKey": record.episode_id.capture_key},
        )
    try:
        return _encode_line(record)
    except (ValueError, TypeError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise _unserializable(record, str(exc)) from None


def restored_record(raw: dict[str, Any], episode: EpisodeId | None = None) -> RestoredRecord:
    """A stored record as the participant's `install()` receives it: the checkpointed
    episode, and the kind's fields without the reserved `episode_id` and `worker`.

    Takes `raw` over (the decoded record nobody else holds): its `episode_id` is popped and
    the rest become the fields, so a restore of 10,000 records makes no second dict each.
    `raw["episode_id"]` was already validated by the reader's selection (a corrupt one is
    CORRUPT_CHECKPOINT there); a `ValueError` here would mean the reader let one through.
    `episode`: what the selection already parsed from `raw["episode_id"]`, taken as it is
    (parsing 10,000 of them again cost 0.05 s of a restore).
    """
    stored = raw.pop("episode_id")
    raw.pop(LEGACY_WORKER_FIELD, None)
    return RestoredRecord(
        checkpointed=EpisodeId.from_json(stored) if episode is None else episode, fields=raw
    )
