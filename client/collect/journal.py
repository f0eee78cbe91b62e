"""What the collector writes durably, and reading a previous run back for `--resume`.

Two append-only JSON-lines files: the output (one line per collected or failed rollout) and
`<checkpoint-dir>/dispatched.jsonl`, the dispatch log (a header line per run, then every
attempt sent, written *before* it is sent). With the latest published checkpoint's
controller state they are everything `--resume` starts from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rollout_checkpoint.client.checkpointing.publication import (
    FleetManifest,
    PublicationError,
    PublicationRoot,
)
from rollout_checkpoint.client.collect.errors import CorruptFile, OutputFailed, UsageError
from rollout_checkpoint.client.ledger import LedgerStateError, ResultLedger
from rollout_checkpoint.server.core.object_store import is_object_url

DISPATCH_LOG = "dispatched.jsonl"


def dispatch_log_path(checkpoint_dir: str | os.PathLike[str], output: Path) -> Path:
    """Where the dispatch log lives: in the checkpoint directory, or, when checkpoints go to
    an object store (which cannot append a durable line), next to `--output` as
    `<output>.dispatched.jsonl`: the log is written ahead of every dispatch, and it must be
    as durable and as local as the output it is read back with."""
    text = os.fspath(checkpoint_dir)
    if is_object_url(text):
        return output.with_name(f"{output.name}.{DISPATCH_LOG}")
    return Path(text) / DISPATCH_LOG


"""The dispatch log's name inside the checkpoint directory."""
STATE_FORMAT = "rollout-checkpoint.collect/1"
"""The `format` of the controller-state blob `collect` publishes in its fleet manifests."""


def json_line(value: dict[str, Any]) -> bytes:
    """One compact JSON line, newline included (what both files hold)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def read_jsonl(path: Path, what: str) -> tuple[list[dict[str, Any]], int]:
    """Every JSON object line of `path`, cutting off a torn last line (durably).

    A crash mid-append leaves a last line without its newline (or, after a power loss, one of
    zero bytes): cut, so the next append starts on a line of its own. A bad line before the
    last is not a crash artefact but damage: `CorruptFile` (`what` names the file in its
    message). A missing file is empty. Returns (records, bytes cut)."""
    if not path.exists():
        return [], 0
    with path.open("r+b") as file:
        data = file.read()
        records, end = parse_jsonl(data, path, what)
        cut = len(data) - end
        if cut:
            file.truncate(end)
            file.flush()
            os.fsync(file.fileno())
    return records, cut


def parse_jsonl(data: bytes, path: Path, what: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON object lines of `data` (the contents of `path`) and the length of its intact
    part: a torn last line (no newline, or a line of zeros a power loss left) is left out, for
    a reader that must not write (a recording replayed read-only). `CorruptFile` for a bad
    line before the last: damage, not a crash artefact."""
    end = data.rfind(b"\n") + 1
    lines = data[:end].split(b"\n")[:-1]
    records: list[dict[str, Any]] = []
    for number, raw in enumerate(lines, 1):
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            if number == len(lines) and not raw.strip(b"\x00"):
                end -= len(raw) + 1
                break
            raise CorruptFile(f"{path}:{number}: the {what} holds a line that is not JSON")
        records.append(value)
    return records, end


def check_appendable(path: Path) -> None:
    """Raise `OutputFailed` (one line: the path and the OS's reason) unless `path` can be
    opened for appending; leaves the file system as it found it.

    Run before anything else, so an `--output` in an unwritable place (`/proc/x.jsonl`, a path
    under a file, a read-only directory) ends the run at once instead of after the fleet was
    discovered and set up."""
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as error:
        raise OutputFailed(f"cannot write {path}: {error.strerror or error}") from None
    if not existed:
        with contextlib.suppress(OSError):
            path.unlink()


