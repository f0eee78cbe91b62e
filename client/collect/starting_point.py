"""What a run starts from, read before anything touches the fleet.

Every read here can refuse the run, and each must do so while the fleet is still as the last
run left it:

* **An `--output` that cannot be appended to fails first** (`OutputFailed`), before the input
  is read or the store opened: a run that could not record its rollouts must not retire or
  restore anything.
* **The checkpoint store is read before anything else touches the fleet, bounded as a
  checkpoint is** (`--checkpoint-timeout`): a store that hangs is `StorageFailed` at that
  deadline, not a wait on the store client's own timeout or a frozen filesystem's thaw.
* **`--resume` reads the output, the dispatch log and `LATEST`** (`journal.read_previous`,
  torn last lines cut off and said so): `resume.FleetSetup` sets the fleet up from them, so a
  crash of the collector alone costs no rollout its progress.
* **A fresh run next to an old one is refused** (`UsageError`): it would mix two
  collections' attempts and lines.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout_checkpoint.client.checkpointing.publication import (
    PublicationRoot,
    open_checkpoint_root,
    store_call,
)
from rollout_checkpoint.client.collect.errors import UsageError
from rollout_checkpoint.client.collect.inputs import load_input
from rollout_checkpoint.client.collect.journal import (
    Previous,
    check_appendable,
    dispatch_log_path,
    persisted_in,
    read_previous,
)
from rollout_checkpoint.client.collect.options import CollectOptions
from rollout_checkpoint.client.collect.rollouts import RolloutBook
from rollout_checkpoint.client.collect.view import CollectView, Counts
from rollout_checkpoint.client.ledger import ResultLedger


@dataclass(frozen=True)
class StartingPoint:
    """The input, the store and what a previous run left, as a run starts from them."""

    book: RolloutBook
    """Every rollout of the input, those already in the output applied."""
    input_digest: str
    root: PublicationRoot
    log_path: Path
    """The dispatch log."""
    previous: Previous
    """What the previous run left (nothing on a fresh run)."""


async def read_starting_point(
    options: CollectOptions,
    counts: Counts,
    view: CollectView,
    crash_hook: Callable[[str], None],
) -> StartingPoint:
    """Read the output's state, the input and the store (see the module doc). Raises
    `OutputFailed`, `UsageError`, `CorruptFile`, `StorageFailed` or `PublicationError`."""
    await asyncio.to_thread(check_appendable, options.output)
    tasks, input_digest = await asyncio.to_thread(load_input, options.input, options.num_repeats)
    deadline = time.time() + options.checkpoint_timeout
    location = os.fspath(options.checkpoint_dir)
    root = await store_call(
        deadline, location, open_checkpoint_root, options.checkpoint_dir, crash_hook=crash_hook
    )
    log_path = dispatch_log_path(options.checkpoint_dir, options.output)
    if options.resume:
        previous = await store_call(
            deadline, location, read_previous, options.output, log_path, root, input_digest
        )
    else:
        await store_call(deadline, location, _refuse_existing, options.output, root, log_path)
        previous = Previous()
    # What the output holds is persisted: a checkpoint's ledger is reconciled with it
    # (`read_previous`), and a run with no checkpoint starts from the output alone.
    ledger = previous.ledger or ResultLedger.load(None, persisted=persisted_in(previous))
    book = RolloutBook(tasks, options.num_repeats, counts, options.group_recovery, ledger)
    book.apply_output(previous.finished)
    book.apply_sent(previous.sent)
    if previous.output_cut:
        view.note(
            f"collect: cut a torn last line ({previous.output_cut} bytes) off {options.output}"
        )
    if previous.log_cut:
        view.note(f"collect: cut a torn last line ({previous.log_cut} bytes) off {log_path}")
    return StartingPoint(book, input_digest, root, log_path, previous)


def _refuse_existing(output: Path, root: PublicationRoot, log_path: Path) -> None:
    """A fresh run next to an old one would mix two collections' attempts and lines."""
    if output.exists() and output.stat().st_size > 0:
        raise UsageError(f"{output} already holds rollouts: pass --resume to continue them")
    if log_path.exists() or root.published():
        raise UsageError(
            f"{root.location} already holds a collection: pass --resume to continue it"
        )
