"""What a Commit reply and GetStatus say of a part: the records it wrote, the records it
references in earlier parts, and how many parts a restore of it reads.

Real servers on 127.0.0.1:0 (a counter server that opts in to incremental parts, one that
does not, and the test double), real data-plane requests and real RPCs. The figures must be
the durable part's, whichever mode of commit: a synchronous reply reads them from the
published manifest, an asynchronous one knows them at the snapshot, before the part exists,
and GetStatus reports a part only once it is durable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from .conftest import prepared as prepared_double
from .conftest import refused, start_harness, stop_harness
from .test_commit import GatedStorage, wait_thread_event
from .test_fleet_cli import cli, real_fleet
from .test_incremental import Fleet, IncrementalCounter, manifest_of
from .test_resources import Running, prepared, running
from .test_restore import STATES, make_checkpoint


def figures(message: Any) -> tuple[int, int, int]:
    """(records written, records referenced, chain length) of a reply or a `last_part`."""
    return (message.records_written, message.records_referenced, message.chain_length)


async def commit(
    r: Running, checkpoint_id: str, directory: Path, *, asynchronous: bool = False
) -> tuple[pb.CommitResponse, Any]:
    """Prepare, commit (unscoped) and resume; the Commit reply and the durable manifest."""
    assert (await prepared(r, checkpoint_id)).state == types_pb2.PARTICIPANT_STATE_PREPARED
    reply = await r.client.commit(
        checkpoint_id, r.deadline(), str(directory), asynchronous=asynchronous
    )
    manifest = reply.manifest
    if asynchronous:
        durable = await r.client.await_part(checkpoint_id, r.deadline())
        assert durable.state == pb.PART_WRITE_STATE_DURABLE
        manifest = durable.manifest
    await r.client.resume(checkpoint_id, r.deadline())
    return reply, manifest


async def last_part(r: Running) -> pb.PublishedPart:
    status = await r.client.get_status()
    assert status.HasField("last_part")
    return status.last_part


async def test_sync_replies_and_get_status_say_what_each_part_wrote_and_references(
    tmp_path: Path,
) -> None:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(6)
        assert not (await r.client.get_status()).HasField("last_part")

        full, manifest = await commit(r, "c1", tmp_path / "c1")
        assert figures(full) == (6, 0, 1)
        assert manifest.own_records == 0 and manifest.record_count == 6  # a v1 manifest
        assert (full.snapshot_records, full.snapshot_bytes) == (0, 0)  # synchronous
        part = await last_part(r)
        assert (part.checkpoint_id, part.checkpoint_dir, part.asynchronous) == (
            "c1",
            str(tmp_path / "c1"),
            False,
        )
        assert figures(part) == (6, 0, 1)
        assert (part.record_count, part.bytes) == (6, manifest.bytes)

        await fleet.increment(1)
        await fleet.increment(4)
        chained, manifest = await commit(r, "c2", tmp_path / "c2")
        assert figures(chained) == (2, 4, 2)
        stored = manifest_of(tmp_path / "c2")
        assert (stored["own_records"], stored["referenced_records"], stored["chain_length"]) == (
            2,
            4,
            2,
        )
        part = await last_part(r)
        assert (part.checkpoint_id, figures(part), part.record_count) == ("c2", (2, 4, 2), 6)
        assert part.bytes == manifest.bytes

        unchanged, _ = await commit(r, "c3", tmp_path / "c3")
        assert figures(unchanged) == (0, 6, 3)
        assert figures(await last_part(r)) == (0, 6, 3)


async def test_an_async_reply_knows_at_the_snapshot_what_the_durable_part_holds(
    tmp_path: Path,
) -> None:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(6)
        full, manifest = await commit(r, "c1", tmp_path / "c1", asynchronous=True)
        assert full.snapshot_only and figures(full) == (6, 0, 1)
        assert (full.snapshot_records, full.snapshot_bytes) == (6, manifest.bytes)

        await fleet.increment(3)
        chained, manifest = await commit(r, "c2", tmp_path / "c2", asynchronous=True)
        assert figures(chained) == (1, 5, 2)
        assert (manifest.own_records, manifest.referenced_records, manifest.chain_length) == (
            1,
            5,
            2,
        )
        # The snapshot cut every record of the part; it holds only the one it wrote (the
        # reference lines are the background write's).
        assert chained.snapshot_records == manifest.record_count == 6
        part = tmp_path / "c2" / "participants" / "resources" / "counter"
        own = [
            line
            for line in (part / manifest.records_file).read_bytes().splitlines()
            if b'"$ref":' not in line
        ]
        assert chained.snapshot_bytes == len(own[0]) + 1 < manifest.bytes
        status = await last_part(r)
        assert (status.checkpoint_id, status.asynchronous, figures(status)) == (
            "c2",
            True,
            (1, 5, 2),
        )
        assert (status.record_count, status.bytes) == (6, manifest.bytes)


class FullCounter(CounterServer):
    """The counter example without its opt-in: every part full."""

    checkpoint_incremental = False


async def test_a_server_that_does_not_opt_in_writes_every_record_each_time(
    tmp_path: Path,
) -> None:
    async with running(FullCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(4)
        first, _ = await commit(r, "c1", tmp_path / "c1")
        await fleet.increment(0)
        second, _ = await commit(r, "c2", tmp_path / "c2")
        snapshot, manifest = await commit(r, "c3", tmp_path / "c3", asynchronous=True)
        assert [figures(reply) for reply in (first, second, snapshot)] == [(4, 0, 1)] * 3
        assert manifest.schema_version == 1 and snapshot.snapshot_bytes == manifest.bytes
        assert figures(await last_part(r)) == (4, 0, 1)


async def test_get_status_reports_an_async_part_only_once_it_is_durable(
    checkpoint_dir: str,
) -> None:
    """The test double (one record per episode, never incremental): while its snapshot's
    write is held in storage the fleet runs on, and GetStatus names no part; once the write
    ended it names that one."""
    storage = GatedStorage("before_record")
    h = await start_harness(storage=storage)
    try:
        for name in ("r1", "r2"):
            h.participant.seed(EpisodeId(name), {"n": 1})
        await prepared_double(h)
        reply = await h.client.commit("c1", h.deadline(), checkpoint_dir, asynchronous=True)
        assert figures(reply) == (2, 0, 1) and reply.snapshot_records == 2
        await wait_thread_event(storage.reached)
        await h.client.resume("c1", h.deadline())
        assert not (await h.client.get_status()).HasField("last_part")
        storage.release.set()
        durable = await h.client.await_part("c1", h.deadline())
        assert durable.state == pb.PART_WRITE_STATE_DURABLE
        status = await h.client.get_status()
        assert (status.last_part.checkpoint_id, status.last_part.asynchronous) == ("c1", True)
        assert figures(status.last_part) == (2, 0, 1)
        assert status.last_part.bytes == durable.manifest.bytes == reply.snapshot_bytes
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_a_rejoining_restore_abandons_the_last_part_even_one_still_being_written(
    tmp_path: Path,
) -> None:
    """After a rejoining Restore the process's earlier history is abandoned: GetStatus names
    no part (as a fresh process restored from the same checkpoint), and an asynchronous write
    cut before the Restore that ends after it does not come back as the last part."""
    storage = GatedStorage("before_record")
    h = await start_harness(storage=storage)
    first, second = str(tmp_path / "c1"), str(tmp_path / "c2")
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await prepared_double(h, "c1")
        storage.release.set()  # c1 is written at once
        await h.client.commit("c1", h.deadline(), first)
        await h.client.resume("c1", h.deadline())
        assert (await last_part(h)).checkpoint_id == "c1"
        storage.release.clear()
        storage.reached.clear()
        await prepared_double(h, "c2")
        await h.client.commit("c2", h.deadline(), second, asynchronous=True)
        await wait_thread_event(storage.reached)
        await h.client.resume("c2", h.deadline())
        await h.client.restore("restore-1", h.deadline(), first, [EpisodeId("r1")], rejoin=True)
        assert not (await h.client.get_status()).HasField("last_part")
        storage.release.set()
        durable = await h.client.await_part("c2", h.deadline())
        assert durable.state == pb.PART_WRITE_STATE_DURABLE
        assert not (await h.client.get_status()).HasField("last_part")
        await h.client.resume("restore-1", h.deadline())
        await prepared_double(h, "c3")
        await h.client.commit("c3", h.deadline(), str(tmp_path / "c3"))
        assert (await last_part(h)).checkpoint_id == "c3"
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_a_synchronous_commit_whose_cleanup_fails_is_not_the_last_part(
    checkpoint_dir: str, tmp_path: Path
) -> None:
    """A scoped Commit writes its part, then retires the restored episodes its scope leaves
    out; when that retire fails the Commit fails (HOOK_FAILED), and GetStatus must not name
    its part as published (the asynchronous job starts no write in that case either). The
    retried Commit that succeeds is the last part."""
    await make_checkpoint(checkpoint_dir, STATES)
    h = await start_harness()
    scope = [EpisodeId("r1"), EpisodeId("r2", 1)]
    try:
        await h.client.restore("restore-1", h.deadline(), checkpoint_dir, scope)
        await h.client.resume("restore-1", h.deadline())
        h.participant.fail["retire"] = RuntimeError("the retire hook failed")
        await prepared_double(h, "c1")
        directory = str(tmp_path / "c1")
        await refused(
            h.client.commit("c1", h.deadline(), directory, scope=[EpisodeId("r1", 1)]),
            "HOOK_FAILED",
        )
        assert not (await h.client.get_status()).HasField("last_part")
        del h.participant.fail["retire"]
        await h.client.commit("c1", h.deadline(), directory, scope=[EpisodeId("r1", 1)])
        assert (await last_part(h)).checkpoint_id == "c1"
    finally:
        await stop_harness(h)


def test_status_shows_the_last_part_each_member_published(tmp_path: Path) -> None:
    """`rollout-checkpoint status` (JSON and table) names each member's last part with what it
    wrote and referenced (a first checkpoint: every part full)."""
    with real_fleet(tmp_path) as fleet:
        seeded = httpx.post(
            fleet.http("counter") + "/ng-rollout/r1/seed_session", json={"initial_count": 1}
        )
        assert seeded.status_code == 200
        before = cli("status", "--fleet", str(fleet.fleet_file), "--json")
        assert [m["last_part"] for m in json.loads(before.stdout)["members"]] == [None, None]
        assert cli("checkpoint", "--fleet", str(fleet.fleet_file), "ckpt-p").returncode == 0
        status = cli("status", "--fleet", str(fleet.fleet_file), "--json")
        assert status.returncode == 0, status.stderr
        parts = {m["name"]: m["last_part"] for m in json.loads(status.stdout)["members"]}
        counter = parts["counter"]
        assert counter["checkpoint_id"] == "ckpt-p" and not counter["asynchronous"]
        assert counter["checkpoint_dir"] == str(fleet.root / "ckpt-p")
        assert (counter["record_count"], figures_of(counter)) == (1, (1, 0, 1))
        assert counter["bytes"] > 0
        assert (parts["weather"]["checkpoint_id"], figures_of(parts["weather"])) == (
            "ckpt-p",
            (0, 0, 1),
        )
        table = cli("status", "--fleet", str(fleet.fleet_file))
        assert "1/1 new, chain 1" in table.stdout


def figures_of(part: dict[str, Any]) -> tuple[int, int, int]:
    return (part["records_written"], part["records_referenced"], part["chain_length"])


async def test_a_commit_at_an_allowed_root_itself_is_full_not_refused(tmp_path: Path) -> None:
    """Allowed roots `a` and `b`, siblings: a part at `b` itself, then one at `a` itself.
    Storage refuses a chained part at a root itself (its references would resolve beside it,
    outside every allowed root), so the second part must be full, not a refused Commit."""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    async with running(IncrementalCounter, allowed_checkpoint_roots=roots) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(3)
        first, _ = await commit(r, "c1", tmp_path / "b")
        await fleet.increment(0)
        second, manifest = await commit(r, "c2", tmp_path / "a")
        assert figures(first) == figures(second) == (3, 0, 1)
        assert manifest.schema_version == 1
