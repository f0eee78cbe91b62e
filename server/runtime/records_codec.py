"""The records' JSON codec: what a Commit stores for each exported episode, and reads back.

A part's records are JSON lines, one per episode, `episode_id` first and then the kind's own
fields in their order. The rules each keep a stored checkpoint restorable:

* NaN, Infinity and arbitrary objects are refused at export time (UNSERIALIZABLE_STATE), not
  written: a part that no JSON reader accepts would only fail at restore, when the state it
  held is gone. Big integers are kept exactly (Python's json never rounds them).
* `episode_id` is reserved: a kind field of that name would replace the identity the restore
  selects and retires by.
* Serializing is a generator, so the work happens in the writer's thread, not on the event
  loop (a large export must not stall every RPC and request of the process).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.runtime.participant import ExportRecord, RestoredRecord


def serialize_records(records: Sequence[ExportRecord]) -> Iterator[bytes]:
    """One encoded JSON line per record, key order kept, big integers kept.

    Raises `CheckpointError(UNSERIALIZABLE_STATE)` (while iterated) for a record that uses
    the reserved field `episode_id` or holds NaN, Infinity or a value JSON cannot represent.
    """
    for record in records:
        if "episode_id" in record.fields:
            raise CheckpointError(
                Reason.UNSERIALIZABLE_STATE,
                f"the record of {record.episode_id.capture_key} uses the reserved field episode_id",
                metadata={"captureKey": record.episode_id.capture_key},
            )
        line = {"episode_id": record.episode_id.to_json(), **record.fields}
        try:
            encoded = json.dumps(
                line, allow_nan=False, ensure_ascii=False, separators=(",", ":")
            ).encode()
        except (ValueError, TypeError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
            raise CheckpointError(
                Reason.UNSERIALIZABLE_STATE,
                f"the state of episode {record.episode_id.capture_key} cannot be stored as JSON: {exc}",
                metadata={"captureKey": record.episode_id.capture_key},
            ) from None
        yield encoded


def restored_record(raw: dict[str, Any]) -> RestoredRecord:
    """A stored record as the participant's `install()` receives it: the checkpointed
    episode, and the kind's fields without the reserved `episode_id`.

    `raw["episode_id"]` was already validated by the reader's selection (a corrupt one is
    CORRUPT_CHECKPOINT there); a `ValueError` here would mean the reader let one through.
    """
    episode = EpisodeId.from_json(raw["episode_id"])
    fields = {k: v for k, v in raw.items() if k != "episode_id"}
    return RestoredRecord(checkpointed=episode, fields=fields)
