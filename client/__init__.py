"""The controller library: everything a Python program needs to drive a fleet of participants.

Every name below is importable from here, `from rollout_checkpoint.client import Fleet`; the
modules behind them are the library's layout, not its API. Importing this package loads
nothing (not grpc either): a name is imported on its first use. The CLI relies on that: it
takes SIGINT and SIGTERM before anything heavy is loaded, and a controller script pays only for
what it uses.

**One participant.** `ParticipantClient` is the typed client of one participant's
`ParticipantService` (every control RPC, with the fleet's token and deadlines); a failed call
raises `ControlError`, whose `reason` is the `ErrorInfo` reason the participant decided on.

**The fleet.** A fleet file (TOML or YAML) names the members: `load_fleet_file` reads it into
a `FleetSpec` of `MemberSpec`s (`FleetConfigError` when it is invalid). `Fleet.discover` finds
every member live (`Member`: kind, instance, boot id, client) or fails naming the ones it
could not reach (`DiscoveryError`). `FleetWatch` reports who is in the fleet right now
(`MemberEvent`, its `Change`: up, down, replaced: a new boot id is a new process whose state is gone).
A member whose fleet-file entry has a `command` can be started from it: `start_member` runs it in
a process group of its own and returns a `LaunchedMember` once it is live (a replacement starts
closed); a start that fails is a `LaunchError` (`CommandNotStarted`, `ExitedBeforeReady`,
`NotReadyInTime`).

**Checkpointing.** `checkpoint` takes one whole checkpoint: prepare every stage in order,
commit, publish, resume, yielding `CheckpointEvent`s (their `Phase`) and ending with a
`CheckpointOutcome`; a checkpoint that fails before publication resumes the fleet, so the
fleet never stays closed for a checkpoint that will not exist. `restore_published` restores
one (a `RestoredCheckpoint`), verifying the whole checkpoint before any member installs
anything. The fan-out operations beneath them are the same steps one at a time, each safe to
retry with the same checkpoint id (the participants replay recorded results): `prepare`
(`FleetProgress` of `MemberProgress`, ending in an `Outcome`), `prepare_until_done`,
`commit` (`FleetCommit`), `await_parts`, `resume`, `restore`, `abandon_restore`, `retire`,
`forget`, `renew`, `derive_scope`; a member that refused or could not be reached fails the
operation with `FleetError`. `commit`, `await_parts` and `restore` note when each member's call
went out and its reply came back in a `MemberTimes` (what the history records of each member).

**Publication.** A checkpoint is published into a root: a directory (`CheckpointRoot`) or an
object store (`ObjectCheckpointRoot`), both a `PublicationRoot`, opened by their location's
form with `open_checkpoint_root`. A published checkpoint (`PublishedCheckpoint`) is its fleet
manifest (`FleetManifest` of `PublishedParticipant`s) and `LATEST` names the one a restore
uses; retention keeps the newest `keep` and, deferred past the resume, is a
`PendingRetention`. `verify_checkpoint` and `inspect` verify one independently
(`CheckpointSummary`, `ParticipantSummary`). Failures are `PublicationError`s:
`CheckpointConflict`, `CheckpointCorrupt`, `NoPublishedCheckpoint`, `StorageFailed`.

**Recovery.** `recover` brings a fleet whose member was replaced back to `LATEST` in place,
all or nothing, under an id derived from what it restores (`recovery_id`), so two controllers
that see the same fleet send the same calls; it returns a `Recovery` (the continued and the
restarted rollouts) or raises `RecoveryLostRace` when another controller holds the fleet;
`undo_unfinished_recovery` undoes a try that will not be repeated.

**The coordinator and its supervisor.** `Coordinator` serves the fleet rules as
`CoordinatorService` for controllers in any language; with `SupervisorSettings` (and their
`RestartStrategy`) it also checkpoints periodically and recovers the fleet by itself.

**Results exactly once.** A trainer that drives the fleet itself keeps a `ResultLedger`:
`dispatched`, then `received` (a `Receipt`, `Receipt.from_json` of a reply's
`x-rollout-receipt` header; `receipt_of_message` of a listed held result's) says whether
to persist the result (`Delivery`): its prompt
group (`group`) is persisted whole, the `HeldOutcome`s `sealed` returns in one write;
`persisted` once its store holds them, `to_acknowledge` what to send in
`ParticipantClient.acknowledge_results`, `cut` what a crash does to a group (`GroupCut`),
and `state` / `load` its versioned JSON, published with the fleet's checkpoint (a state it
would not write is a `LedgerStateError`). After a restore, `lagging` names the continued
rollouts too many policy weight versions behind (`Lagging`) for a `StalenessPolicy`, whose
`Stale` says what to do with them.

**collect.** `Collector` runs K rollouts of every task through a fleet (`CollectOptions`),
checkpointing as it goes and losing nothing to a crash, on that same ledger and staleness
rule; `rollout-checkpoint collect` is its command line.

This package imports nothing of `rollout_checkpoint.server` but its core (an import-linter
contract in pyproject.toml enforces it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_checkpoint.client.checkpointing.checkpoint import (
        CheckpointEvent,
        CheckpointOutcome,
        Phase,
        RestoredCheckpoint,
        checkpoint,
        restore_published,
    )
    from rollout_checkpoint.client.checkpointing.fanout import (
        FleetCommit,
        FleetError,
        FleetProgress,
        MemberProgress,
        MemberTimes,
        Outcome,
        abandon_restore,
        await_parts,
        commit,
        derive_scope,
        forget,
        prepare,
        prepare_until_done,
        renew,
        restore,
        resume,
        retire,
    )
    from rollout_checkpoint.client.checkpointing.publication import (
        CheckpointConflict,
        CheckpointCorrupt,
        CheckpointRoot,
        CheckpointSummary,
        FleetManifest,
        NoPublishedCheckpoint,
        ParticipantSummary,
        PendingRetention,
        PublicationError,
        PublicationRoot,
        PublishedCheckpoint,
        PublishedParticipant,
        StorageFailed,
        inspect,
        open_checkpoint_root,
        verify_checkpoint,
    )
    from rollout_checkpoint.client.checkpointing.publication.object_root import (
        ObjectCheckpointRoot,
    )
    from rollout_checkpoint.client.collect import CollectOptions, Collector
    from rollout_checkpoint.client.coordinator.service import Coordinator
    from rollout_checkpoint.client.coordinator.supervisor import (
        RestartStrategy,
        SupervisorSettings,
    )
    from rollout_checkpoint.client.errors import ControlError
    from rollout_checkpoint.client.fleet.discovery import DiscoveryError, Fleet, Member
    from rollout_checkpoint.client.fleet.launch import (
        CommandNotStarted,
        ExitedBeforeReady,
        LaunchedMember,
        LaunchError,
        NotReadyInTime,
        start_member,
    )
    from rollout_checkpoint.client.fleet.membership import Change, FleetWatch, MemberEvent
    from rollout_checkpoint.client.fleet.spec import (
        FleetConfigError,
        FleetSpec,
        MemberSpec,
        load_fleet_file,
    )
    from rollout_checkpoint.client.ledger import (
        Delivery,
        GroupCut,
        HeldOutcome,
        LedgerStateError,
        ResultLedger,
    )
    from rollout_checkpoint.client.participant import (
        ParticipantClient,
        receipt_from_header,
        receipt_of_message,
    )
    from rollout_checkpoint.client.recovery import (
        Recovery,
        RecoveryLostRace,
        recover,
        recovery_id,
        undo_unfinished_recovery,
    )
    from rollout_checkpoint.client.staleness import Lagging, Stale, StalenessPolicy, lagging
    from rollout_checkpoint.server.core.receipts import Receipt

_HOMES: dict[str, tuple[str, ...]] = {
    "rollout_checkpoint.client.errors": ("ControlError",),
    "rollout_checkpoint.client.participant": (
        "ParticipantClient",
        "receipt_from_header",
        "receipt_of_message",
        "receipt_of_message",
    ),
    "rollout_checkpoint.client.ledger": (
        "Delivery",
        "GroupCut",
        "HeldOutcome",
        "LedgerStateError",
        "ResultLedger",
    ),
    "rollout_checkpoint.server.core.receipts": ("Receipt",),
    "rollout_checkpoint.client.fleet.spec": (
        "FleetConfigError",
        "FleetSpec",
        "MemberSpec",
        "load_fleet_file",
    ),
    "rollout_checkpoint.client.fleet.discovery": ("DiscoveryError", "Fleet", "Member"),
    "rollout_checkpoint.client.fleet.membership": ("Change", "FleetWatch", "MemberEvent"),
    "rollout_checkpoint.client.fleet.launch": (
        "CommandNotStarted",
        "ExitedBeforeReady",
        "LaunchError",
        "LaunchedMember",
        "NotReadyInTime",
        "start_member",
    ),
    "rollout_checkpoint.client.checkpointing.checkpoint": (
        "CheckpointEvent",
        "CheckpointOutcome",
        "Phase",
        "RestoredCheckpoint",
        "checkpoint",
        "restore_published",
    ),
    "rollout_checkpoint.client.checkpointing.fanout": (
        "FleetCommit",
        "FleetError",
        "FleetProgress",
        "MemberProgress",
        "MemberTimes",
        "Outcome",
        "abandon_restore",
        "await_parts",
        "commit",
        "derive_scope",
        "forget",
        "prepare",
        "prepare_until_done",
        "renew",
        "restore",
        "resume",
        "retire",
    ),
    "rollout_checkpoint.client.checkpointing.publication": (
        "CheckpointConflict",
        "CheckpointCorrupt",
        "CheckpointRoot",
        "CheckpointSummary",
        "FleetManifest",
        "NoPublishedCheckpoint",
        "ParticipantSummary",
        "PendingRetention",
        "PublicationError",
        "PublicationRoot",
        "PublishedCheckpoint",
        "PublishedParticipant",
        "StorageFailed",
        "inspect",
        "open_checkpoint_root",
        "verify_checkpoint",
    ),
    "rollout_checkpoint.client.checkpointing.publication.object_root": ("ObjectCheckpointRoot",),
    "rollout_checkpoint.client.recovery": (
        "Recovery",
        "RecoveryLostRace",
        "recover",
        "recovery_id",
        "undo_unfinished_recovery",
    ),
    "rollout_checkpoint.client.coordinator.service": ("Coordinator",),
    "rollout_checkpoint.client.coordinator.supervisor": ("RestartStrategy", "SupervisorSettings"),
    "rollout_checkpoint.client.collect": ("CollectOptions", "Collector"),
    "rollout_checkpoint.client.staleness": ("Lagging", "Stale", "StalenessPolicy", "lagging"),
}
"""Where each public name lives: the module imported on the name's first use."""

