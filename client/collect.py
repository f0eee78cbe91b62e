"""`rollout-checkpoint collect`: K rollouts of every task through a fleet, losing nothing to a crash.

    rollout-checkpoint collect --fleet fleet.toml --entry-url http://10.0.0.5:8000 \\
        --input tasks.jsonl --output rollouts.jsonl --num-repeats 4 --concurrency 64 \\
        --checkpoint-dir /checkpoints/eval-7 --checkpoint-every 600          [--resume]

The collector is the fleet's controller (upstream-behaviour.md §2.4 and §4.5). It sends every
(task, repeat) as a rollout `<task_id>.<repeat>` to the entry point
(`POST <entry-url>/ng-rollout/<capture_key>/run {"task": row}`), at most `--concurrency` at a
time, and appends each reply to the output as one JSON line. Every rule below exists for a
crash (of the collector, a server, or everything) at the step before it:

* **Output lines are durable before they count.** A line is flushed and fsynced (in a worker
  thread, grouped) before its rollout counts as finished, so a checkpoint never names a rollout
  "finished" that a power loss can take out of the output again. A crash mid-append leaves a
  torn last line: `--resume` cuts it off, and that rollout simply runs again.
* **The dispatch log is written ahead.** `<checkpoint-dir>/dispatched.jsonl` records which
  attempt of which rollout was sent, durably, *before* the request leaves. After a crash the
  collector knows every attempt that may still run somewhere and retires it, and never sends an
  attempt number twice to a fleet that kept running.
* **Checkpoints are the library's, with the collector's state inside.** Every
  `--checkpoint-every` seconds, on SIGUSR1 (and continue) and on SIGTERM/SIGINT (and stop, the
  fleet left closed): dispatching pauses; the fleet prepares; replies already on the wire for
  episodes the entry point no longer holds are awaited (else a rollout that finished would be
  restored as running, or lost); the scope is then every rollout in flight plus every restored
  rollout not yet re-sent (named by its attempt N+1: left out, the commit would free it);
  commit; publish with the collector state (finished, in flight, attempts, failures, the
  members' boot ids) as the fleet manifest's controller-state blob; resume.
* **Failed rollouts are retired before they are retried**, between checkpoints (retire is
  refused while one is open), in batches, then sent again as attempt N+1 — up to
  `--max-attempts` failures, after which the rollout is recorded in the output as failed. A
  retried attempt that was not retired could leave the failed attempt's half-built state
  running next to it.
* **`--resume`** reads the output (skipping every rollout in it), the dispatch log and `LATEST`.
  If the fleet was restarted (its boot ids differ from the checkpoint's), `LATEST` is restored
  into it, all or nothing, and each continued rollout is re-sent as attempt N+1, continuing
  from its boundary. If the fleet kept running (same boot ids) there is nothing to restore
  into. Either way every rollout that was dispatched but is neither finished nor continued is
  retired (every attempt up to the highest that may exist) and restarted from its input as a
  later attempt; retired rollouts are forgotten once a later attempt replied. A failed restore
  restarts its rollouts the same way. A checkpoint published by an earlier run than the last
  one that dispatched is not restored: that later run may have re-sent its continuations.
  Without a published checkpoint the unfinished rollouts restart from their inputs. Nothing is
  ever restored from an unpublished checkpoint (the library only restores published ones).

Exit codes: 0 every rollout collected; 1 done, some rollouts recorded as failed; 2 usage,
configuration or input error; 4 a participant refused; 5 a participant was unreachable;
6 a corrupt output, dispatch log or checkpoint; 7 the output or dispatch log cannot be
written; 143 stopped by SIGTERM/SIGINT (after a checkpoint when one could be taken).

`ROLLOUT_CHECKPOINT_COLLECT_CRASH_AT=<point>@<n>` (fault tests only) SIGKILLs the collector at
`<point>` of its n-th checkpoint: `prepared`, `committed` (parts written, nothing published) or
a publication step (`after_verify`, `after_fleet_manifest`, `after_latest`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import enum
import hashlib
import json
import os
import secrets
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx
from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table

from rollout_checkpoint.client import coordination
from rollout_checkpoint.client.checkpointing import (
    CheckpointEvent,
    Phase,
    checkpoint,
    restore_published,
)
from rollout_checkpoint.client.coordination import FleetError
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import (
    DiscoveryError,
    Fleet,
    FleetConfigError,
    Member,
    load_fleet_file,
)
from rollout_checkpoint.client.publication import (
    CheckpointCorrupt,
    CheckpointRoot,
    FleetManifest,
    PublicationError,
)
from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId, rollout_id_problem
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.server.core.layout import FLEET_MANIFEST_NAME
from rollout_checkpoint.v1 import types_pb2

T = TypeVar("T")

EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 4
EXIT_UNREACHABLE = 5
EXIT_CORRUPT = 6
EXIT_IO = 7
EXIT_STOPPED = 128 + signal.SIGTERM

STATE_FORMAT = "rollout-checkpoint.collect/1"
DISPATCH_LOG = "dispatched.jsonl"
BATCH = 1024
"""Rollouts per Retire or Forget call (upstream retires failed rows in batches of 1024)."""
ON_WIRE_SECONDS = 30.0
"""How long a checkpoint waits for replies already on the wire. One still missing after that
stays in the scope: the agent keeps a finished episode's outcome for exactly this case, so the
restored attempt N+1 delivers it instead of running the episode again."""
CONTROL_FAILURES_FATAL = 6
"""Consecutive failed Retire/Forget rounds after which the fleet counts as lost."""
CRASH_ENV = "ROLLOUT_CHECKPOINT_COLLECT_CRASH_AT"


class UsageError(ValueError):
    """Bad arguments, input, or a collection state that does not fit them."""


class CorruptFile(ValueError):
    """The output or the dispatch log is malformed before its last line."""


class OutputFailed(Exception):
    """The output or the dispatch log cannot be written."""


# -- input ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskRow:
    index: int
    task_id: str
    row: dict[str, Any]


def load_input(path: Path, num_repeats: int) -> tuple[list[TaskRow], str]:
    """The task rows and the SHA-256 of the file (a resume must run exactly the same tasks:
    a replacement attempt whose task differs from its checkpointed one is refused)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read the input {path}: {error}") from error
    rows: list[TaskRow] = []
    seen: set[str] = set()
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise UsageError(f"{path}:{number}: not a JSON line: {error}") from error
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{number}: a task is a JSON object")
        task_id = row.get("task_id", f"row{len(rows)}")
        if not isinstance(task_id, str):
            raise UsageError(f"{path}:{number}: task_id must be a string")
        if task_id in seen:
            raise UsageError(f"{path}:{number}: task_id {task_id!r} appears twice")
        problem = rollout_id_problem(rollout_id_of(task_id, max(0, num_repeats - 1)))
        if problem is not None:
            raise UsageError(
                f"{path}:{number}: task_id {task_id!r} makes bad rollout ids: {problem}"
            )
        seen.add(task_id)
        rows.append(TaskRow(len(rows), task_id, row))
    if not rows:
        raise UsageError(f"{path}: no tasks")
    return rows, hashlib.sha256(data).hexdigest()


