"""Completion receipts and the result outbox (issue 37, part 1).

A run whose caller asks for a receipt (`x-rollout-receipt: request`) has its result held in
the entry participant's outbox before the reply goes out; a late run of the same rollout gets
the held result instead of running again; every checkpoint carries the outbox, so after a
crash the restored participant offers the unacknowledged results again (ListResults) and
answers the replacement's run from it; AcknowledgeResults releases them, idempotently, all
or nothing; a full outbox refuses new receipted runs with a typed, retryable reason.

Real servers on 127.0.0.1:0: a small entry app on the library's `EpisodeParticipant` that
counts the runs it really makes, and (at the end) the example environment served with three
workers, in processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_checkpoint.client.participant import ParticipantClient, receipt_from_header
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.episodic.episode_participant import EpisodeParticipant
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.server.runtime.result_outbox import (
    Produced,
    Receipt,
    ResultOutbox,
    canonical_json,
    held_result,
    result_digest,
)
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware, episode_of
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import participant_service_pb2 as pb

from .conftest import TOKEN, drain, refused, serve_app
from .processes import kill_group
from .test_workers import serve_workers, stub_agent  # noqa: F401 (fixtures)

ASK = {"x-rollout-receipt": "request"}


def deadline(seconds: float = 30.0) -> float:
    return time.time() + seconds


# -- the outbox itself ----------------------------------------------------------------------


def result_of(rollout: str, attempt: int = 0, value: Any = None) -> Any:
    canonical = canonical_json({"rollout": rollout, "value": value})
    request = result_digest(canonical_json({"x": 1}))
    return held_result(
        Produced(EpisodeId(rollout, attempt), "/run", request, canonical, result_digest(canonical)),
        (),
    )


def test_acknowledging_is_idempotent_and_all_or_nothing() -> None:
    outbox = ResultOutbox(cap=10)
    first, second = result_of("a"), result_of("b", 2)
    outbox.put(first)
    outbox.put(second)
    wrong = Receipt("b", 2, "0" * 64)
    with pytest.raises(CheckpointError, match="another digest") as refused_call:
        outbox.acknowledge([first.receipt, wrong])
    assert refused_call.value.reason == "RECEIPT_MISMATCH"
    assert len(outbox) == 2  # nothing released by the refused call
    done = outbox.acknowledge([first.receipt, first.receipt])
    assert (done.released, done.not_held) == (1, 1)
    again = outbox.acknowledge([first.receipt])
    assert (again.released, again.not_held) == (0, 1)
    # Released, it is still remembered: another digest for that attempt is refused.
    with pytest.raises(CheckpointError, match="another digest") as contradicted:
        outbox.acknowledge([Receipt("a", 0, "f" * 64)])
    assert contradicted.value.reason == "RECEIPT_MISMATCH"
    # An unknown receipt changes nothing.
    assert outbox.acknowledge([Receipt("zz", 0, "e" * 64)]).not_held == 1
    assert [h.receipt.rollout_id for h in outbox.results()] == ["b"]


def test_canonical_json_ignores_key_order_and_keeps_big_integers() -> None:
    assert canonical_json({"b": 1, "a": [1, "é"]}) == canonical_json({"a": [1, "é"], "b": 1})
    assert canonical_json({"n": 2**80}) == f'{{"n":{2**80}}}'


def test_an_outbox_record_round_trips_and_a_tampered_one_is_refused() -> None:
    from rollout_checkpoint.server.runtime.records_codec import EncodedJSON
    from rollout_checkpoint.server.runtime.result_outbox import HeldResult

    held = result_of("r", 1, {"x": [1.5, None]})
    fields = dict(held.record_fields())
    stored = {k: json.loads(v.data) if isinstance(v, EncodedJSON) else v for k, v in fields.items()}
    back = HeldResult.from_record(EpisodeId("r", 2), stored)
    assert back.receipt == held.receipt and back.canonical == held.canonical
    tampered = dict(stored, outbox_result={"rollout": "r", "value": {"x": [2.5, None]}})
    with pytest.raises(ValueError, match="digest"):
        HeldResult.from_record(EpisodeId("r", 2), tampered)
    with pytest.raises(ValueError, match="holds exactly"):
        HeldResult.from_record(EpisodeId("r", 2), dict(stored, extra=1))


# -- an entry app on the library ------------------------------------------------------------


@dataclass
class Entry:
    """An entry server whose `/run` doubles its input, counting every run it really makes."""

    settings: CheckpointSettings
    runs: list[str] = field(default_factory=list)
    participant: EpisodeParticipant = field(
        default_factory=lambda: EpisodeParticipant(Kind.AGENT, "entry")
    )
    runtime: CheckpointRuntime | None = None

    def app(self) -> Starlette:
        async def run(request: Request) -> JSONResponse:
            episode = episode_of(request.scope)
            assert episode is not None
            tracker = self.participant.episodes_tracker
            tracked, _ = tracker.begin(episode)
            try:
                body = await request.json()
                if body.get("fail"):
                    return JSONResponse({"error": "failed"}, status_code=502)
                self.runs.append(episode.capture_key)
                result = {"rollout": episode.rollout_id, "doubled": body["x"] * 2, "note": "é"}
                tracker.finish(tracked, {"done": result})
                return JSONResponse(result)
            finally:
                tracker.end(tracked)

        app = Starlette(routes=[Route("/run", run, methods=["POST"])])
        app.add_middleware(RolloutPrefixMiddleware)
        self.runtime = install_checkpointing(app, self.participant, self.settings)
        return app


@dataclass
class Served:
    entry: Entry
    http: httpx.AsyncClient
    client: ParticipantClient


@contextlib.asynccontextmanager
async def entry_server(**settings: Any) -> AsyncIterator[Served]:
    entry = Entry(CheckpointSettings(enabled=True, token=TOKEN, **settings))
    runner, serving, port = await serve_app(entry.app())
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
    assert entry.runtime is not None
    client = ParticipantClient(entry.runtime.address, TOKEN)
    try:
        yield Served(entry, http, client)
    finally:
        await http.aclose()
        await client.close()
        runner.should_exit = True
        await serving


async def run(served: Served, key: str, x: int = 1, **headers: str) -> httpx.Response:
    return await served.http.post(f"/ng-rollout/{key}/run", json={"x": x}, headers=headers)


async def test_a_late_run_gets_the_held_result_and_runs_nothing(tmp_path: Path) -> None:
    async with entry_server() as s:
        first = await run(s, "r1", 21, **ASK)
        assert first.status_code == 200, first.text
        assert first.headers["x-rollout-result-source"] == "run"
        receipt = receipt_from_header(first.headers["x-rollout-receipt"])
        assert (receipt.rollout_id, receipt.attempt) == ("r1", 0)
        assert receipt.result_sha256 == result_digest(canonical_json(first.json()))
        assert list(receipt.lineage) == []
        # The reply was lost: the trainer sends the run again, as it was, or as attempt 1.
        for key in ("r1", "r1-a1"):
            late = await run(s, key, 21, **ASK)
            assert late.status_code == 200
            assert late.json() == first.json()
            assert late.headers["x-rollout-result-source"] == "outbox"
            assert receipt_from_header(late.headers["x-rollout-receipt"]) == receipt
        assert s.entry.runs == ["r1-a0"] or s.entry.runs == ["r1"]
        assert len(s.entry.runs) == 1
        listed = await s.client.list_results()
        assert (listed.held, listed.cap) == (1, 10_000)
        assert listed.results[0].receipt == receipt
        assert json.loads(listed.results[0].result_json) == first.json()
        assert listed.results[0].request_sha256 == result_digest(canonical_json({"x": 21}))
        status = await s.client.get_status()
        assert status.counters["outbox_held"] == 1
        assert status.counters["outbox_offered_again"] == 2
        # A run without a receipt is the old contract: it runs, nothing is held for it.
        plain = await run(s, "r2", 5)
        assert "x-rollout-receipt" not in plain.headers
        assert (await s.client.list_results()).held == 1
        # A failed run is no result: passed through, no receipt, nothing held.
        failed = await s.http.post("/ng-rollout/r3/run", json={"fail": True}, headers=ASK)
        assert failed.status_code == 502 and "x-rollout-receipt" not in failed.headers
        # Acknowledged, it leaves at once; the next run of the rollout runs again.
        acked = await s.client.acknowledge_results([receipt], deadline())
        assert (acked.released, acked.not_held) == (1, 0)
        acked = await s.client.acknowledge_results([receipt], deadline())
        assert (acked.released, acked.not_held) == (0, 1)
        assert (await s.client.list_results()).held == 0
        again = await run(s, "r1-a2", 21, **ASK)
        assert again.headers["x-rollout-result-source"] == "run"


async def test_a_late_run_of_another_task_is_refused_not_answered_with_the_held_result() -> None:
    """A result is held for the request that produced it: the same rollout sent with another
    task (a trainer reusing an id) is refused 409 `request_mismatch`, and nothing runs; the
    same task with its keys in another order is the same request."""
    async with entry_server() as s:
        first = await s.http.post("/ng-rollout/r1/run", json={"x": 1, "y": 2}, headers=ASK)
        assert first.headers["x-rollout-result-source"] == "run"
        other = await s.http.post("/ng-rollout/r1/run", json={"x": 3, "y": 2}, headers=ASK)
        assert other.status_code == 409
        assert other.json()["error"]["code"] == "request_mismatch"
        same = await s.http.post(
            "/ng-rollout/r1-a1/run",
            content=b'{"y": 2, "x": 1}',
            headers={**ASK, "content-type": "application/json"},
        )
        assert same.headers["x-rollout-result-source"] == "outbox"
        assert len(s.entry.runs) == 1


async def test_a_mismatched_digest_is_refused_and_releases_nothing() -> None:
    async with entry_server() as s:
        receipts = []
        for key in ("a", "b"):
            reply = await run(s, key, 1, **ASK)
            receipts.append(receipt_from_header(reply.headers["x-rollout-receipt"]))
        wrong = pb.ResultReceipt(rollout_id="b", attempt=0, result_sha256="ab" * 32)
        await refused(
            s.client.acknowledge_results([receipts[0], wrong], deadline()), "RECEIPT_MISMATCH"
        )
        assert (await s.client.list_results()).held == 2
        bad = pb.ResultReceipt(rollout_id="b", attempt=0, result_sha256="XYZ")
        await refused(s.client.acknowledge_results([bad], deadline()), "INVALID_REQUEST")
        await refused(s.client.acknowledge_results([], deadline()), "INVALID_REQUEST")


async def test_a_full_outbox_refuses_new_receipted_runs_and_serves_held_ones() -> None:
    async with entry_server(outbox_cap=2) as s:
        held = [await run(s, key, 1, **ASK) for key in ("a", "b")]
        full = await run(s, "c", 1, **ASK)
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "outbox_full"
        assert full.headers["retry-after"] == "1"
        assert [k for k in s.entry.runs] == ["a", "b"] or len(s.entry.runs) == 2
        # A held result is still offered; an acknowledgement makes room.
        assert (await run(s, "a", 1, **ASK)).headers["x-rollout-result-source"] == "outbox"
        receipt = receipt_from_header(held[0].headers["x-rollout-receipt"])
        await s.client.acknowledge_results([receipt], deadline())
        assert (await run(s, "c", 1, **ASK)).status_code == 200


async def test_the_outbox_survives_a_checkpoint_and_is_offered_again_after_restore(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "ckpt")
    async with entry_server() as s:
        replies = {key: await run(s, key, i, **ASK) for i, key in enumerate(("r1", "r2", "r3"))}
        acked = receipt_from_header(replies["r3"].headers["x-rollout-receipt"])
        await s.client.acknowledge_results([acked], deadline())
        await drain(s.client.prepare("c1", deadline()))
        # A scope that names none of them: the outbox is in the checkpoint anyway.
        committed = await s.client.commit("c1", deadline(), path, scope=[])
        assert committed.manifest.record_count == 2
        await s.client.resume("c1", deadline())
    async with entry_server(start_closed=True) as fresh:
        restored = await fresh.client.restore("back", deadline(), path, scope=[])
        assert list(restored.restored) == []  # held results are no episodes to continue
        listed = await fresh.client.all_results()
        assert [h.capture_key for h in listed] == ["r1-a1", "r2-a1"]
        for held in listed:
            original = replies[held.receipt.rollout_id]
            assert held.receipt == receipt_from_header(original.headers["x-rollout-receipt"])
            assert json.loads(held.result_json) == original.json()
        await fresh.client.resume("back", deadline())
        # The replacement's run (attempt 1) gets the result; nothing runs again.
        late = await run(fresh, "r1-a1", 0, **ASK)
        assert late.headers["x-rollout-result-source"] == "outbox"
        assert late.json() == replies["r1"].json()
        assert fresh.entry.runs == []
        # A result produced after the restore carries the restored checkpoint as lineage.
        new = await run(fresh, "r9", 9, **ASK)
        assert list(receipt_from_header(new.headers["x-rollout-receipt"]).lineage) == ["c1"]
        # A Retire of the rollout gives it up.
        await fresh.client.retire("retire-1", deadline(), [EpisodeId("r2", 1)])
        assert [h.capture_key for h in await fresh.client.all_results()] == ["r1-a1", "r9"]


async def test_a_survivor_rejoining_a_restore_keeps_its_newer_results(tmp_path: Path) -> None:
    """A survivor of a fleet restored as a whole (rejoin) holds results finished after the
    checkpoint: they stay (nothing else has them), and the checkpoint's are added for the
    rollouts it holds nothing of."""
    path = str(tmp_path / "ckpt")
    async with entry_server() as s:
        old = {key: await run(s, key, 1, **ASK) for key in ("a", "b")}
        await drain(s.client.prepare("c1", deadline()))
        await s.client.commit("c1", deadline(), path, scope=[])
        await s.client.resume("c1", deadline())
        # After the checkpoint: both acknowledged, "a" run again as attempt 1 (a new
        # result), "n" finished.
        await s.client.acknowledge_results(
            [receipt_from_header(r.headers["x-rollout-receipt"]) for r in old.values()],
            deadline(),
        )
        newer = await run(s, "a-a1", 5, **ASK)
        await run(s, "n", 7, **ASK)
        await s.client.restore("back", deadline(), path, scope=[], rejoin=True)
        held = {h.receipt.rollout_id: h for h in await s.client.all_results()}
        assert sorted(held) == ["a", "b", "n"]
        assert held["a"].receipt == receipt_from_header(newer.headers["x-rollout-receipt"])
        assert held["b"].capture_key == "b-a1"  # the checkpoint's, restored as attempt 1
        assert held["n"].capture_key == "n"
        await s.client.resume("back", deadline())


async def test_a_result_with_an_integer_past_64_bits_is_held_exactly() -> None:
    async with entry_server() as s:
        big = 2**80 + 1
        reply = await run(s, "big", big, **ASK)
        assert reply.json()["doubled"] == 2 * big
        (held,) = await s.client.all_results()
        assert json.loads(held.result_json)["doubled"] == 2 * big
        receipt = receipt_from_header(reply.headers["x-rollout-receipt"])
        assert receipt.result_sha256 == result_digest(canonical_json(reply.json()))


# -- several workers: one outbox in the main process ----------------------------------------


async def test_with_three_workers_a_late_run_on_any_worker_gets_the_held_result(
    serve_workers: Callable[..., Any],  # noqa: F811 (the fixture)
    stub_agent: tuple[Any, str],  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    """The example environment served with three workers, in processes: each run is held
    in the main process, so the late runs, spread over the workers by their connections,
    all get it; the outbox goes into the checkpoint with the workers' records, and a
    replacement served with three workers offers it again after a SIGKILL."""
    agent, agent_url = stub_agent
    agent.gate.set()
    first = serve_workers("environment", "--agent-url", agent_url)
    client = first.client
    task = {"task": {"question": "q", "id": 1}}
    replies = {}
    for i in range(6):
        reply = await post_with(first.base_url, f"/ng-rollout/r{i}/run", task, ASK)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-rollout-result-source"] == "run"
        replies[f"r{i}"] = reply
    arrived = len(agent.arrived)
    late = await asyncio.gather(
        *(post_with(first.base_url, f"/ng-rollout/r{i % 6}/run", task, ASK) for i in range(24))
    )
    assert {r.headers["x-rollout-result-source"] for r in late} == {"outbox"}
    assert len(agent.arrived) == arrived  # nothing ran again, on any worker
    assert (await client.list_results()).held == 6
    receipt = receipt_from_header(replies["r0"].headers["x-rollout-receipt"])
    assert (await client.acknowledge_results([receipt], deadline())).released == 1
    assert (await client.prepare_until_final("c1", deadline())).final
    checkpoint_dir = str(tmp_path / "ckpt")
    await client.commit("c1", deadline(), checkpoint_dir, scope=[])
    await client.close()
    kill_group(first.process)

    fresh = serve_workers("environment", "--agent-url", agent_url, "--start-closed")
    await fresh.client.restore("back", deadline(), checkpoint_dir, scope=[])
    held = await fresh.client.all_results()
    assert [h.capture_key for h in held] == [f"r{i}-a1" for i in range(1, 6)]
    await fresh.client.resume("back", deadline())
    again = await asyncio.gather(
        *(post_with(fresh.base_url, f"/ng-rollout/r{i}-a1/run", task, ASK) for i in range(1, 6))
    )
    assert [r.json() for r in again] == [replies[f"r{i}"].json() for i in range(1, 6)]
    assert {r.headers["x-rollout-result-source"] for r in again} == {"outbox"}
    assert len(agent.arrived) == arrived
    await fresh.client.close()


async def post_with(base_url: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    """A request on a connection of its own, so whichever worker accepts it gets it."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60, verify=False) as http:
        return await http.post(path, json=body, headers=headers)


async def test_collect_refuses_a_run_the_entrys_outbox_cannot_hold() -> None:
    """Prompt groups keep their finished siblings held until the group is written: a run
    whose concurrency x repeats exceeds an entry's cap would deadlock on `outbox_full`, so
    `collect` refuses it before dispatching anything, naming the member and the cap."""
    from rollout_checkpoint.client.collect.errors import UsageError
    from rollout_checkpoint.client.collect.receipts import check_outbox_room
    from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec

    async with entry_server(outbox_cap=8) as s:
        assert s.entry.runtime is not None
        spec = FleetSpec(
            members=(MemberSpec("entry", s.entry.runtime.address),),
            token=TOKEN,
            allow_agents_without_model=True,
        )
        fleet = await Fleet.discover(spec)
        try:
            await check_outbox_room(fleet, concurrency=2, num_repeats=4)  # 8 fit
            with pytest.raises(UsageError, match="entry's result outbox holds at most 8"):
                await check_outbox_room(fleet, concurrency=3, num_repeats=4)
        finally:
            await fleet.close()
