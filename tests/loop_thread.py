"""An asyncio loop in a background thread, for tests whose driver is synchronous.

Hypothesis calls its test functions (and a RuleBasedStateMachine its rules) synchronously,
so those tests keep the servers (uvicorn + grpc.aio) on a loop of their own in a thread and
talk to them through real sockets with sync gRPC stubs, or run a coroutine there with `run`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def only_when_asked_for(request: pytest.FixtureRequest) -> None:
    """Skip a larger-budget variant unless the run selects slow tests (`-m slow`).

    The full suite runs everything not deselected, so these would otherwise add minutes to
    every `scripts/test`; `-m slow` (or `-m "slow or ..."`) runs them."""
    expression = request.config.getoption("markexpr", "") or ""
    if "slow" not in expression.replace("not slow", ""):
        pytest.skip("a larger budget: run with -m slow")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="test-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run `coro` on the background loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