def rollout_id_of(task_id: str, repeat: int) -> str:
    """Stable across runs: the same (task, repeat) is the same rollout after any crash."""
    return f"{task_id}.{repeat}"


# -- durable JSON lines -------------------------------------------------------------------------


def read_jsonl(path: Path, what: str) -> tuple[list[dict[str, Any]], int]:
    """Every JSON object line of `path`, cutting off a torn last line (durably).

    A crash mid-append leaves a last line without its newline (or, after a power loss, one of
    zero bytes): cut, so the next append starts on a line of its own. A bad line before the
    last is not a crash artefact but damage: `CorruptFile`. Returns (records, bytes cut)."""
    if not path.exists():
        return [], 0
    with path.open("r+b") as file:
        data = file.read()
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
                    end -= len(raw) + 1  # a line of zeros a power loss left: torn too
                    break
                raise CorruptFile(f"{path}:{number}: the {what} holds a line that is not JSON")
            records.append(value)
        cut = len(data) - end
        if cut:
            file.truncate(end)
            file.flush()
            os.fsync(file.fileno())
    return records, cut


class DurableAppender:
    """Appends lines; `append` returns once they are flushed and fsynced.

    Group commit: lines queued while a write runs go out together in the next one, so a burst
    of replies costs one fsync. The I/O runs in a worker thread, never on the event loop. A
    failed write is cut back to the last durable size and every later append fails
    (`OutputFailed`): appending after a torn line would bury it in the middle of the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None
        self._queue: list[tuple[bytes, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._error: OutputFailed | None = None

    async def open(self) -> None:
        self._file = await asyncio.to_thread(self.path.open, "ab")
        self._task = asyncio.create_task(self._run())

    async def append(self, *lines: bytes) -> None:
        if self._error is not None:
            raise self._error
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((b"".join(lines), future))
        self._wake.set()
        # A cancelled caller must not take the write with it: the line may already be on disk.
        await asyncio.shield(future)

    async def drain(self) -> None:
        """Until everything appended so far is durable."""
        await self.append()

    async def close(self) -> None:
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


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


# -- rollouts -----------------------------------------------------------------------------------


class Status(enum.Enum):
    PENDING = "pending"
    """Waiting for a dispatch slot (also a restored rollout whose attempt N+1 is not sent)."""
    IN_FLIGHT = "in_flight"
    """Its attempt is logged and its `/run` sent (or about to be)."""
    RETIRING = "retiring"
    """Its attempt failed; it is retired in the next batch, then retried or recorded failed."""
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class Rollout:
    rollout_id: str
    task: TaskRow
    repeat: int
    attempt: int = 0
    status: Status = Status.PENDING
    failures: int = 0
    last_error: str | None = None
    continued: bool = False
    """Restored into the fleet as `attempt` (N+1), which has not replied yet."""
    retired_upto: int | None = None
    """The highest retired attempt, until the rollout is forgotten."""
    handle: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def episode(self) -> EpisodeId:
        return EpisodeId(self.rollout_id, self.attempt)


@dataclass
class Outcome:
    kind: str  # "ok", "not_started" (admission closed: nothing ran) or "failed"
    reply: dict[str, Any] | None = None
    error: str | None = None


def classify(response: httpx.Response) -> Outcome:
    """What a `/run` reply means for the rollout."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if response.status_code == 200 and isinstance(body, dict) and "error" not in body:
        return Outcome("ok", reply=body)
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if response.status_code == 409 and code == "admission_closed":
        return Outcome("not_started")  # refused before the episode began: nothing ran anywhere
    detail = json.dumps(error) if error is not None else response.text[:300]
    # An environment relays its agent's failure inside a 200 reply, with the agent's status.
    status = body.get("status") if isinstance(body, dict) else None
    return Outcome("failed", error=f"HTTP {status or response.status_code}: {detail}")


# -- what a previous run left -------------------------------------------------------------------


@dataclass
class Previous:
    """What `--resume` found: the output, the dispatch log and the latest checkpoint."""

    finished: dict[str, dict[str, Any]] = field(default_factory=dict)
    output_cut: int = 0
    dispatched: dict[str, int] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    log_cut: int = 0
    manifest: FleetManifest | None = None
    state: dict[str, Any] | None = None
    problem: str | None = None
    """Why the latest checkpoint cannot be used (it is then not restored)."""


