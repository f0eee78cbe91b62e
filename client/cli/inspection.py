"""`inspect`: verify a published checkpoint directory completely, following `LATEST` from
a checkpoint root, and saying what a directory is when it holds no published checkpoint."""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointSummary,
    NoPublishedCheckpoint,
    store_call_sync,
    verify_checkpoint,
)
from rollout_checkpoint.client.checkpointing.publication.object_root import verify_object_checkpoint
from rollout_checkpoint.client.cli.console import CliError, ExitCode
from rollout_checkpoint.client.collect.journal import DISPATCH_LOG
from rollout_checkpoint.server.core.layout import FLEET_MANIFEST_NAME, LATEST_NAME, PARTICIPANTS_DIR
from rollout_checkpoint.server.core.object_store import is_object_url


def inspect_verb(args: argparse.Namespace) -> int:
    """Verify `args.directory` (or the checkpoint its `LATEST` names) and print the summary.

    `CliError` (exit 2) for a missing directory or one that holds no published checkpoint;
    `CheckpointCorrupt` (exit 6) when it does not verify; `StorageFailed` (exit 4) when the
    store fails or has not answered `args.timeout` seconds from now (a frozen filesystem, a
    hung object store: the verification runs on a thread that is abandoned then)."""
    deadline = time.time() + args.timeout
    summary, note = store_call_sync(
        deadline, args.directory, functools.partial(_verify, args.directory)
    )
    if args.json:
        print(json.dumps(summary.to_json(), sort_keys=True))
    else:
        if note:
            print(note)
        print(summary.format_text())
    return ExitCode.OK


def _verify(location: str) -> tuple[CheckpointSummary, str | None]:
    """The verified summary of the checkpoint at `location` (or the one its LATEST names)
    and a note saying which, when it followed LATEST. Blocks on the store."""
    if is_object_url(location):
        return _verify_url(location)
    directory = Path(location)
    if not directory.exists():
        raise CliError(ExitCode.USAGE, f"{directory}: no such directory")
    if not directory.is_dir():
        raise CliError(ExitCode.USAGE, f"{directory}: not a directory")
    note = None
    if not (directory / FLEET_MANIFEST_NAME).exists():
        directory, note = _what_directory_is(directory)
    return verify_checkpoint(directory), note


def _verify_url(url: str) -> tuple[CheckpointSummary, str | None]:
    """`inspect s3://…`: the checkpoint below the URL, or the one its LATEST names. A URL that
    is not a valid location is a usage error; one holding nothing published says so."""
    try:
        return verify_object_checkpoint(url)
    except ValueError as exc:
        raise CliError(ExitCode.USAGE, f"{url}: {exc}") from None
    except NoPublishedCheckpoint as exc:
        raise CliError(ExitCode.USAGE, str(exc)) from None


def _what_directory_is(directory: Path) -> tuple[Path, str | None]:
    """Follow `LATEST` from a checkpoint root (or a collect --checkpoint-dir); refuse, saying
    what it is, a directory that holds no published checkpoint."""
    latest = directory / LATEST_NAME
    collect_dir = (directory / DISPATCH_LOG).exists()
    what = "a collect --checkpoint-dir" if collect_dir else "a checkpoint root"
    if latest.is_file():
        checkpoint_id = latest.read_text().strip()
        return directory / checkpoint_id, f"{directory} is {what}: LATEST names {checkpoint_id}"
    if collect_dir:
        raise CliError(
            ExitCode.USAGE,
            f"{directory} is a collect --checkpoint-dir with no published checkpoint yet (no "
            f"{LATEST_NAME})",
        )
    if (directory / PARTICIPANTS_DIR).is_dir():
        parts = sorted(
            f"{kind.name}/{instance.name}"
            for kind in (directory / PARTICIPANTS_DIR).iterdir()
            if kind.is_dir()
            for instance in kind.iterdir()
        )
        raise CliError(
            ExitCode.USAGE,
            f"{directory} holds committed parts ({', '.join(parts) or 'none'}) but no "
            f"{FLEET_MANIFEST_NAME}: a participant commit that was never published as a fleet "
            "checkpoint (`checkpoint` publishes; `commit` alone does not)",
        )
    return directory, None
