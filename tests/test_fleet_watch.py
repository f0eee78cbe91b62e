"""What a controller learns about the fleet: member changes, and WatchFleet's numbered events.

* `membership.FleetWatch` on real processes: a member that is SIGKILLed is DOWN at once (its
  health stream breaks; no poll interval passes), and its replacement on the same address is
  REPLACED (a new boot id), not UP — a poll of health alone could not tell them apart.
* `FleetEventLog`: events are numbered, replayed after the sequence a reconnecting reader saw,
  sent live to every reader (over real gRPC, with the token), and a reader too far behind is
  cut off (RESOURCE_EXHAUSTED on the wire) rather than holding an unbounded queue in the
  coordinator.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from rollout_checkpoint.client.coordinator.calls import status_of
from rollout_checkpoint.client.coordinator.fleet_events import FleetEventLog, WatcherTooSlow
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.client.fleet.membership import Change, FleetWatch, MemberEvent
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .conftest import TOKEN
from .test_supervisor import CounterFleet, counters  # noqa: F401 (the fixture)

WAIT = 30.0


class Changes:
    def __init__(self) -> None:
        self.seen: list[MemberEvent] = []
        self.changed = asyncio.Condition()

    def __call__(self, event: MemberEvent) -> None:
        self.seen.append(event)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, change: Change, count: int = 1) -> MemberEvent:
        def found() -> bool:
            return sum(e.change is change for e in self.seen) >= count

        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(found), WAIT)
        return [e for e in self.seen if e.change is change][count - 1]


def two_counters_watched(counters: CounterFleet, tmp_path: Path) -> tuple[Changes, FleetWatch]:  # noqa: F811
    """Counters c0 and c1 and a started watch of them that probes only on reconnection."""
    counters.start("c0")
    counters.start("c1")
    changes = Changes()
    watch = FleetWatch(counters.spec(tmp_path / "checkpoints"), changes, probe_seconds=3600.0)
    watch.start()
    return changes, watch


async def test_a_killed_member_is_down_at_once_and_its_replacement_is_replaced(
    counters: CounterFleet,  # noqa: F811
    tmp_path: Path,
) -> None:
    # A probe interval far longer than the test: only the health stream can report the
    # death in time, and only the boot id read on reconnection can report the replacement.
    changes, watch = two_counters_watched(counters, tmp_path)
    try:
        first = await changes.wait_for(Change.UP, 2)
        assert first.boot_id and first.kind and first.instance
        boot_ids = watch.boot_ids()
        counters.kill("c1")
        down = await changes.wait_for(Change.DOWN)
        assert down.name == "c1" and watch.down() == {"c1"}
        old = counters.members["c1"]
        counters.start("c1", start_closed=True, http=old.http, grpc=old.grpc)
        replaced = await changes.wait_for(Change.REPLACED)
        assert replaced.name == "c1"
        assert replaced.previous_boot_id == boot_ids["c1"] != replaced.boot_id
        assert watch.down() == set()
        assert [e.change for e in changes.seen if e.name == "c0"] == [Change.UP]
    finally:
        await watch.close()


OUTAGE_SECONDS = 15.0
"""Long enough for gRPC's default reconnect backoff (1 s, x1.6) to leave gaps of 4 s and more
between connection attempts (its attempts come at about 1, 2.6, 5.2, 9.3 and 15.8 s)."""
SEEN_WITHIN_SECONDS = 1.5
"""The goal: a replacement seen within this of listening, whatever the outage's length."""