def read_previous(output: Path, log: Path, root: CheckpointRoot, input_digest: str) -> Previous:
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
    try:
        latest = root.latest()
        if latest is not None:
            raw = (root.directory(latest) / FLEET_MANIFEST_NAME).read_bytes()
            previous.manifest = FleetManifest.decode(raw)
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
    try:
        state = json.loads(previous.manifest.controller_state)
    except ValueError:
        state = None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise UsageError(
            f"{root.path}: LATEST ({previous.manifest.checkpoint_id}) was not published by "
            "collect; use a checkpoint directory of its own"
        )
    if state.get("input_sha256") != input_digest:
        raise UsageError(
            f"the input changed since checkpoint {previous.manifest.checkpoint_id}: a resume "
            "must run exactly the same tasks"
        )
    previous.state = state
    return previous


def _attempts(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and type(v) is int}


# -- progress -----------------------------------------------------------------------------------


@dataclass
class Counts:
    total: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    checkpoints: int = 0
    last_checkpoint: str | None = None
    last_checkpoint_at: float | None = None
    phase: str = "starting"


class CollectView:
    """A live table on a terminal; plain lines (every few seconds, and for events) otherwise."""

    PLAIN_EVERY = 5.0

    def __init__(self, console: Console, counts: Counts, in_flight: Callable[[], int]) -> None:
        self.console = console
        self.counts = counts
        self.in_flight = in_flight
        self.started = time.monotonic()
        self.live: Live | None = None
        self._ticker: asyncio.Task[None] | None = None
        if console.is_terminal:
            self.live = Live(
                get_renderable=self.render,
                console=console,
                refresh_per_second=4,
                transient=False,
            )

    def __enter__(self) -> CollectView:
        if self.live is not None:
            self.live.__enter__()
        else:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self.live is not None:
            self.live.__exit__(None, None, None)
        else:
            self.console.print(self.line(), markup=False, highlight=False)

    def note(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False)

    def line(self) -> str:
        c = self.counts
        last = "-"
        if c.last_checkpoint is not None and c.last_checkpoint_at is not None:
            stamp = datetime.fromtimestamp(c.last_checkpoint_at).strftime("%H:%M:%S")
            last = f"{stamp} {c.last_checkpoint}"
        return (
            f"collect: {c.done + c.failed}/{c.total} done ({c.failed} failed), "
            f"{self.in_flight()} in flight, {c.retried} retried, {c.checkpoints} checkpoint(s), "
            f"last {last}, {c.phase}, {time.monotonic() - self.started:.0f}s"
        )

    def render(self) -> RenderableType:
        c = self.counts
        table = Table(title="rollout-checkpoint collect", show_header=False)
        table.add_column(justify="right")
        table.add_column()
        table.add_row("done", f"{c.done + c.failed}/{c.total}")
        table.add_row("in flight", str(self.in_flight()))
        table.add_row("failed", str(c.failed))
        table.add_row("retried", str(c.retried))
        table.add_row("checkpoints", str(c.checkpoints))
        last = "-"
        if c.last_checkpoint is not None and c.last_checkpoint_at is not None:
            stamp = datetime.fromtimestamp(c.last_checkpoint_at).strftime("%H:%M:%S")
            last = f"{stamp}  {c.last_checkpoint}"
        table.add_row("last checkpoint", last)
        table.add_row("now", c.phase)
        return table

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.PLAIN_EVERY)
            self.console.print(self.line(), markup=False, highlight=False)


# -- the collector ------------------------------------------------------------------------------


@dataclass
class CollectOptions:
    fleet: Path
    entry_url: str
    input: Path
    output: Path
    checkpoint_dir: Path
    num_repeats: int = 1
    concurrency: int = 32
    checkpoint_every: float | None = None
    resume: bool = False
    max_attempts: int = 3
    checkpoint_timeout: float = 300.0
    request_timeout: float = 3600.0
    keep: int | None = None
    straggler_rounds: int = 1
    command: Sequence[str] = ()


