"""Controller-side publication of fleet checkpoints, and an independent verifier of them.

    <root>/LATEST                                                 id of the latest publication
    <root>/.history.json, <root>/.history-<id>.<hex>.json         the checkpoint history (`history`)
    <root>/<checkpoint_id>/checkpoint.json                        the fleet manifest (last)
    <root>/<checkpoint_id>/participants/<kind>/<instance>/manifest.json
    <root>/<checkpoint_id>/participants/<kind>/<instance>/records-<sha256>.jsonl

Every participant writes its own part of a checkpoint into the controller's checkpoint
directory. A part is complete iff its `manifest.json` exists; a *checkpoint* is published iff
its fleet manifest `checkpoint.json` exists. Only a published checkpoint is ever restored, and
`LATEST` names the one a restore without an explicit id uses.

Everything here blocks (file I/O, fsync, hashing whole records files): an asyncio caller runs
it through `bounded.store_call(deadline, ...)`, on a thread it stops waiting for at the
operation's deadline (a frozen filesystem or a hung store is then `StorageFailed`). One `CheckpointRoot` serializes
its own publications with a lock; one controller process owns a root (two controllers
publishing into the same root are not supported: retention of one could delete the other's
unfinished checkpoint).

Why publication happens in this order — each step exists for a crash (or a bad part) at the
step before it:

1. **Verify every participant part first** (its manifest's sha256 is the one the participant
   reported at commit, its kind, instance and checkpoint id are right, its records match their
   digest, count and size, every record names a valid episode). The fleet manifest is the
   promise that the whole fleet can be restored all or nothing; written before this check, a
   missing or torn part would become the restore point and every restore of it would fail —
   after retention may already have deleted the previous, good checkpoint.
2. **Make the parts' directory entries durable.** Participants fsync their own instance
   directory, but the `participants/`, `<kind>/` and `<checkpoint_id>/` entries above it were
   created by `mkdir` and may still be in the page cache: a power loss could drop a whole part
   that the fleet manifest names. Publication fsyncs them before naming them.
3. **Write the fleet manifest without ever replacing one**: a temp file, fsynced, hard-linked to
   `checkpoint.json` (`link` fails when the name exists, so a published checkpoint never changes
   and of two racing publishers exactly one wins), then the directory fsynced. An identical
   manifest already there is an idempotent retry; a different one is `CheckpointConflict`.
4. **Only then move `LATEST`** (temp file, fsync, `os.replace`, fsync of the root). Moved
   earlier, a crash could leave `LATEST` naming a directory whose `checkpoint.json` never
   reached the disk: the fleet would have no loadable restore point although the previous
   checkpoint was fine. A crash between 3 and 4 leaves `LATEST` on the previous checkpoint
   (still loadable), and publishing the same id again completes idempotently.
5. **Retention last**, after `LATEST` moved, so it never deletes what `LATEST` still names.
   A directory is deleted by renaming it to a hidden trash name first (then removing the
   tree): a crash in the middle of a removal never leaves a directory that still looks
   published but has lost parts. A controller that resumes its fleet after publishing
   defers this step (`defer_retention=True`, then `complete_retention`) until the fleet runs
   again: deleting a 1,000-member checkpoint is seconds of disk work that no restore needs.

Every file below the root is opened through directory descriptors with O_NOFOLLOW, so a
symlink planted anywhere in a checkpoint directory is refused rather than followed. The
format (names, paths, the part manifest's schema) is `server.core.layout`'s, the safe-open
rules are `server.core.safe_files`', and each part is verified by the participants' own part
reader (`server.core.part_reader`): one implementation of the format. What keeps that
reader honest is not a second parser but the golden checkpoints under `tests/fixtures/`,
which both the writer's round trip and `inspect` must reproduce byte for byte.

Modules, one concept each (every public name is importable from this package):
`errors`; `manifest` (the fleet manifest `checkpoint.json`: model, encoding, decoding);
`files` (opening below the root without following links); `root` (`CheckpointRoot`:
publish, load); `object_root` (`ObjectCheckpointRoot`: the same on an object store);
`roots` (`PublicationRoot`, `open_checkpoint_root`: either, by the location's form); `latest` (`LATEST`); `retention`; `verify` (`verify_checkpoint`, `inspect`
and their summaries); `bounded` (`store_call`: a root's method bounded by a deadline);
`history` (the root's record of every checkpoint and restore attempted).
"""

from __future__ import annotations

from rollout_checkpoint.client.checkpointing.publication.bounded import store_call, store_call_sync
from rollout_checkpoint.client.checkpointing.publication.errors import (
    CheckpointConflict,
    CheckpointCorrupt,
    NoPublishedCheckpoint,
    PublicationError,
    StorageFailed,
    as_checkpoint_error,
    reason_of,
)
from rollout_checkpoint.client.checkpointing.publication.manifest import (
    FleetManifest,
    PublishedParticipant,
    format_time,
    parse_time,
)
from rollout_checkpoint.client.checkpointing.publication.root import (
    CheckpointRoot,
    CrashHook,
    PendingRetention,
    PublishedCheckpoint,
)
from rollout_checkpoint.client.checkpointing.publication.roots import (
    PublicationRoot,
    open_checkpoint_root,
)
from rollout_checkpoint.client.checkpointing.publication.verify import (
    CheckpointSummary,
    ParticipantSummary,
    inspect,
    verify_checkpoint,
)

__all__ = [
    "CheckpointConflict",
    "CheckpointCorrupt",
    "CheckpointRoot",
    "CheckpointSummary",
    "CrashHook",
    "FleetManifest",
    "NoPublishedCheckpoint",
    "ParticipantSummary",
    "PendingRetention",
    "PublicationError",
    "PublicationRoot",
    "PublishedCheckpoint",
    "PublishedParticipant",
    "StorageFailed",
    "as_checkpoint_error",
    "format_time",
    "inspect",
    "open_checkpoint_root",
    "parse_time",
    "reason_of",
    "store_call",
    "store_call_sync",
    "verify_checkpoint",
]
