"""Operators' verbs over a whole fleet (`--fleet FILE` or `--address HOST:PORT ...`).

Exit codes (also in the README):

    0  done
    2  usage or configuration error
    3  the fleet did not get prepared by the deadline (the checkpoint was not taken)
    4  refused: a participant (or the coordinator) decided against the call
    5  unreachable: a participant could not be reached
    6  corrupt checkpoint: a manifest, digest or record does not verify
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rollout_checkpoint.client import coordination
from rollout_checkpoint.client.checkpointing import (
    CheckpointEvent,
    Phase,
    checkpoint,
    restore_published,
)
from rollout_checkpoint.client.coordination import DERIVE, FleetError, FleetProgress
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import (
    KIND_NAMES,
    DiscoveryError,
    Fleet,
    FleetConfigError,
    FleetSpec,
    load_fleet_file,
)
from rollout_checkpoint.client.publication import (
    CheckpointCorrupt,
    CheckpointRoot,
    NoPublishedCheckpoint,
    PublicationError,
    verify_checkpoint,
)
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.v1 import types_pb2

EXIT_OK, EXIT_USAGE, EXIT_NOT_PREPARED, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_CORRUPT = (
    0,
    2,
    3,
    4,
    5,
    6,
)
TOKEN_ENV = "ROLLOUT_CHECKPOINT_TOKEN"
STATE_PREFIX = "PARTICIPANT_STATE_"


def state_name(state: int, unknown: str) -> str:
    """A participant state's name in types.proto without its prefix (`IDLE`); `unknown` for
    UNSPECIFIED and for a value this version does not know."""
    if state == types_pb2.PARTICIPANT_STATE_UNSPECIFIED:
        return unknown
    try:
        return types_pb2.ParticipantState.Name(state).removeprefix(STATE_PREFIX)  # type: ignore[arg-type]
    except ValueError:
        return unknown


FLEET_VERBS = (
    "status",
    "prepare",
    "commit",
    "checkpoint",
    "restore",
    "resume",
    "retire",
    "forget",
    "renew",
)


def add_fleet_verbs(verbs: Any) -> None:
    """Register the fleet verbs, `inspect` and `coordinator` on the CLI's subparsers."""

    def fleet_verb(
        name: str, help_text: str, *, checkpoint_id: bool = True
    ) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = verbs.add_parser(name, help=help_text)
        where = sub.add_mutually_exclusive_group(required=True)
        where.add_argument("--fleet", type=Path, help="fleet file (TOML or YAML)")
        where.add_argument(
            "--address", action="append", help="a participant's sidecar HOST:PORT (repeat)"
        )
        sub.add_argument(
            "--token-file", type=Path, help=f"bearer token file (with --address; else ${TOKEN_ENV})"
        )
        sub.add_argument(
            "--json", action="store_true", help="machine-readable output, one JSON object per line"
        )
        if checkpoint_id:
            sub.add_argument("checkpoint_id", nargs="?" if name == "checkpoint" else None)
            sub.add_argument(
                "--timeout", type=float, default=120.0, help="seconds from now to the deadline"
            )
        return sub

    fleet_verb(
        "status", "every member's state, admission, readiness and lease", checkpoint_id=False
    )
    fleet_verb("prepare", "prepare stage by stage, with live progress")
    for name in ("commit", "checkpoint"):
        sub = fleet_verb(
            name, "commit every member" if name == "commit" else "prepare, commit, publish, resume"
        )
        if name == "commit":
            sub.add_argument("--dir", required=True, help="absolute checkpoint directory")
        else:
            sub.add_argument(
                "--root", help="checkpoint root (default: the fleet file's checkpoint_root)"
            )
            sub.add_argument(
                "--keep-closed", action="store_true", help="leave the fleet closed afterwards"
            )
            sub.add_argument("--keep", type=int, default=None, help="published checkpoints kept")
        scope = sub.add_mutually_exclusive_group()
        scope.add_argument(
            "--episode",
            action="append",
            type=EpisodeId.from_capture_key,
            help="an episode in scope (repeat)",
        )
        scope.add_argument(
            "--unscoped", action="store_true", help="every member commits all its live episodes"
        )
    sub = fleet_verb("restore", "restore a published checkpoint, all or nothing")
    sub.add_argument("--root", help="checkpoint root (default: the fleet file's checkpoint_root)")
    sub.add_argument("--source", default="LATEST", help="published checkpoint id (default LATEST)")
    sub.add_argument(
        "--episode",
        action="append",
        type=EpisodeId.from_capture_key,
        help="continue only these (repeat)",
    )
    fleet_verb("resume", "resume (or abort) on every member, in reverse stage order")
    sub = fleet_verb("retire", "retire attempts on every member, callers first")
    sub.add_argument("episodes", nargs="+", type=EpisodeId.from_capture_key)
    sub = fleet_verb("forget", "forget retired rollouts on every member, callers first")
    sub.add_argument("rollout_ids", nargs="+")
    fleet_verb("renew", "renew the lease on every member")
    sub = verbs.add_parser(
        "inspect", help="verify every manifest and digest of a checkpoint directory"
    )
    sub.add_argument("directory", type=Path)
    sub.add_argument("--json", action="store_true")
    sub = verbs.add_parser("coordinator", help="serve CoordinatorService for a fleet")
    sub.add_argument("--fleet", type=Path, required=True)
    sub.add_argument("--grpc-address", default="127.0.0.1:0")
    sub.add_argument("--reflection", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "coordinator":
            return asyncio.run(_coordinator(args))
        return asyncio.run(_fleet_command(args))
    except (FleetConfigError, ValueError) as error:
        return _fail(args, EXIT_USAGE, "usage", str(error))
    except DiscoveryError as error:
        refused = error.refused  # e.g. a wrong token: waiting will not help
        return _fail(
            args,
            EXIT_REFUSED if refused else EXIT_UNREACHABLE,
            Reason.PARTICIPANT_FAILED if refused else Reason.PARTICIPANT_UNREACHABLE,
            str(error),
            {"failures": error.failures},
        )
    except FleetError as error:
        code = EXIT_UNREACHABLE if error.reason == Reason.PARTICIPANT_UNREACHABLE else EXIT_REFUSED
        return _fail(
            args,
            code,
            error.reason,
            str(error),
            {"failures": coordination.describe_failures(error)},
        )
    except ControlError as error:
        code = EXIT_REFUSED if error.decided_by_server else EXIT_UNREACHABLE
        return _fail(args, code, error.reason or Reason.PARTICIPANT_UNREACHABLE, error.message)
    except CheckpointCorrupt as error:
        return _fail(args, EXIT_CORRUPT, Reason.INVALID_CHECKPOINT_STATE, str(error))
    except (NoPublishedCheckpoint, PublicationError) as error:
        return _fail(args, EXIT_REFUSED, Reason.INVALID_CHECKPOINT_STATE, str(error))


def _fail(
    args: argparse.Namespace,
    code: int,
    reason: str,
    message: str,
    extra: dict[str, Any] | None = None,
) -> int:
    payload = {"error": {"reason": reason, "message": message, **(extra or {})}}
    if getattr(args, "json", False):
        print(json.dumps(payload, sort_keys=True))
    else:
        print(f"rollout-checkpoint: {reason}: {message}", file=sys.stderr)
    return code


def _spec(args: argparse.Namespace) -> FleetSpec:
    if args.fleet is not None:
        return load_fleet_file(args.fleet)
    token = (
        args.token_file.read_text().strip() if args.token_file else os.environ.get(TOKEN_ENV, "")
    )
    if not token:
        raise FleetConfigError(f"no token: pass --token-file or set ${TOKEN_ENV}")
    return FleetSpec.from_addresses(args.address, token, allow_agents_without_model=True)


def _root(args: argparse.Namespace, spec: FleetSpec) -> CheckpointRoot:
    root = getattr(args, "root", None) or spec.checkpoint_root
    if root is None:
        raise FleetConfigError(
            "no checkpoint root: pass --root or set checkpoint_root in the fleet file"
        )
    return CheckpointRoot(root)


async def _fleet_command(args: argparse.Namespace) -> int:
    spec = _spec(args)
    async with await Fleet.discover(spec) as fleet:
        deadline = time.time() + getattr(args, "timeout", 0.0)
        command = args.command
        if command == "status":
            return await _status(args, fleet)
        if command == "prepare":
            view = ProgressView(args.json)
            with view:
                last = await coordination.prepare_until_done(
                    fleet, args.checkpoint_id, deadline, view.update
                )
            view.final(last)
            return EXIT_OK if last.prepared else EXIT_NOT_PREPARED
        if command == "commit":
            result = await coordination.commit(
                fleet, args.checkpoint_id, deadline, args.dir, _scope(args)
            )
            _emit(
                args,
                {
                    n: MessageToDict(r, preserving_proto_field_name=True)
                    for n, r in result.members.items()
                },
            )
            return EXIT_OK
        if command == "checkpoint":
            return await _checkpoint(args, fleet, spec, deadline)
        if command == "restore":
            restored = await restore_published(
                fleet,
                _root(args, spec),
                args.checkpoint_id,
                deadline,
                source=args.source,
                scope=args.episode,
            )
            _emit(
                args,
                {
                    "source_checkpoint_id": restored.source_checkpoint_id,
                    "restored": {n: list(r.restored) for n, r in restored.replies.items()},  # type: ignore[attr-defined]
                    "next": "resume with the same id once the fleet should serve",
                },
            )
            return EXIT_OK
        if command == "resume":
            replies = await coordination.resume(fleet, args.checkpoint_id, deadline)
            _emit(args, {n: {"idempotent": r.idempotent} for n, r in replies.items()})
        elif command == "retire":
            await coordination.retire(fleet, args.checkpoint_id, deadline, args.episodes)
            _emit(args, {"retired": [e.capture_key for e in args.episodes]})
        elif command == "forget":
            await coordination.forget(fleet, args.checkpoint_id, deadline, args.rollout_ids)
            _emit(args, {"forgotten": sorted(set(args.rollout_ids))})
        elif command == "renew":
            earliest = await coordination.renew(fleet, args.checkpoint_id, deadline)
            _emit(args, {"lease_expires_at": earliest})
        return EXIT_OK


def _scope(args: argparse.Namespace) -> list[EpisodeId] | str | None:
    if args.unscoped:
        return None
    if args.episode:
        return list(args.episode)
    return DERIVE


async def _status(args: argparse.Namespace, fleet: Fleet) -> int:
    statuses = await asyncio.gather(*(m.client.get_status() for m in fleet.members))
    rows: list[dict[str, Any]] = []
    for member, status in zip(fleet.members, statuses, strict=True):
        rows.append(
            {
                "name": member.name,
                "kind": member.kind_name,
                "instance": member.instance,
                "address": member.address,
                "state": state_name(status.state, "?"),
                "checkpoint_id": status.checkpoint_id,
                "admission_open": status.admission_open,
                "ready": status.readiness.ready,
                "blockers": status.readiness.blocker_count,
                "counts": dict(status.readiness.counts),
                "retired_rollouts": status.retired_rollouts,
                "restored_pending": status.restored_pending,
                "lease_expires_at": status.lease_expires_at.ToNanoseconds() / 1e9
                if status.HasField("lease_expires_at")
                else None,
            }
        )
    if args.json:
        print(json.dumps({"members": rows}, sort_keys=True))
        return EXIT_OK
    table = Table(title="fleet status")
    for column in (
        "name",
        "kind",
        "instance",
        "state",
        "checkpoint",
        "admission",
        "ready",
        "blockers",
        "counts",
    ):
        table.add_column(column)
    for row in rows:
        counts = " ".join(f"{k}={v}" for k, v in sorted(row["counts"].items()))
        table.add_row(
            row["name"],
            row["kind"],
            row["instance"],
            row["state"],
            row["checkpoint_id"] or "-",
            "open" if row["admission_open"] else "closed",
            "yes" if row["ready"] else "no",
            str(row["blockers"]),
            counts,
        )
    Console().print(table)
    return EXIT_OK


async def _checkpoint(
    args: argparse.Namespace, fleet: Fleet, spec: FleetSpec, deadline: float
) -> int:
    view = ProgressView(args.json)
    outcome = None
    with view:
        async for event in checkpoint(
            fleet,
            _root(args, spec),
            deadline,
            checkpoint_id=args.checkpoint_id,
            scope=_scope(args),
            keep=args.keep or spec.keep,
            keep_closed=args.keep_closed,
        ):
            view.event(event)
            outcome = event.outcome
    assert outcome is not None
    result = {
        "checkpoint_id": outcome.checkpoint_id,
        "prepare_outcome": outcome.prepare_outcome,
        "published": outcome.published is not None,
        "directory": str(outcome.published.directory) if outcome.published else None,
        "records": outcome.record_count,
        "bytes": outcome.bytes,
        "continued": [e.capture_key for e in outcome.continued],
        "seconds": {
            "prepare": outcome.prepare_seconds,
            "commit": outcome.commit_seconds,
            "publish": outcome.publish_seconds,
        },
    }
    if outcome.published is None and outcome.progress is not None:
        result["blockers"] = [
            {"member": m, "capture_key": b.capture_key, "detail": b.detail}
            for m, b in outcome.progress.blockers()
        ]
    _emit(args, {"result": result})
    return EXIT_OK if outcome.published is not None else EXIT_NOT_PREPARED


def _inspect(args: argparse.Namespace) -> int:
    try:
        summary = verify_checkpoint(args.directory)
    except CheckpointCorrupt as error:
        return _fail(args, EXIT_CORRUPT, Reason.INVALID_CHECKPOINT_STATE, str(error))
    if args.json:
        print(json.dumps(summary.to_json(), sort_keys=True))
    else:
        print(summary.format_text())
    return EXIT_OK


async def _coordinator(args: argparse.Namespace) -> int:
    from rollout_checkpoint.client.coordinator.service import Coordinator

    spec = load_fleet_file(args.fleet)
    coordinator = Coordinator(spec, args.grpc_address, reflection_enabled=args.reflection)

    def announce(server: Coordinator) -> None:
        host = args.grpc_address.rsplit(":", 1)[0]
        print(
            json.dumps(
                {"grpc": f"{host}:{server.port}", "pid": os.getpid(), "members": len(spec.members)}
            ),
            flush=True,
        )

    await coordinator.serve_forever(on_started=announce)
    return EXIT_OK


def _emit(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(payload, sort_keys=True, default=str))
    else:
        Console().print_json(json.dumps(payload, default=str))


class ProgressView:
    """Live progress: a rich table on a terminal, JSON lines with --json, plain lines else."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.console = Console(stderr=True)
        self.live: Live | None = None
        self.phase = Phase.PREPARE
        if not as_json and self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=10, transient=False)

    def __enter__(self) -> ProgressView:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def event(self, event: CheckpointEvent) -> None:
        self.phase = event.phase
        if event.progress is not None and event.phase == Phase.PREPARE:
            self.update(event.progress)
        elif self.as_json:
            print(
                json.dumps({"phase": event.phase, **{k: v for k, v in event.detail.items()}}),
                flush=True,
            )
        elif self.live is None:
            print(
                f"{event.phase.lower()} {json.dumps(event.detail) if event.detail else ''}".rstrip(),
                file=sys.stderr,
            )

    def update(self, progress: FleetProgress) -> None:
        if self.as_json:
            print(json.dumps(_progress_json(progress), sort_keys=True), flush=True)
        elif self.live is not None:
            self.live.update(_progress_table(progress, self.phase))
        elif progress.outcome is not None:
            print(
                f"prepare {progress.outcome}: {progress.blocker_count()} blocker(s)",
                file=sys.stderr,
            )

    def final(self, progress: FleetProgress) -> None:
        if not self.as_json and self.live is None:
            for member, blocker in progress.blockers():
                print(f"  {member}: {blocker.capture_key or '-'} {blocker.detail}", file=sys.stderr)


def _progress_json(progress: FleetProgress) -> dict[str, Any]:
    return {
        "phase": "PREPARE",
        "stage": KIND_NAMES.get(progress.stage, "?"),
        "sequence": progress.sequence,
        "elapsed": round(progress.elapsed, 6),
        "outcome": progress.outcome,
        "blocker_count": progress.blocker_count(),
        "members": [
            {
                "name": m.name,
                "reached": m.reached,
                "state": state_name(m.state, "-"),
                "blockers": m.readiness.blocker_count,
            }
            for m in progress.members
        ],
    }


def _progress_table(progress: FleetProgress, phase: str) -> Table:
    title = (
        f"{phase.lower()} — stage {KIND_NAMES.get(progress.stage, '?')} — {progress.elapsed:.2f}s"
    )
    if progress.outcome:
        title += f" — {progress.outcome}"
    table = Table(title=title)
    for column in ("member", "kind", "state", "blockers", "first blockers"):
        table.add_column(column)
    for member in progress.members:
        first = ", ".join(b.capture_key or "-" for b in list(member.readiness.blockers)[:3])
        state = state_name(member.state, "-") if member.reached else "not reached"
        table.add_row(
            member.name,
            KIND_NAMES.get(member.kind, "?"),
            state,
            str(member.readiness.blocker_count),
            first,
        )
    return table


def is_fleet_command(name: str) -> bool:
    return name in FLEET_VERBS or name in ("inspect", "coordinator")