class Collector:
    def __init__(self, options: CollectOptions, console: Console) -> None:
        self.options = options
        self.console = console
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        self.run_id = f"run-{stamp}-{secrets.token_hex(4)}"
        self.rollouts: dict[str, Rollout] = {}
        self.pending: collections.deque[Rollout] = collections.deque()
        self.retire_queue: list[Rollout] = []
        self.forget_queue: set[str] = set()
        self.in_flight = 0
        self.counts = Counts()
        self.view = CollectView(console, self.counts, lambda: self.in_flight)
        self.gate_open = True
        self.stop_requested = False
        self.checkpoint_requested = False
        self.fatal: BaseException | None = None
        self.input_digest = ""
        self.keep = options.keep or 2
        self._dispatching = asyncio.Lock()
        self._control_wake = asyncio.Event()
        self._dispatch_wake = asyncio.Event()
        self._backoff_until = 0.0
        self._backoff = 0.0
        self._control_failures = 0
        self._control_retry_at = 0.0
        self._control_ids = 0
        self._checkpoint_number = 0
        self._checkpoint_deadline = 0.0
        self._crash_at = _crash_point(os.environ.get(CRASH_ENV, ""))
        self.fleet: Fleet | None = None
        self.root: CheckpointRoot | None = None
        self.output: DurableAppender | None = None
        self.dispatch_log: DurableAppender | None = None
        self.http: httpx.AsyncClient | None = None

    # -- entry ----------------------------------------------------------------------------------

    async def run(self) -> int:
        options = self.options
        tasks, self.input_digest = await asyncio.to_thread(
            load_input, options.input, options.num_repeats
        )
        for task in tasks:
            for repeat in range(options.num_repeats):
                rollout = Rollout(rollout_id_of(task.task_id, repeat), task, repeat)
                self.rollouts[rollout.rollout_id] = rollout
        self.counts.total = len(self.rollouts)
        root = await asyncio.to_thread(
            CheckpointRoot, options.checkpoint_dir, crash_hook=self._publication_step
        )
        self.root = root
        log_path = root.path / DISPATCH_LOG
        if options.resume:
            previous = await asyncio.to_thread(
                read_previous, options.output, log_path, root, self.input_digest
            )
        else:
            await asyncio.to_thread(self._refuse_existing, log_path)
            previous = Previous()
        self._apply_finished(previous)
        if all(r.status in (Status.DONE, Status.FAILED) for r in self.rollouts.values()):
            self.view.note(f"collect: every rollout is already in {options.output}; nothing to do")
            return self._exit_code()
        spec = load_fleet_file(options.fleet)
        self.keep = options.keep or spec.keep
        async with await Fleet.discover(spec) as fleet:
            self.fleet = fleet
            loop = asyncio.get_running_loop()
            handled = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
            loop.add_signal_handler(signal.SIGUSR1, self.request_checkpoint)
            loop.add_signal_handler(signal.SIGTERM, self.request_stop)
            loop.add_signal_handler(signal.SIGINT, self.request_stop)
            try:
                with self.view:
                    return await self._collect(previous, log_path)
            finally:
                for signum in handled:
                    loop.remove_signal_handler(signum)

    def request_checkpoint(self) -> None:
        self.checkpoint_requested = True
        self._notify()

    def request_stop(self) -> None:
        self.stop_requested = True
        self._notify()

    async def _collect(self, previous: Previous, log_path: Path) -> int:
        options = self.options
        self.counts.phase = "setting up the fleet"
        await self._set_up_fleet(previous)
        self.output = DurableAppender(options.output)
        self.dispatch_log = DurableAppender(log_path)
        await self.output.open()
        await self.dispatch_log.open()
        limits = httpx.Limits(
            max_connections=options.concurrency + 8,
            max_keepalive_connections=options.concurrency,
        )
        timeout = httpx.Timeout(options.request_timeout, connect=30.0)
        try:
            # The run header goes ahead of this run's first dispatch: `--resume` restores a
            # checkpoint only when no later run dispatched after it.
            assert self.fleet is not None
            await self.dispatch_log.append(
                _line(
                    {
                        "run_id": self.run_id,
                        "started_at": _now(),
                        "boot_ids": {m.name: m.boot_id for m in self.fleet.members},
                    }
                )
            )
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
                self.http = http
                dispatcher = asyncio.create_task(self._dispatch_loop())
                self.counts.phase = "collecting"
                try:
                    return await self._control_loop()
                finally:
                    dispatcher.cancel()
                    await asyncio.gather(dispatcher, return_exceptions=True)
                    await self._cancel_in_flight()  # before their client closes under them
        finally:
            await self.output.close()
            await self.dispatch_log.close()

    def _refuse_existing(self, log_path: Path) -> None:
        """A fresh run next to an old one would mix two collections' attempts and lines."""
        output = self.options.output
        assert self.root is not None
        if output.exists() and output.stat().st_size > 0:
            raise UsageError(f"{output} already holds rollouts: pass --resume to continue them")
        if log_path.exists() or self.root.published():
            raise UsageError(
                f"{self.root.path} already holds a collection: pass --resume to continue it"
            )

    def _apply_finished(self, previous: Previous) -> None:
        for rollout_id, line in previous.finished.items():
            rollout = self.rollouts.get(rollout_id)
            if rollout is None:
                continue
            rollout.attempt = int(line["attempt"])
            if line.get("status") == "failed":
                rollout.status = Status.FAILED
                self.counts.failed += 1
            else:
                rollout.status = Status.DONE
                self.counts.done += 1
        if previous.output_cut:
            self.view.note(
                f"collect: cut a torn last line ({previous.output_cut} bytes) off {self.options.output}"
            )

    # -- setting up the fleet -------------------------------------------------------------------

    async def _set_up_fleet(self, previous: Previous) -> None:
        """Restore LATEST when the fleet is fresh; then retire and restart every rollout that
        was dispatched but is neither finished nor continued."""
        fleet, root = self.fleet, self.root
        assert fleet is not None and root is not None
        deadline = time.time() + self.options.checkpoint_timeout
        state = previous.state or {}
        # Every attempt of an unfinished rollout that may hold state somewhere.
        top: dict[str, int] = dict(previous.dispatched)
        for rollout_id, attempt in _attempts(state.get("attempts")).items():
            top[rollout_id] = max(top.get(rollout_id, 0), attempt)
        for rollout_id, count in _attempts(state.get("failures")).items():
            if rollout_id in self.rollouts:
                self.rollouts[rollout_id].failures = count
        for rollout_id, attempt in _attempts(state.get("retired")).items():
            if rollout_id in self.rollouts:
                self.rollouts[rollout_id].retired_upto = attempt
        manifest = previous.manifest
        if previous.problem is not None:
            self.view.note(f"collect: {previous.problem}; nothing is restored")
        restored = False
        if manifest is not None and previous.state is not None:
            scope = [
                e
                for e in manifest.continued
                if e.rollout_id in self.rollouts
                and self.rollouts[e.rollout_id].status is Status.PENDING
                and e.attempt < MAX_ATTEMPT
            ]
            for episode in manifest.continued:
                if episode.attempt < MAX_ATTEMPT:
                    top[episode.rollout_id] = max(
                        top.get(episode.rollout_id, 0), episode.attempt + 1
                    )
            boot_ids = state.get("boot_ids")
            current = {m.name: m.boot_id for m in fleet.members}
            name = manifest.checkpoint_id
            if previous.runs and previous.runs[-1] != state.get("run_id"):
                self.view.note(
                    f"collect: run {previous.runs[-1]} dispatched after checkpoint {name}: "
                    "nothing is restored"
                )
            elif boot_ids == current:
                self.view.note(
                    f"collect: the fleet kept running since checkpoint {name} (same boot ids): "
                    "nothing to restore into"
                )
            elif not scope:
                self.view.note(f"collect: checkpoint {name} continues no unfinished rollout")
            else:
                restored = await self._restore(name, scope, deadline)
        if not restored:
            await self._reopen(deadline)
        restart: list[EpisodeId] = []
        for rollout in self.rollouts.values():
            if rollout.status is not Status.PENDING or rollout.continued:
                continue
            highest = top.get(rollout.rollout_id)
            if highest is None:
                continue  # never dispatched: attempt 0 is new everywhere
            restart.append(EpisodeId(rollout.rollout_id, highest))
        for start in range(0, len(restart), BATCH):
            batch = restart[start : start + BATCH]
            await coordination.retire(fleet, self._control_id("retire"), deadline, batch)
            for episode in batch:
                rollout = self.rollouts[episode.rollout_id]
                rollout.retired_upto = episode.attempt
                rollout.attempt = episode.attempt + 1
        if restart:
            self.view.note(
                f"collect: retired {len(restart)} dispatched, unfinished rollout(s); they "
                "restart from their inputs as later attempts"
            )
        order = sorted(
            (r for r in self.rollouts.values() if r.status is Status.PENDING),
            key=lambda r: (not r.continued, r.retired_upto is None, r.task.index, r.repeat),
        )
        self.pending.extend(order)

    async def _restore(self, name: str, scope: list[EpisodeId], deadline: float) -> bool:
        fleet, root = self.fleet, self.root
        assert fleet is not None and root is not None
        restore_id = self._control_id("restore")
        self.counts.phase = f"restoring {name}"
        try:
            await restore_published(fleet, root, restore_id, deadline, source=name, scope=scope)
        except FleetError as error:
            # All or nothing: the library retired every N+1 and resumed the fleet.
            self.view.note(
                f"collect: restore of {name} failed ({error}); its {len(scope)} rollout(s) "
                "restart from their inputs as later attempts"
            )
            return False
        except PublicationError as error:
            self.view.note(f"collect: checkpoint {name} cannot be restored ({error})")
            return False
        await coordination.resume(fleet, restore_id, deadline)
        for episode in scope:
            rollout = self.rollouts[episode.rollout_id]
            rollout.attempt = episode.attempt + 1
            rollout.continued = True
        self.view.note(f"collect: restored {name}: {len(scope)} rollout(s) continue as attempt N+1")
        return True

    async def _reopen(self, deadline: float) -> None:
        """Resume every member: a fleet started closed opens, and a checkpoint a crashed
        collector left open (its fleet kept running) is ended, so Retire is allowed."""
        fleet = self.fleet
        assert fleet is not None
        statuses = await _each(fleet.members, lambda m: m.client.get_status(), "status")
        fresh = self._control_id("open")
        for _, members in reversed(fleet.stages()):
            await _each(
                members,
                lambda m: m.client.resume(statuses[m.name].checkpoint_id or fresh, deadline),
                "resume",
            )

    # -- dispatching ----------------------------------------------------------------------------

    def _notify(self) -> None:
        self._control_wake.set()
        self._dispatch_wake.set()

    def _dispatchable(self) -> bool:
        return self.gate_open and bool(self.pending) and self.in_flight < self.options.concurrency

    async def _dispatch_loop(self) -> None:
        try:
            while True:
                while not self._dispatchable():
                    self._dispatch_wake.clear()
                    if self._dispatchable():
                        break
                    await self._dispatch_wake.wait()
                pause = self._backoff_until - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                    continue
                async with self._dispatching:
                    if not self._dispatchable():
                        continue
                    count = min(self.options.concurrency - self.in_flight, len(self.pending))
                    batch = [self.pending.popleft() for _ in range(count)]
                    for rollout in batch:
                        rollout.status = Status.IN_FLIGHT
                    self.in_flight += len(batch)
                    assert self.dispatch_log is not None
                    # Written ahead: after a crash, every attempt that may run is known.
                    await self.dispatch_log.append(
                        *(_line({"rollout_id": r.rollout_id, "attempt": r.attempt}) for r in batch)
                    )
                    for rollout in batch:
                        rollout.handle = asyncio.create_task(self._run_one(rollout))
        except Exception as error:  # the output failed, or a bug: stop rather than hang
            self.fatal = error
            self._notify()

    async def _run_one(self, rollout: Rollout) -> None:
        assert self.http is not None and self.output is not None
        attempt = rollout.attempt
        key = EpisodeId(rollout.rollout_id, attempt).capture_key
        url = f"{self.options.entry_url.rstrip('/')}/ng-rollout/{key}/run"
        try:
            try:
                response = await self.http.post(url, json={"task": rollout.task.row})
                outcome = classify(response)
            except httpx.HTTPError as error:
                outcome = Outcome("failed", error=f"{type(error).__name__}: {error}")
            if outcome.kind == "ok":
                assert outcome.reply is not None
                await self.output.append(_line(self._finished_line(rollout, outcome.reply)))
                rollout.status = Status.DONE
                rollout.continued = False
                self.counts.done += 1
                self._backoff = 0.0
                if rollout.retired_upto is not None:
                    self.forget_queue.add(rollout.rollout_id)
            elif outcome.kind == "not_started":
                rollout.status = Status.PENDING
                self.pending.appendleft(rollout)
                self._backoff = min(max(self._backoff * 2, 0.05), 1.0)
                self._backoff_until = time.monotonic() + self._backoff
            else:
                rollout.failures += 1
                rollout.last_error = outcome.error
                rollout.status = Status.RETIRING
                rollout.continued = False
                self.retire_queue.append(rollout)
        except Exception as error:  # the output failed, or a bug: a rollout left "in flight"
            self.fatal = error  # forever would hang the run, so stop it
        finally:
            self.in_flight -= 1
            self._notify()

    def _finished_line(self, rollout: Rollout, reply: dict[str, Any]) -> dict[str, Any]:
        return {
            "rollout_id": rollout.rollout_id,
            "task_id": rollout.task.task_id,
            "repeat": rollout.repeat,
            "attempt": rollout.attempt,
            "status": "ok",
            "reward": reply.get("reward"),
            "reply": reply,
        }

    def _failed_line(self, rollout: Rollout) -> dict[str, Any]:
        return {
            "rollout_id": rollout.rollout_id,
            "task_id": rollout.task.task_id,
            "repeat": rollout.repeat,
            "attempt": rollout.attempt,
            "status": "failed",
            "reward": None,
            "failures": rollout.failures,
            "error": rollout.last_error,
        }

    async def _cancel_in_flight(self) -> None:
        handles = [r.handle for r in self.rollouts.values() if r.handle and not r.handle.done()]
        for handle in handles:
            handle.cancel()
        await asyncio.gather(*handles, return_exceptions=True)

    # -- control --------------------------------------------------------------------------------

    def _all_done(self) -> bool:
        return self.in_flight == 0 and all(
            r.status in (Status.DONE, Status.FAILED) for r in self.rollouts.values()
        )

    async def _control_loop(self) -> int:
        every = self.options.checkpoint_every
        next_at = time.monotonic() + every if every else None
        while True:
            if self.fatal is not None:
                raise self.fatal
            now = time.monotonic()
            if self.stop_requested:
                return await self._stop()
            if self.checkpoint_requested or (next_at is not None and now >= next_at):
                self.checkpoint_requested = False
                await self._checkpoint(stop=False)
                next_at = time.monotonic() + every if every else None
                continue
            if now >= self._control_retry_at:
                if self.retire_queue:
                    await self._retire_failed()
                    continue
                if self.forget_queue:
                    await self._forget_retired()
                    continue
            if self._all_done():
                break
            waits = [t for t in (next_at, self._control_retry_at) if t is not None and t > now]
            self._control_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._control_wake.wait(), timeout=min(waits) - now if waits else None
                )
        await self._forget_at_the_end()
        self.counts.phase = "done"
        self.view.note(
            f"collect: {self.counts.done} rollout(s) collected, {self.counts.failed} failed, "
            f"into {self.options.output}; {self.counts.checkpoints} checkpoint(s) taken"
        )
        return self._exit_code()

    def _exit_code(self) -> int:
        return EXIT_SOME_FAILED if self.counts.failed else EXIT_OK

    def _control_id(self, what: str) -> str:
        self._control_ids += 1
        return f"{self.run_id}-{what}-{self._control_ids}"

    def _control_failed(self, what: str, error: Exception) -> bool:
        """Back off; True once the fleet has failed too many rounds in a row."""
        self._control_failures += 1
        delay = min(0.5 * 2**self._control_failures, 30.0)
        self._control_retry_at = time.monotonic() + delay
        self.view.note(f"collect: {what} failed ({error}); retrying in {delay:.1f}s")
        return self._control_failures >= CONTROL_FAILURES_FATAL

    async def _retire_failed(self) -> None:
        """Retire failed attempts (between checkpoints: refused while one is open), then send
        each again as a later attempt, or record it failed once it used up its attempts."""
        fleet, output = self.fleet, self.output
        assert fleet is not None and output is not None
        batch = self.retire_queue[:BATCH]
        deadline = time.time() + self.options.checkpoint_timeout
        try:
            await coordination.retire(
                fleet, self._control_id("retire"), deadline, [r.episode for r in batch]
            )
        except (FleetError, ControlError) as error:
            if self._control_failed(f"retire of {len(batch)} failed rollout(s)", error):
                self.fatal = error  # without retiring, no failed rollout may run again
            return
        self._control_failures = 0
        del self.retire_queue[: len(batch)]
        for rollout in batch:
            rollout.retired_upto = rollout.attempt
            if rollout.failures >= self.options.max_attempts or rollout.attempt >= MAX_ATTEMPT - 1:
                try:
                    await output.append(_line(self._failed_line(rollout)))
                except OutputFailed as error:
                    self.fatal = error
                    return
                rollout.status = Status.FAILED
                self.counts.failed += 1
                self.view.note(
                    f"collect: {rollout.rollout_id} failed {rollout.failures} time(s), "
                    f"recorded as failed: {rollout.last_error}"
                )
            else:
                rollout.attempt += 1
                rollout.status = Status.PENDING
                self.pending.append(rollout)
                self.counts.retried += 1
        self._notify()

    async def _forget_retired(self) -> None:
        """A retired rollout is forgotten once a later attempt replied: from then on nothing of
        the retired attempts can still run, and the marks would only grow."""
        fleet = self.fleet
        assert fleet is not None
        batch = sorted(self.forget_queue)[:BATCH]
        deadline = time.time() + self.options.checkpoint_timeout
        try:
            await coordination.forget(fleet, self._control_id("forget"), deadline, batch)
        except (FleetError, ControlError) as error:
            if self._control_failed(f"forget of {len(batch)} rollout(s)", error):
                # Forgetting is housekeeping (the marks only refuse stale attempts): give up
                # on these, not on the run.
                self.forget_queue.difference_update(batch)
                self._control_failures = 0
            return
        self._control_failures = 0
        for rollout_id in batch:
            self.forget_queue.discard(rollout_id)
            self.rollouts[rollout_id].retired_upto = None

    async def _forget_at_the_end(self) -> None:
        """Rollouts recorded as failed keep their marks until nothing runs any more."""
        fleet = self.fleet
        assert fleet is not None
        left = sorted(r.rollout_id for r in self.rollouts.values() if r.retired_upto is not None)
        deadline = time.time() + self.options.checkpoint_timeout
        for start in range(0, len(left), BATCH):
            with contextlib.suppress(FleetError, ControlError):
                await coordination.forget(
                    fleet, self._control_id("forget"), deadline, left[start : start + BATCH]
                )

    # -- checkpoints ----------------------------------------------------------------------------

    async def _checkpoint(self, *, stop: bool) -> str | None:
        """Take and publish one checkpoint; None when none could be taken (the previous one
        stays the restore point). With `stop` the fleet stays closed afterwards."""
        fleet, root = self.fleet, self.root
        assert fleet is not None and root is not None
        self.gate_open = False
        async with self._dispatching:
            pass  # a dispatch under way finishes; none starts until the gate reopens
        self._checkpoint_number += 1
        published: str | None = None
        try:
            for round_number in range(self.options.straggler_rounds + 1):
                self._checkpoint_deadline = time.time() + self.options.checkpoint_timeout
                outcome = None
                async for event in checkpoint(
                    fleet,
                    root,
                    self._checkpoint_deadline,
                    keep=self.keep,
                    keep_closed=stop,
                    fix_scope=self._fix_scope,
                ):
                    self._checkpoint_event(event)
                    if event.final:
                        outcome = event.outcome
                assert outcome is not None
                if outcome.published is not None:
                    published = outcome.checkpoint_id
                    break
                blocking = sorted(outcome.progress.blocking_episodes()) if outcome.progress else []
                if not blocking or round_number == self.options.straggler_rounds:
                    self.view.note(
                        f"collect: the fleet was not prepared in time ({outcome.prepare_outcome}); "
                        "no checkpoint taken"
                    )
                    break
                # Controller obligation 2: the checkpoint was aborted (fleet resumed); retire
                # the stragglers, whose /run then fails and is retried as a later attempt.
                await coordination.retire(
                    fleet, self._control_id("retire"), self._checkpoint_deadline, blocking
                )
                self.view.note(f"collect: retired {len(blocking)} straggler(s); preparing again")
        except (FleetError, ControlError, PublicationError, OSError) as error:
            self.view.note(
                f"collect: checkpoint failed ({error}); the previous one stays the restore point"
            )
        finally:
            if not stop:
                self.gate_open = True
            self.counts.phase = "collecting" if not stop else "stopping"
            self._notify()
        if published is not None:
            self.counts.checkpoints += 1
            self.counts.last_checkpoint = published
            self.counts.last_checkpoint_at = time.time()
            self.view.note(f"collect: checkpoint {published} published")
        return published

    def _checkpoint_event(self, event: CheckpointEvent) -> None:
        self.counts.phase = f"checkpoint: {event.phase.lower()}"
        if event.phase == Phase.SCOPE:
            self._crash("prepared")
        elif event.phase == Phase.PUBLISH:
            self._crash("committed")

    async def _fix_scope(self, checkpoint_id: str) -> tuple[list[EpisodeId], bytes]:
        """Called once the fleet is prepared (nothing starts or ends any more): await the
        replies already on the wire, then name the scope and build the collector state."""
        fleet, output = self.fleet, self.output
        assert fleet is not None and output is not None
        entry = [m for m in fleet.members if m.kind == types_pb2.PARTICIPANT_KIND_ENVIRONMENT]
        entry = entry or [m for m in fleet.members if m.kind == types_pb2.PARTICIPANT_KIND_AGENT]
        pages = await _each(entry, lambda m: m.client.all_episodes(), "list episodes")
        held = {
            EpisodeId(e.episode_id.rollout_id, e.episode_id.attempt)
            for episodes in pages.values()
            for e in episodes
        }
        on_wire = [
            r.handle
            for r in self.rollouts.values()
            if r.status is Status.IN_FLIGHT and r.handle is not None and r.episode not in held
        ]
        if on_wire:
            self.counts.phase = f"checkpoint: awaiting {len(on_wire)} reply(ies) on the wire"
            remaining = self._checkpoint_deadline - time.time() - 5.0
            await asyncio.wait(on_wire, timeout=max(0.5, min(ON_WIRE_SECONDS, remaining)))
        await output.drain()  # "finished" in the state means durable in the output
        boots = await _each(fleet.members, lambda m: m.client.get_participant(), "describe")
        scope = sorted(
            r.episode
            for r in self.rollouts.values()
            if r.status is Status.IN_FLIGHT or (r.continued and r.status is Status.PENDING)
        )
        state = self._state(checkpoint_id, {n: b.boot_id for n, b in boots.items()})
        return scope, json.dumps(state, separators=(",", ":"), sort_keys=True).encode()

    def _state(self, checkpoint_id: str, boot_ids: dict[str, str]) -> dict[str, Any]:
        """The controller-state blob: what `--resume` needs besides the output and the log."""

        def pick(select: Callable[[Rollout], bool]) -> dict[str, int]:
            return {r.rollout_id: r.attempt for r in self.rollouts.values() if select(r)}

        return {
            "format": STATE_FORMAT,
            "run_id": self.run_id,
            "checkpoint_id": checkpoint_id,
            "created_at": _now(),
            "input_sha256": self.input_digest,
            "num_repeats": self.options.num_repeats,
            "boot_ids": boot_ids,
            "finished": pick(lambda r: r.status is Status.DONE),
            "failed": pick(lambda r: r.status is Status.FAILED),
            "in_flight": pick(lambda r: r.status is Status.IN_FLIGHT),
            "restored_pending": pick(lambda r: r.continued and r.status is Status.PENDING),
            "attempts": pick(lambda r: r.attempt > 0 or r.status is not Status.PENDING),
            "failures": {r.rollout_id: r.failures for r in self.rollouts.values() if r.failures},
            "retired": {
                r.rollout_id: r.retired_upto
                for r in self.rollouts.values()
                if r.retired_upto is not None
            },
        }

    async def _stop(self) -> int:
        self.counts.phase = "stopping: checkpoint"
        published = await self._checkpoint(stop=True)
        self.gate_open = False
        await self._cancel_in_flight()
        command = list(self.options.command) or ["rollout-checkpoint", "collect", "..."]
        if "--resume" not in command:
            command.append("--resume")
        again = " ".join(shlex.quote(part) for part in command)
        done = self.counts.done + self.counts.failed
        if published is not None:
            self.view.note(
                f"collect: stopped after checkpoint {published} ({done}/{self.counts.total} "
                f"rollouts in {self.options.output}). To continue: {again}"
            )
        else:
            self.view.note(
                f"collect: stopped WITHOUT a new checkpoint ({done}/{self.counts.total} rollouts "
                f"in {self.options.output}). To continue from the last one: {again}"
            )
        return EXIT_STOPPED

    # -- fault injection (tests) ------------------------------------------------------------------

    def _crash(self, point: str) -> None:
        if self._crash_at == (point, self._checkpoint_number):
            os.kill(os.getpid(), signal.SIGKILL)

    def _publication_step(self, step: str) -> None:
        self._crash(step)