_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "Change",
    "CheckpointConflict",
    "CheckpointCorrupt",
    "CheckpointEvent",
    "CheckpointOutcome",
    "CheckpointRoot",
    "CheckpointSummary",
    "CollectOptions",
    "Collector",
    "CommandNotStarted",
    "ControlError",
    "Coordinator",
    "Delivery",
    "DiscoveryError",
    "ExitedBeforeReady",
    "Fleet",
    "FleetCommit",
    "FleetConfigError",
    "FleetError",
    "FleetManifest",
    "FleetProgress",
    "FleetSpec",
    "FleetWatch",
    "GroupCut",
    "HeldOutcome",
    "Lagging",
    "LaunchError",
    "LaunchedMember",
    "LedgerStateError",
    "Member",
    "MemberEvent",
    "MemberProgress",
    "MemberSpec",
    "MemberTimes",
    "NoPublishedCheckpoint",
    "NotReadyInTime",
    "ObjectCheckpointRoot",
    "Outcome",
    "ParticipantClient",
    "ParticipantSummary",
    "PendingRetention",
    "Phase",
    "PublicationError",
    "PublicationRoot",
    "PublishedCheckpoint",
    "PublishedParticipant",
    "Receipt",
    "Recovery",
    "RecoveryLostRace",
    "RestartStrategy",
    "RestoredCheckpoint",
    "ResultLedger",
    "Stale",
    "StalenessPolicy",
    "StorageFailed",
    "SupervisorSettings",
    "abandon_restore",
    "await_parts",
    "checkpoint",
    "commit",
    "derive_scope",
    "forget",
    "inspect",
    "lagging",
    "load_fleet_file",
    "open_checkpoint_root",
    "prepare",
    "prepare_until_done",
    "receipt_from_header",
    "receipt_of_message",
    "recover",
    "recovery_id",
    "renew",
    "restore",
    "restore_published",
    "resume",
    "retire",
    "start_member",
    "undo_unfinished_recovery",
    "verify_checkpoint",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on the name's first use (PEP 562), and keep the name
    here, so the next use is a plain attribute."""
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (what `dir()`, autodoc and tab completion list), loaded or not."""
    return list(__all__)