class DurableAppender:
    """Appends lines to a file; `append` returns once they are flushed and fsynced.

    Group commit: lines queued while a write runs go out together in the next one, so a burst
    of replies costs one fsync. The I/O runs in a worker thread, never on the event loop. A
    failed write is cut back to the last durable size and every later append fails
    (`OutputFailed`): appending after a torn line would bury it in the middle of the file.
    Use: `await open()`, any number of `append`/`drain`, then `await close()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None
        self._queue: list[tuple[bytes, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._error: OutputFailed | None = None

    async def open(self) -> None:
        """Open the file for appending (created if missing) and start the writer task;
        `OutputFailed` when it cannot be opened."""
        try:
            self._file = await asyncio.to_thread(self.path.open, "ab")
        except OSError as error:
            raise OutputFailed(f"cannot write {self.path}: {error.strerror or error}") from None
        self._task = asyncio.create_task(self._run())

    async def append(self, *lines: bytes) -> None:
        """Until `lines` are durable; `OutputFailed` when they (or an earlier write) failed.

        A cancelled caller does not take the write with it: the lines may already be on disk."""
        if self._error is not None:
            raise self._error
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((b"".join(lines), future))
        self._wake.set()
        await asyncio.shield(future)

    async def drain(self) -> None:
        """Until everything appended so far is durable."""
        await self.append()

    async def close(self) -> None:
        """Write what is queued, stop the writer and close the file."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._file is not None:
            await asyncio.to_thread(self._file.close)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            if not batch:
                if self._closing:
                    return
                continue
            data = b"".join(item for item, _ in batch)
            try:
                if self._error is not None:
                    raise self._error
                await asyncio.to_thread(self._write, data)
            except (OSError, OutputFailed) as error:
                failure = (
                    error
                    if isinstance(error, OutputFailed)
                    else OutputFailed(f"cannot write {self.path}: {error}")
                )
                self._error = failure
                for _, future in batch:
                    if not future.done():
                        future.set_exception(failure)
                        future.exception()  # retrieved: a cancelled caller never awaits it
                continue
            for _, future in batch:
                if not future.done():
                    future.set_result(None)

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        if not data:
            return
        size = self._file.tell()
        try:
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                self._file.truncate(size)
                os.fsync(self._file.fileno())
            raise


# -- what a previous run left -------------------------------------------------------------------


@dataclass
class Previous:
    """What `--resume` found: the output, the dispatch log and the latest checkpoint."""

    finished: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Rollout id -> its output line (the first one, should a rollout appear twice)."""
    output_cut: int = 0
    """Bytes of a torn last line cut off the output."""
    dispatched: dict[str, int] = field(default_factory=dict)
    """Rollout id -> the highest attempt the dispatch log says was sent."""
    sent: dict[str, list[int]] = field(default_factory=dict)
    """Rollout id -> every attempt the dispatch log says was sent, in order (provenance)."""
    runs: list[str] = field(default_factory=list)
    """The run ids of the dispatch log's headers, in order."""
    log_cut: int = 0
    """Bytes of a torn last line cut off the dispatch log."""
    manifest: FleetManifest | None = None
    state: dict[str, Any] | None = None
    """The controller state of `manifest`, checked to be collect's and of the same input."""
    problem: str | None = None
    """Why the latest checkpoint cannot be used (it is then not restored)."""
    ledger: ResultLedger | None = None
    """The receipt ledger of `state`, reconciled with the output: what a crash left owed."""


