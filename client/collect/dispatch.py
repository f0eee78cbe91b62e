"""Sending rollouts to the entry point: at most `concurrency` in flight, each attempt written
ahead to the dispatch log, each reply classified and recorded."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx

from rollout_checkpoint.client.collect.checkpoints import CheckpointStepHook
from rollout_checkpoint.client.collect.groups import GroupWriter
from rollout_checkpoint.client.collect.journal import DurableAppender, json_line
from rollout_checkpoint.client.collect.outcome import classify, transport_failure
from rollout_checkpoint.client.collect.receipts import (
    RECEIPT_HEADER,
    RECEIPT_REQUEST,
    SOURCE_HEADER,
    Acknowledgements,
    DeliverySteps,
)
from rollout_checkpoint.client.collect.rollouts import Rollout, RolloutBook
from rollout_checkpoint.client.participant import receipt_from_header
from rollout_checkpoint.server.core.receipts import Receipt
from rollout_checkpoint.v1 import participant_service_pb2 as pb


class Dispatcher:
    """Moves pending rollouts of `book` in flight and records their replies.

    Every attempt is in the dispatch log, durably, before its `/run` leaves: after a crash,
    every attempt that may run somewhere is known. A reply counts only once its output line
    is durable, and that line waits for its prompt group (`groups`): the group is written
    whole, in one write, once sealed. An entry point that refuses before the episode began
    (admission closed) is backed off from (up to 1 s) and the same attempt is sent again.

    `on_change` is called whenever the book changed (a reply, a refusal, a failure);
    `on_fatal` with an error that must stop the run (the output or the log cannot be
    written, or a bug): a rollout left "in flight" forever would hang it instead."""

    def __init__(
        self,
        book: RolloutBook,
        output: DurableAppender,
        dispatch_log: DurableAppender,
        http: httpx.AsyncClient,
        *,
        entry_url: str,
        concurrency: int,
        on_change: Callable[[], None],
        on_fatal: Callable[[BaseException], None],
        acknowledgements: Acknowledgements | None = None,
        step_hook: CheckpointStepHook | None = None,
    ) -> None:
        self.book = book
        self.acknowledgements = acknowledgements
        self._steps = DeliverySteps(step_hook)
        self.output = output
        self.groups = GroupWriter(book, output)
        self.dispatch_log = dispatch_log
        self.http = http
        self.entry_url = entry_url.rstrip("/")
        self.concurrency = concurrency
        self.on_change = on_change
        self.on_fatal = on_fatal
        self.gate_open = True
        """Closed while a checkpoint runs (and for good once the run stops)."""
        self._dispatching = asyncio.Lock()
        self._wake = asyncio.Event()
        self._backoff_until = 0.0
        self._backoff = 0.0

    def wake(self) -> None:
        """Something changed that may allow a dispatch."""
        self._wake.set()

    def close_gate(self) -> None:
        """Start nothing new until `reopen` (a dispatch under way still finishes: `pause`
        waits for it)."""
        self.gate_open = False

    async def pause(self) -> None:
        """Close the gate; returns once a dispatch under way has finished (none starts until
        `reopen`)."""
        self.close_gate()
        async with self._dispatching:
            pass

    def reopen(self) -> None:
        """Open the gate again after `pause`."""
        self.gate_open = True
        self.wake()

    async def run(self) -> None:
        """Dispatch until cancelled; a failure goes to `on_fatal` and ends the loop."""
        try:
            while True:
                while not self._dispatchable():
                    self._wake.clear()
                    if self._dispatchable():
                        break
                    await self._wake.wait()
                pause = self._backoff_until - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                    continue
                async with self._dispatching:
                    if not self._dispatchable():
                        continue
                    batch = self.book.take(self.concurrency - self.book.in_flight)
                    # Written ahead: after a crash, every attempt that may run is known.
                    await self.dispatch_log.append(
                        *(
                            json_line({"rollout_id": r.rollout_id, "attempt": r.attempt})
                            for r in batch
                        )
                    )
                    for rollout in batch:
                        rollout.handle = asyncio.create_task(self._run_one(rollout))
        except Exception as error:  # the output failed, or a bug: stop rather than hang
            self.on_fatal(error)

    async def cancel_in_flight(self) -> None:
        """Cancel every `/run` still waiting for its reply, and wait until they ended."""
        handles = self.book.running_handles()
        for handle in handles:
            handle.cancel()
        await asyncio.gather(*handles, return_exceptions=True)

    async def settle_in_flight(self, within: float) -> int:
        """Wait up to `within` seconds for every `/run` still waiting for its reply to end,
        then cancel the rest; returns how many were cancelled. Only for attempts that are
        retired everywhere (a recovery): nothing of them can run on, so dropping their
        request loses nothing."""
        handles = self.book.running_handles()
        if handles:
            await asyncio.wait(handles, timeout=within)
        left = self.book.running_handles()
        for handle in left:
            handle.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return len(left)

    def _dispatchable(self) -> bool:
        return self.gate_open and bool(self.book.pending) and self.book.in_flight < self.concurrency

    async def _run_one(self, rollout: Rollout) -> None:
        book = self.book
        url = f"{self.entry_url}/ng-rollout/{rollout.episode.capture_key}/run"
        try:
            receipt, source = None, "run"
            try:
                response = await self.http.post(
                    url, json={"task": rollout.task.row}, headers=RECEIPT_REQUEST
                )
                outcome = classify(response)
                receipt, source = receipt_of(response)
            except httpx.HTTPError as error:
                outcome = transport_failure(error)
            if outcome.kind == "ok":
                assert outcome.reply is not None
                self._steps("received")
                line = rollout.finished_line(outcome.reply, receipt, source)
                # Its group's write, once sealed, is durable first, acknowledged second.
                if await self.groups.hold(rollout, line, receipt):
                    self._steps("persisted")
                    if self.acknowledgements is not None:
                        self.acknowledgements.owed()
                self._backoff = 0.0
            elif outcome.kind == "not_started":
                book.not_started(rollout)
                self._backoff = min(max(self._backoff * 2, 0.05), 1.0)
                self._backoff_until = time.monotonic() + self._backoff
            else:
                book.attempt_failed(rollout, outcome.error)
        except Exception as error:  # the output failed, or a bug: a rollout left "in flight"
            self.on_fatal(error)  # forever would hang the run, so stop it
        finally:
            book.in_flight -= 1
            self.on_change()


def receipt_of(response: httpx.Response) -> tuple[pb.ResultReceipt | None, str]:
    """The receipt a reply carries (None: an entry that issues none, a reply that is no
    result, or a header that is no valid receipt: the line is written without one, and the
    entry keeps what it holds until a `--resume` or a new run takes or releases it) and where
    the result came from (`run`, or `outbox`: held, offered again)."""
    source = response.headers.get(SOURCE_HEADER, "run")
    header = response.headers.get(RECEIPT_HEADER)
    if header is None:
        return None, source
    try:
        receipt = receipt_from_header(header)
        Receipt.from_json(json.loads(header))  # every field checked, as the ledger keeps it
    except ValueError:
        return None, source
    return receipt, source