def _crash_point(value: str) -> tuple[str, int] | None:
    point, _, number = value.partition("@")
    if not point:
        return None
    return point, int(number or "1")


async def _each(
    members: Sequence[Member], call: Callable[[Member], Awaitable[T]], operation: str
) -> dict[str, T]:
    """Call every member at once; one `FleetError` naming every member that failed."""
    results = await asyncio.gather(*(call(m) for m in members), return_exceptions=True)
    replies: dict[str, T] = {}
    failures: dict[str, ControlError] = {}
    for member, result in zip(members, results, strict=True):
        if isinstance(result, ControlError):
            failures[member.name] = result
        elif isinstance(result, BaseException):
            raise result
        else:
            replies[member.name] = result
    if failures:
        raise FleetError(operation, failures)
    return replies


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


# -- the command line ---------------------------------------------------------------------------


def add_collect_verb(verbs: Any) -> None:
    """Register `collect` on the CLI's subparsers."""
    sub: argparse.ArgumentParser = verbs.add_parser(
        "collect",
        help="collect K rollouts of every task through a fleet, with crash-safe checkpoints",
        description="Collect K rollouts of every task through a fleet, with checkpoints that "
        "survive a crash of the collector, a server, or everything (see the README).",
    )
    sub.add_argument("--fleet", type=Path, required=True, help="fleet file (TOML or YAML)")
    sub.add_argument(
        "--entry-url",
        required=True,
        help="the entry point's base URL (the environment server's or the agent's HTTP address)",
    )
    sub.add_argument("--input", type=Path, required=True, help="tasks, one JSON object a line")
    sub.add_argument("--output", type=Path, required=True, help="rollouts, one JSON line each")
    sub.add_argument("--num-repeats", type=_positive_int, default=1, help="rollouts per task (K)")
    sub.add_argument("--concurrency", type=_positive_int, default=32, help="rollouts in flight")
    sub.add_argument(
        "--checkpoint-dir",
        type=Path,
        required=True,
        help="checkpoints, LATEST and the dispatch log (a directory of its own)",
    )
    sub.add_argument(
        "--checkpoint-every", type=_positive_float, default=None, help="seconds between checkpoints"
    )
    sub.add_argument(
        "--resume", action="store_true", help="continue the collection in --output/--checkpoint-dir"
    )
    sub.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=3,
        help="failures of one rollout before it is recorded as failed (default 3)",
    )
    sub.add_argument(
        "--checkpoint-timeout",
        type=_positive_float,
        default=300.0,
        help="seconds for one checkpoint (default 300)",
    )
    sub.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=3600.0,
        help="seconds for one /run (default 3600)",
    )
    sub.add_argument(
        "--keep", type=_positive_int, default=None, help="published checkpoints kept (default 2)"
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def run_collect(args: argparse.Namespace, command: Sequence[str] = ()) -> int:
    options = CollectOptions(
        fleet=args.fleet,
        entry_url=args.entry_url,
        input=args.input,
        output=args.output,
        checkpoint_dir=args.checkpoint_dir,
        num_repeats=args.num_repeats,
        concurrency=args.concurrency,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        max_attempts=args.max_attempts,
        checkpoint_timeout=args.checkpoint_timeout,
        request_timeout=args.request_timeout,
        keep=args.keep,
        command=command,
    )
    console = Console(stderr=True, soft_wrap=True)  # plain lines stay whole in logs

    def fail(code: int, message: str) -> int:
        console.print(f"rollout-checkpoint collect: {message}", markup=False, highlight=False)
        return code

    async def main() -> int:
        return await Collector(options, console).run()

    try:
        return asyncio.run(main())
    except (UsageError, FleetConfigError) as error:
        return fail(EXIT_USAGE, str(error))
    except (CorruptFile, CheckpointCorrupt) as error:
        return fail(EXIT_CORRUPT, str(error))
    except OutputFailed as error:
        return fail(EXIT_IO, str(error))
    except DiscoveryError as error:
        return fail(EXIT_UNREACHABLE, str(error))
    except FleetError as error:
        code = EXIT_UNREACHABLE if error.reason == Reason.PARTICIPANT_UNREACHABLE else EXIT_REFUSED
        return fail(code, str(error))
    except ControlError as error:
        return fail(EXIT_REFUSED if error.decided_by_server else EXIT_UNREACHABLE, str(error))
    except PublicationError as error:
        return fail(EXIT_CORRUPT, str(error))
