"""The counter example declaring `checkpoint_incremental`, as `serve MODULE:ATTRIBUTE` serves
a user's own server: `serve tests.incremental_counter:IncrementalCounter --workers N`
(tests/test_incremental_workers.py)."""

from __future__ import annotations

from rollout_checkpoint.examples.counter import CounterServer


class IncrementalCounter(CounterServer):
    checkpoint_incremental = True
