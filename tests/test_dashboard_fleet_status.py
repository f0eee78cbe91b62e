"""`GET /fleet/status` asks the members through the coordinator's held fleet: one poll opens
no channel and sends only GetStatus, and a poll during a checkpoint of this coordinator asks
no member at all (the last answer, marked stale). Before, every poll opened a channel per
member and sent GetParticipant + GetStatus to each, which lengthened a 1,000-member fleet's
checkpoint pause about 1.5x while a page was open."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from grpc import aio

from rollout_checkpoint.client.coordinator.dashboard import fleet_status
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import ParticipantClient, timestamp
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .conftest import TOKEN
from .test_coordinator_refusals import AUTH, environments

MEMBERS = 3


@pytest.fixture
def member_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Channels opened (`client`) and member RPCs sent, by method, from now on."""
    calls: Counter[str] = Counter()
    for method in ("__init__", "get_participant", "get_status"):
        original = getattr(ParticipantClient, method)

        def counted(self: Any, *args: Any, _o: Any = original, _m: str = method, **kw: Any) -> Any:
            calls[_m] += 1
            return _o(self, *args, **kw)

        monkeypatch.setattr(ParticipantClient, method, counted)
    monkeypatch.setattr(fleet_status, "FRESH_SECONDS", 0.0)  # every poll asks (when it may)
    monkeypatch.setattr(fleet_status, "MEMBERS_PER_SECOND", math.inf, raising=False)
    return calls


async def poll(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/fleet/status", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_a_poll_asks_only_getstatus_over_the_held_fleets_channels(
    tmp_path: Path, member_calls: Counter[str]
) -> None:
    async with environments(MEMBERS) as h:
        spec = FleetSpec(
            members=tuple(MemberSpec(name, x.grpc_address) for name, x in h.items()),
            token=TOKEN,
            checkpoint_root=str(tmp_path / "root"),
        )
        coordinator = Coordinator(spec, "127.0.0.1:0", http_address="127.0.0.1:0")
        await coordinator.start()
        assert coordinator.http_listener is not None
        base = f"http://{coordinator.http_listener.bound_address}"
        try:
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                first = await poll(http)  # discovers the fleet: one channel per member
                assert [m["health"] for m in first["members"]] == ["serving"] * MEMBERS
                assert first["members"][0]["kind"] == "environment"
                member_calls.clear()
                second = await poll(http)
                assert [m["name"] for m in second["members"]] == list(h)
                assert member_calls == Counter(get_status=MEMBERS), member_calls
                assert second["stale"] is False

                release = h["env-0"].participant.gate("export")
                request = cpb.CheckpointRequest(
                    checkpoint_id="c1", deadline=timestamp(time.time() + 60)
                )
                async with aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
                    stub = cpb_grpc.CoordinatorServiceStub(channel)
                    call = stub.Checkpoint(request, metadata=AUTH, timeout=60)
                    replies = asyncio.ensure_future(_all(call))
                    await h["env-0"].participant.entered["export"].wait()
                    member_calls.clear()
                    during = await poll(http)
                    assert during["stale"] is True
                    assert during["members"] == second["members"]
                    assert sum(member_calls.values()) == 0, member_calls
                    release.set()
                    assert (await replies)[-1].result.published
                assert (await poll(http))["stale"] is False
        finally:
            await coordinator.stop()


async def _all(call: Any) -> list[cpb.CheckpointResponse]:
    return [reply async for reply in call]


def test_the_freshness_interval_grows_with_the_fleet() -> None:
    def held() -> Any:
        raise AssertionError("not asked")

    def spec(members: int) -> FleetSpec:
        return FleetSpec(
            members=tuple(MemberSpec(f"m{i}", f"127.0.0.1:{i + 1}") for i in range(members)),
            token=TOKEN,
        )

    assert fleet_status.FleetStatus(spec(10), held, bool).fresh_seconds == 1.5
    big = fleet_status.FleetStatus(spec(5000), held, bool).fresh_seconds
    assert big == 5000 / fleet_status.MEMBERS_PER_SECOND
