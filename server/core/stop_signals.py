"""SIGINT and SIGTERM in a server process (`serve`, its workers, `coordinator`), from the
entry point's first line to the interpreter's exit.

Python's own handling prints tracebacks at random moments: its default SIGINT handler raises
KeyboardInterrupt wherever the main thread is (an import, `asyncio.run`'s teardown, the
interpreter's exit); uvicorn's `capture_signals` re-raises the signal it caught once it has
shut down, into handlers that are the defaults again; `loop.remove_signal_handler` restores
the defaults while the process still has work to do; and SIGTERM's default kills the process
before it stops its children. So one handler is installed first, stays installed until the
process exits, and never raises: it records the first signal and asks whatever is running to
stop (`stopping_with`); whatever starts later sees the recorded signal and stops at once. The
process then exits with `EXIT_CODES` whatever the moment was (`exit_if_received`).

A launcher that execs the server blocks both signals before `execv` (`hold`): the mask and a
pending signal survive exec, so a signal during the new interpreter's imports waits until
`take` installs the handler, instead of meeting Python's defaults.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
EXIT_CODES = {signal.SIGTERM: 0, signal.SIGINT: 130}
"""A server's exit code when a signal stopped it (docs/operations.md, "Exit codes"): SIGTERM is
how an orchestrator ends a server, a graceful stop and so a success; SIGINT is a person's Ctrl-C,
130 as shells report it, so `serve && next` does not go on to `next`."""

Stop = Callable[[int], object]
"""Asks what runs to stop; gets each signal's number (a second one may mean: hurry); what it
returns is ignored."""


def hold() -> None:
    """Block SIGINT and SIGTERM in this thread (and across an exec): see the module."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Both signals blocked while inside (a child process started here inherits the mask,
    so its imports are covered until its own `take`); the previous mask after."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class StopSignals:
    """The process's one SIGINT/SIGTERM handler: records, forwards, never raises."""

    def __init__(self) -> None:
        self.received: int | None = None
        """The first stop signal, which decides the exit code."""
        self._stop: Stop | None = None

    def take(self) -> None:
        """Install the handler, then unblock: a signal held across the exec is delivered
        now, to this handler. Call it first in the entry point."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        release()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self._stop is not None:
            self._stop(signum)

    @contextlib.contextmanager
    def stopping_with(self, stop: Stop) -> Iterator[None]:
        """While inside, a signal calls `stop`; one that came before calls it at once (a
        signal during start-up is not lost, the server stops as soon as it can)."""
        self._stop = stop
        try:
            if self.received is not None:
                stop(self.received)
            yield
        finally:
            self._stop = None

    def exit_if_received(self) -> None:
        """Exit with the first signal's `EXIT_CODES` if one came; call it where nothing is
        running that a signal should stop (before starting, after stopping).

        Further signals are ignored from here: the interpreter's exit puts SIG_DFL back in
        place of a Python handler (not of SIG_IGN), so a second Ctrl-C during a slow exit
        (grpc's teardown) would otherwise end the process by the signal, not with the code."""
        if self.received is not None:
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
            raise SystemExit(EXIT_CODES[signal.Signals(self.received)])


PROCESS = StopSignals()
"""This process's instance: signal handlers are per process, so is what they record."""