def read_previous(output: Path, log: Path, root: PublicationRoot, input_digest: str) -> Previous:
    """Read back the output, the dispatch log and `LATEST` of `root` (blocking: run it in a
    thread), cutting torn last lines off both files.

    Raises `CorruptFile` for damage before a last line or an output line without
    `rollout_id` and `attempt`; `UsageError` when `LATEST` exists but the dispatch log does
    not (the attempts sent after it would be unknown), when `LATEST` was not published by
    `collect`, or when its input digest differs from `input_digest` (a resume must run the
    same tasks). An unreadable `LATEST` is not an error: `problem` says why, and nothing is
    restored."""
    previous = Previous()
    lines, previous.output_cut = read_jsonl(output, "output")
    for number, line in enumerate(lines, 1):
        rollout_id, attempt = line.get("rollout_id"), line.get("attempt")
        if not isinstance(rollout_id, str) or type(attempt) is not int:
            raise CorruptFile(f"{output}:{number}: a line without rollout_id and attempt")
        previous.finished.setdefault(rollout_id, line)
    entries, previous.log_cut = read_jsonl(log, "dispatch log")
    for entry in entries:
        if isinstance(entry.get("run_id"), str) and "rollout_id" not in entry:
            previous.runs.append(entry["run_id"])
        rollout_id, attempt = entry.get("rollout_id"), entry.get("attempt")
        if isinstance(rollout_id, str) and type(attempt) is int:
            previous.dispatched[rollout_id] = max(previous.dispatched.get(rollout_id, 0), attempt)
            sent = previous.sent.setdefault(rollout_id, [])
            if attempt not in sent:
                sent.append(attempt)
    try:
        previous.manifest = read_latest_manifest(root)
    except (PublicationError, OSError, ValueError) as error:
        previous.problem = f"LATEST cannot be read: {error}"
        return previous
    if previous.manifest is None:
        return previous
    if not log.exists():
        raise UsageError(
            f"{log} is missing next to checkpoint {previous.manifest.checkpoint_id}: without it "
            "the attempts sent after the checkpoint are unknown"
        )
    state = collect_state(previous.manifest)
    if state is None:
        raise UsageError(
            f"{root.location}: LATEST ({previous.manifest.checkpoint_id}) was not published by "
            "collect; use a checkpoint directory of its own"
        )
    if state.get("input_sha256") != input_digest:
        raise UsageError(
            f"the input changed since checkpoint {previous.manifest.checkpoint_id}: a resume "
            "must run exactly the same tasks"
        )
    try:
        previous.ledger = ResultLedger.load(state.get("ledger"), persisted=persisted_in(previous))
    except LedgerStateError as error:
        raise CorruptFile(
            f"{root.location}: the receipt ledger of checkpoint "
            f"{previous.manifest.checkpoint_id} cannot be read: {error}"
        ) from None
    previous.state = state
    return previous


def persisted_in(previous: Previous) -> dict[str, str | None]:
    """Rollout id -> the receipt digest of its output line (the trainer's store), None for
    a line that carries none (a failure, a result no receipt covered)."""
    persisted: dict[str, str | None] = {}
    for rollout_id, line in previous.finished.items():
        provenance = line.get("provenance")
        digest = provenance.get("receipt_sha256") if isinstance(provenance, dict) else None
        persisted[rollout_id] = digest if isinstance(digest, str) else None
    return persisted


def chains_in(value: object) -> dict[str, list[tuple[str, int]]]:
    """The `restored_from` map of the controller state (rollout id -> [checkpoint id,
    attempt] links); anything malformed is dropped."""
    if not isinstance(value, dict):
        return {}
    return {
        rollout_id: [
            (link[0], link[1])
            for link in chain
            if isinstance(link, list)
            and len(link) == 2
            and isinstance(link[0], str)
            and type(link[1]) is int
        ]
        for rollout_id, chain in value.items()
        if isinstance(rollout_id, str) and isinstance(chain, list)
    }


def attempts_in(value: object) -> dict[str, int]:
    """A rollout id -> integer map of the controller state; anything malformed is dropped."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and type(v) is int}


def read_latest_manifest(root: PublicationRoot) -> FleetManifest | None:
    """The fleet manifest `LATEST` names (None: nothing published yet), read without
    verifying the parts (blocking: run it in a thread). Raises `PublicationError`, `OSError`
    or `ValueError` for one that cannot be read."""
    latest = root.latest()
    if latest is None:
        return None
    return root.read_fleet_manifest(latest)


def collect_state(manifest: FleetManifest) -> dict[str, Any] | None:
    """The controller state of a checkpoint `collect` published (format `STATE_FORMAT`);
    None for any other controller's."""
    try:
        state = json.loads(manifest.controller_state)
    except ValueError:
        return None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        return None
    return state
