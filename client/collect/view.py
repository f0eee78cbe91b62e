"""The collector's terminal UI: a live table on a terminal, plain progress lines otherwise."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table


@dataclass
class Counts:
    """The progress the view shows; the collector updates it, the view only reads it."""

    total: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    checkpoints: int = 0
    recoveries: int = 0
    """Recoveries in place after a member was lost."""
    dropped: int = 0
    """Rollouts dropped on purpose (`--stale drop`): settled, not failed."""
    stale_continued: int = 0
    stale_regenerated: int = 0
    """Continued rollouts past `--max-policy-lag`, by what `--stale` did with them (the
    dropped ones are `dropped`)."""
    reoffered: int = 0
    """Results the entry offered again from its outbox (finished before a crash, never
    acknowledged) instead of running them again."""
    groups_sealed: int = 0
    """Prompt groups (the K rollouts of a task) written whole, in one durable write."""
    siblings_kept: int = 0
    """Finished siblings a `sibling` group kept when a crash cut another of its rollouts."""
    groups_regenerated: int = 0
    """`group` groups regenerated from their inputs because a crash cut one of their rollouts."""
    last_checkpoint: str | None = None
    last_checkpoint_at: float | None = None
    phase: str = "starting"


class CollectView:
    """A live table on a terminal; plain lines (every few seconds, and for events) otherwise,
    so a log file keeps whole lines instead of a terminal's redraws.

    Enter it (`with view:`) inside a running event loop; `note` works entered or not."""

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
        """Print one event line as it is (no rich markup: it may hold brackets)."""
        self.console.print(message, markup=False, highlight=False)

    def line(self) -> str:
        """The progress as one plain line."""
        c = self.counts
        return (
            f"collect: {c.done + c.failed + c.dropped}/{c.total} done ({c.failed} failed), "
            f"{self.in_flight()} in flight, {c.retried} retried, {c.checkpoints} checkpoint(s), "
            f"{c.recoveries} recovery(ies), "
            f"last {self._last_checkpoint(' ')}, {c.phase}, "
            f"{time.monotonic() - self.started:.0f}s"
        )

    def render(self) -> RenderableType:
        """The progress as a table (what the live display redraws)."""
        c = self.counts
        table = Table(title="rollout-checkpoint collect", show_header=False)
        table.add_column(justify="right")
        table.add_column()
        table.add_row("done", f"{c.done + c.failed + c.dropped}/{c.total}")
        table.add_row("in flight", str(self.in_flight()))
        table.add_row("failed", str(c.failed))
        table.add_row("retried", str(c.retried))
        table.add_row("checkpoints", str(c.checkpoints))
        table.add_row("recoveries", str(c.recoveries))
        table.add_row("last checkpoint", self._last_checkpoint("  "))
        table.add_row("now", c.phase)
        return table

    def _last_checkpoint(self, separator: str) -> str:
        c = self.counts
        if c.last_checkpoint is None or c.last_checkpoint_at is None:
            return "-"
        stamp = datetime.fromtimestamp(c.last_checkpoint_at).strftime("%H:%M:%S")
        return f"{stamp}{separator}{c.last_checkpoint}"

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.PLAIN_EVERY)
            self.console.print(self.line(), markup=False, highlight=False)