async def test_a_replacement_after_a_long_outage_is_seen_at_once(
    counters: CounterFleet,  # noqa: F811
    tmp_path: Path,
) -> None:
    """During the outage a listener on the member's port accepts every connection and drops
    it (a failed attempt for gRPC), so the watch's attempts are seen: a watch that probes on
    the channel that lost the member keeps to that channel's growing backoff (a probe while
    it backs off fails without dialling), and saw a replacement after a 150 s outage up to
    45 s late. A watch that dials for every probe sees it within a probe interval."""
    changes, watch = two_counters_watched(counters, tmp_path)
    try:
        await changes.wait_for(Change.UP, 2)
        old = counters.members["c1"]
        counters.kill("c1")
        await changes.wait_for(Change.DOWN)
        attempts: list[float] = []

        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            attempts.append(time.monotonic())
            writer.close()

        host, port = old.grpc.rsplit(":", 1)
        outage = await asyncio.start_server(drop, host, int(port))
        await asyncio.sleep(OUTAGE_SECONDS)  # the outage's length, the scenario's parameter
        outage.close()
        await outage.wait_closed()
        gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
        assert len(attempts) > OUTAGE_SECONDS and max(gaps) < 2.0, gaps  # it kept dialling
        await asyncio.to_thread(
            counters.start, "c1", start_closed=True, http=old.http, grpc=old.grpc
        )
        listening = time.monotonic()
        replaced = await changes.wait_for(Change.REPLACED)
        seen_after = time.monotonic() - listening
        assert replaced.name == "c1"
        assert seen_after < SEEN_WITHIN_SECONDS, seen_after
    finally:
        await watch.close()


async def test_events_are_numbered_replayed_after_a_sequence_and_sent_live() -> None:
    log = FleetEventLog(kept=4)
    for name in ("a", "b", "c"):
        log.emit(member_up=cpb.MemberChange(member=cpb.Member(name=name)))
    reader = log.read(after_sequence=1)
    replayed = [await anext(reader), await anext(reader)]
    assert [e.sequence for e in replayed] == [2, 3]
    assert {e.coordinator_boot_id for e in replayed} == {log.boot_id}
    pending = asyncio.ensure_future(anext(reader))
    await asyncio.sleep(0)
    assert not pending.done()
    log.emit(member_down=cpb.MemberChange(member=cpb.Member(name="a")))
    live = await asyncio.wait_for(pending, WAIT)
    assert live.sequence == 4 and live.WhichOneof("event") == "member_down"
    # Only the newest `kept` are held for replay.
    for _ in range(3):
        log.emit(member_up=cpb.MemberChange())
    assert [e.sequence for e in log.held()] == [4, 5, 6, 7]
    live_only = log.read(live_only=True)
    waiting = asyncio.ensure_future(anext(live_only))
    await asyncio.sleep(0)
    log.emit(member_up=cpb.MemberChange())
    assert (await asyncio.wait_for(waiting, WAIT)).sequence == 8
    log.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(live_only), WAIT)
    await reader.aclose()


async def test_a_reader_too_far_behind_is_cut_off() -> None:
    log = FleetEventLog(kept=3)
    reader = log.read(live_only=True)
    first = asyncio.ensure_future(anext(reader))
    await asyncio.sleep(0)
    for _ in range(5):  # three fill the reader's queue, the fourth and fifth overflow it
        log.emit(member_up=cpb.MemberChange())
    assert (await first).sequence == 1
    # What was queued before the overflow is still delivered, then the reader is cut off
    # (it must reconnect with the last sequence it saw: 3).
    got = [(await anext(reader)).sequence for _ in range(2)]
    assert got == [2, 3]
    with pytest.raises(WatcherTooSlow) as cut:
        await anext(reader)
    # On the wire: RESOURCE_EXHAUSTED, no reason (documented on WatchFleet).
    status = status_of(cut.value)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and not status.details


async def test_watch_fleet_over_grpc_replays_after_a_sequence_and_needs_the_token(
    tmp_path: Path,
) -> None:
    spec = FleetSpec(members=(MemberSpec("m", "127.0.0.1:1"),), token=TOKEN)
    coordinator = Coordinator(spec, "127.0.0.1:0", grace=0.2)
    await coordinator.start()
    try:
        events: Any = coordinator.events
        for name in ("a", "b"):
            events.emit(member_up=cpb.MemberChange(member=cpb.Member(name=name)))
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        async with aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            call = stub.WatchFleet(cpb.WatchFleetRequest(after_sequence=1), metadata=metadata)
            reply = await asyncio.wait_for(call.read(), WAIT)
            assert reply.event.sequence == 2
            assert reply.event.member_up.member.name == "b"
            call.cancel()
            # Without a token: refused like every other RPC.
            with pytest.raises(aio.AioRpcError) as refused:
                async for _ in stub.WatchFleet(cpb.WatchFleetRequest()):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await coordinator.stop()
