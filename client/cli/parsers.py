"""The fleet verbs' argument parsers and help: one description, example and notes per
verb, and the exit-code table in every epilog (`console.epilog`), so `--help` is enough
without the README."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.cli.console import HelpFormatter, add_output_flags, epilog
from rollout_checkpoint.client.cli.names import EPISODE_FORMAT, TOKEN_ENV, episode_arg
from rollout_checkpoint.client.participant import LIVENESS_HEALTH, READINESS_HEALTH

INSPECT_TIMEOUT_SECONDS = 120.0
"""`inspect --timeout`'s default: the fleet verbs' own. Verifying hashes every record, so a
checkpoint of many GB on a slow disk may need more; a store that hangs is reported then."""

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

_VERBS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    # name: (one-line help, description, example, notes)
    "status": (
        "every member's state, admission, readiness and lease",
        "Show every member: state, active checkpoint, admission, readiness (the "
        f"`{READINESS_HEALTH}` health answer: may new traffic come here?), prepare blockers and "
        "lease, and the last part it published (records written, records referenced in "
        "earlier parts, chain length). A member that cannot be reached is a row saying so "
        "(and the exit code is 5).",
        "rollout-checkpoint status --fleet fleet.toml",
        (),
    ),
    "prepare": (
        "prepare stage by stage, with live progress",
        "Prepare every member stage by stage (environment, model, agent, resources) and stop at "
        "the first stage not prepared by the deadline. Leaves the fleet prepared (closed) for a "
        "`commit`; interrupted, it resumes the fleet.",
        "rollout-checkpoint prepare --fleet fleet.toml ckpt-7",
        ("checkpoint_id: the id of the checkpoint this prepare opens.",),
    ),
    "commit": (
        "commit every member into a directory",
        "Commit every prepared member into one checkpoint directory (not published: use "
        "`checkpoint` for the whole sequence).",
        "rollout-checkpoint commit --fleet fleet.toml ckpt-7 --dir /checkpoints/ckpt-7",
        ("checkpoint_id: the id a previous `prepare` opened.", EPISODE_FORMAT),
    ),
    "checkpoint": (
        "prepare, commit, publish, resume",
        "Take and publish one checkpoint of the fleet: prepare with live progress, commit, "
        "publish (`checkpoint.json`, then `LATEST`), resume. Prints one summary line; `-v` or "
        "`--json` for the details. Interrupted (Ctrl-C, SIGTERM) it aborts: every member resumes.",
        "rollout-checkpoint checkpoint --fleet fleet.toml",
        (
            "checkpoint_id: the new checkpoint's id (default: ckpt-<UTC time>-<8 hex>).",
            EPISODE_FORMAT,
        ),
    ),
    "restore": (
        "restore a published checkpoint, all or nothing",
        "Verify a published checkpoint whole, then restore it into fresh processes started "
        "closed (with --rejoin: also into survivors that have served), all or nothing. The "
        "fleet stays closed until `resume` with the same id.",
        "rollout-checkpoint restore --fleet fleet.toml restore-1",
        (
            "checkpoint_id: the id of this restore operation (a new id, resumed later), not the "
            "published checkpoint: that is --source.",
            EPISODE_FORMAT,
        ),
    ),
    "resume": (
        "resume (or abort) on every member, in reverse stage order",
        "Reopen every member (Resume), in reverse stage order: ends a checkpoint, aborts one "
        "in progress, or opens a restored fleet.",
        "rollout-checkpoint resume --fleet fleet.toml restore-1",
        (
            "checkpoint_id: the id of the operation to end: a checkpoint's id, or the id given "
            "to `restore`.",
        ),
    ),
    "retire": (
        "retire attempts on every member, callers first",
        "Retire episode attempts everywhere (callers before callees); each also retires the "
        "earlier attempts of its rollout.",
        "rollout-checkpoint retire --fleet fleet.toml restore-1 r7-a2",
        ("checkpoint_id: in IDLE any valid id; while RESTORED the restore's id.", EPISODE_FORMAT),
    ),
    "forget": (
        "forget retired rollouts on every member, callers first",
        "Drop the retired-attempt marks of rollouts everywhere (callers before callees).",
        "rollout-checkpoint forget --fleet fleet.toml cleanup-1 r7",
        ("checkpoint_id: in IDLE any valid id.",),
    ),
    "renew": (
        "renew the lease on every member",
        "Renew the active checkpoint's lease everywhere; prints the earliest expiry (RFC 3339).",
        "rollout-checkpoint renew --fleet fleet.toml ckpt-7",
        ("checkpoint_id: the active checkpoint's id.",),
    ),
}


def add_fleet_verbs(verbs: Any) -> None:
    """Register the fleet verbs, `health`, `inspect` and `coordinator` on the CLI's
    subparsers."""

    def fleet_verb(name: str, *, checkpoint_id: bool = True) -> argparse.ArgumentParser:
        help_text, description, example, notes = _VERBS[name]
        sub: argparse.ArgumentParser = verbs.add_parser(
            name,
            help=help_text,
            description=description,
            epilog=epilog(example, *notes),
            formatter_class=HelpFormatter,
        )
        where = sub.add_mutually_exclusive_group(required=True)
        where.add_argument("--fleet", type=Path, help="fleet file (TOML or YAML)")
        where.add_argument(
            "--address", action="append", help="a participant's sidecar HOST:PORT (repeat)"
        )
        sub.add_argument(
            "--token-file", type=Path, help=f"bearer token file (with --address; else ${TOKEN_ENV})"
        )
        add_output_flags(sub)
        if checkpoint_id:
            sub.add_argument(
                "checkpoint_id",
                nargs="?" if name == "checkpoint" else None,
                help="see below",
            )
            sub.add_argument(
                "--timeout",
                type=float,
                default=120.0,
                help="seconds from now to the operation's deadline",
            )
        return sub

    fleet_verb("status", checkpoint_id=False)
    fleet_verb("prepare")
    for name in ("commit", "checkpoint"):
        sub = fleet_verb(name)
        if name == "commit":
            sub.add_argument("--dir", required=True, help="absolute checkpoint directory")
        else:
            sub.add_argument(
                "--root", help="checkpoint root (default: the fleet file's checkpoint_root)"
            )
            sub.add_argument(
                "--keep-closed", action="store_true", help="leave the fleet closed afterwards"
            )
            sub.add_argument(
                "--keep",
                type=int,
                default=None,
                help="published checkpoints kept (default: the fleet file's keep, else 2)",
            )
        scope = sub.add_mutually_exclusive_group()
        scope.add_argument(
            "--episode",
            action="append",
            type=episode_arg,
            help="an episode in scope (repeat; default: every member's live episodes)",
        )
        scope.add_argument(
            "--unscoped", action="store_true", help="every member commits all its live episodes"
        )
    sub = fleet_verb("restore")
    sub.add_argument("--root", help="checkpoint root (default: the fleet file's checkpoint_root)")
    sub.add_argument("--source", default="LATEST", help="the published checkpoint's id")
    sub.add_argument(
        "--episode",
        action="append",
        type=episode_arg,
        help="continue only these (repeat; default: every episode the checkpoint continues)",
    )
    sub.add_argument(
        "--rejoin",
        action="store_true",
        help="members may have served (the survivors of a crash whose crashed member was "
        "replaced): each first retires every episode it holds",
    )
    fleet_verb("resume")
    sub = fleet_verb("retire")
    sub.add_argument("episodes", nargs="+", type=episode_arg, help="rollout ids or capture keys")
    sub = fleet_verb("forget")
    sub.add_argument("rollout_ids", nargs="+", help="rollout ids")
    fleet_verb("renew")
    _add_health_verb(verbs)
    sub = verbs.add_parser(
        "inspect",
        help="verify every manifest and digest of a checkpoint directory",
        description="Verify a published checkpoint completely (fleet manifest, every part's "
        "manifest, digest, record count and size). Given a checkpoint root (or a collect "
        "--checkpoint-dir), inspects the checkpoint its LATEST names.",
        epilog=epilog("rollout-checkpoint inspect /checkpoints/run-7"),
        formatter_class=HelpFormatter,
    )
    sub.add_argument(
        "directory",
        help="a checkpoint directory or a checkpoint root (a path, or s3://bucket/prefix)",
    )
    sub.add_argument("--json", action="store_true", help="machine-readable output, one JSON object")
    sub.add_argument(
        "--timeout",
        type=float,
        default=INSPECT_TIMEOUT_SECONDS,
        help="seconds from now until a store that has not answered is STORAGE_FAILED "
        "(exit 4): a frozen filesystem or a hung object store",
    )
    _add_history_verb(verbs)
    sub = verbs.add_parser(
        "coordinator",
        help="serve CoordinatorService for a fleet",
        description="Serve rollout_checkpoint.v1.CoordinatorService for one fleet: the fleet "
        "verbs as typed RPCs for controllers in any language. Prints one JSON line "
        "(`grpc`, `pid`, `members`, `health` with --health-address and `http` with "
        "--http-address) once it listens; "
        "SIGTERM stops it.",
        epilog=epilog(
            "rollout-checkpoint coordinator --fleet fleet.toml --grpc-address 0.0.0.0:9100"
        ),
        formatter_class=HelpFormatter,
    )
    sub.add_argument("--fleet", type=Path, required=True, help="fleet file (TOML or YAML)")
    sub.add_argument(
        "--grpc-address",
        default="127.0.0.1:0",
        help="HOST:PORT to serve on (port 0 picks a free one)",
    )
    sub.add_argument(
        "--health-address",
        default=None,
        help="HOST:PORT of a plaintext port serving gRPC health only, even with TLS on "
        "--grpc-address (Kubernetes' native grpc: probes cannot speak TLS); announced as "
        "`health` (default: none)",
    )
    sub.add_argument(
        "--http-address",
        default=None,
        help="HOST:PORT of an HTTP port serving the checkpoint history and the fleet as JSON "
        "(GET /checkpoints, /checkpoints/latest, /checkpoints/ID, /fleet), behind the same "
        "bearer token, HTTPS with the --tls-* files; announced as `http` (default: none)",
    )
    sub.add_argument(
        "--reflection", action="store_true", help="serve gRPC server reflection (for grpcurl)"
    )
    tls = sub.add_argument_group(
        "TLS",
        "Serve the coordinator's port over TLS (plaintext is for loopback and tests: every call "
        "carries the fleet's token). Independent of the fleet file's tls_* settings, which are "
        "how the coordinator dials the members.",
    )
    tls.add_argument(
        "--tls-cert-file", type=Path, metavar="PEM", help="the server's certificate chain"
    )
    tls.add_argument("--tls-key-file", type=Path, metavar="PEM", help="its private key")
    tls.add_argument(
        "--tls-client-ca-file",
        type=Path,
        metavar="PEM",
        help="require client certificates signed by this CA (mutual TLS)",
    )
    sub.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="what the coordinator logs to stderr (info: members up, down and replaced, "
        "checkpoints, recoveries)",
    )
    supervise = sub.add_argument_group(
        "supervision",
        "With --supervise the coordinator also takes checkpoints by itself and, when a member "
        "is replaced (a new boot id), restores the whole fleet from LATEST and reopens it; a "
        "fresh fleet (no LATEST yet) is only opened. WatchFleet streams what it does.",
    )
    supervise.add_argument(
        "--supervise", action="store_true", help="checkpoint periodically and recover by itself"
    )
    supervise.add_argument(
        "--checkpoint-every",
        type=_non_negative_seconds,
        default=300.0,
        metavar="SECONDS",
        help="seconds between checkpoints; 0: never checkpoint, only recover",
    )
    supervise.add_argument(
        "--checkpoint-deadline",
        type=_positive_seconds,
        default=120.0,
        metavar="SECONDS",
        help="deadline of one checkpoint (prepare, commit, publish)",
    )
    supervise.add_argument(
        "--recovery-deadline",
        type=_positive_seconds,
        default=120.0,
        metavar="SECONDS",
        help="deadline of one recovery try, including the wait for members that are down",
    )
    supervise.add_argument(
        "--max-recoveries",
        type=positive_int,
        default=3,
        metavar="N",
        help="recovery tries allowed within --recovery-window; one more gives up",
    )
    supervise.add_argument(
        "--recovery-window",
        type=_positive_seconds,
        default=600.0,
        metavar="SECONDS",
        help="the window --max-recoveries counts in",
    )
    supervise.add_argument(
        "--recovery-backoff",
        type=_positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="wait after a failed try, doubled after each further one (at most 30 s)",
    )


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a number of seconds, 0 or more")
    return value


def positive_int(text: str) -> int:
    """A flag's value that must be an integer of 1 or more (argparse makes the error usage)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _add_history_verb(verbs: Any) -> None:
    sub = verbs.add_parser(
        "history",
        help="every checkpoint and restore attempted in a checkpoint root, newest first",
        description="Read the checkpoint history kept in a checkpoint root (no coordinator "
        "needed): one row per checkpoint or restore any coordinator, supervisor, `checkpoint` "
        "or `collect` of that root attempted, newest first, with its trigger, mode, status, "
        "duration, bytes and, for one that failed, the typed reason and the members that "
        "caused it; `--id` shows one attempt member by member. A corrupt history is reported "
        "in one line (exit 6).",
        epilog=epilog("rollout-checkpoint history --root /checkpoints/run-7 --failed"),
        formatter_class=HelpFormatter,
    )
    sub.add_argument(
        "--root", required=True, help="the checkpoint root (a path, or s3://bucket/prefix)"
    )
    sub.add_argument("--json", action="store_true", help="machine-readable output, one JSON object")
    sub.add_argument(
        "--failed", action="store_true", help="only the attempts that did not complete"
    )
    sub.add_argument(
        "--limit", type=positive_int, default=None, metavar="N", help="at most N entries"
    )
    sub.add_argument(
        "--id",
        default=None,
        metavar="ID",
        help="one attempt (its newest, if retried) with its members: each one's prepare, "
        "commit, durable part or restore seconds, blockers, records, bytes and error",
    )
    sub.add_argument(
        "--timeout",
        type=float,
        default=INSPECT_TIMEOUT_SECONDS,
        help="seconds from now until a store that has not answered is STORAGE_FAILED (exit 4)",
    )


def _add_health_verb(verbs: Any) -> None:
    sub = verbs.add_parser(
        "health",
        help="gRPC health Check of a participant (no token needed)",
        description="Ask a sidecar's grpc.health.v1.Health for each of its names: "
        f"`{READINESS_HEALTH}` (may new traffic come here?), `{LIVENESS_HEALTH}` (restart "
        'me?) and the whole server (`""`). Exit 0 when every asked name is SERVING, 4 when '
        "one is not, 5 when the sidecar cannot be reached.",
        epilog=epilog(
            f"rollout-checkpoint health --address 127.0.0.1:9001 --service {READINESS_HEALTH}"
        ),
        formatter_class=HelpFormatter,
    )
    sub.add_argument("--address", required=True, help="the participant's sidecar HOST:PORT")
    sub.add_argument(
        "--service",
        action="append",
        default=None,
        help=f"a health name (repeat; default: {READINESS_HEALTH}, {LIVENESS_HEALTH} and the server)",
    )
    sub.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for the sidecar to answer (a server still starting)",
    )
    sub.add_argument("--tls-ca-file", type=Path, default=None, help="CA for a TLS sidecar")
    sub.add_argument("--json", action="store_true", help="machine-readable output, one JSON object")
