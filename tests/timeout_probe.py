"""Hanging tests, run only by tests/test_test_support.py in a pytest of its own (the name does
not match test_*.py, so the suite never collects it) with a timeout of a second."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

FLAG = Path(os.environ.get("TIMEOUT_PROBE_FLAG", "/nonexistent"))


async def test_an_async_test_that_hangs() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # noqa: ASYNC220
    FLAG.write_text(str(child.pid))
    try:
        await asyncio.Event().wait()
    finally:  # runs only if the timed-out test's coroutine is cancelled
        child.kill()
        child.wait()
        FLAG.write_text("cleaned up")


async def test_the_next_test_runs_after_its_clean_up() -> None:
    assert FLAG.read_text() == "cleaned up"
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not [t for t in others if "hangs" in repr(t.get_coro())], others


def test_a_blocking_read_that_hangs() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()
    finally:
        child.kill()
        child.wait()


def test_the_run_goes_on() -> None:
    pass
