"""Incremental checkpoints: a part stores what changed and references the rest.

A counter server that declares `checkpoint_incremental` runs under uvicorn on 127.0.0.1:0 with
its gRPC sidecar; rounds of data-plane calls (increments on some sessions, new seeds, closes)
alternate with real Prepare / Commit / Resume calls into sibling directories of one root. The
properties:

* an incremental part reads back exactly as a full part taken at the same cut (same records,
  same order, byte for byte), and a Restore of it installs the same state, with synchronous
  and asynchronous commits;
* only touched sessions are exported again; a part is full when nothing can be referenced
  (the first one, every `incremental_full_every`, the first after a Restore);
* a referenced file that is missing or corrupt fails the Restore typed, naming it, with
  nothing installed; a reference that leaves the root is refused on read and on write;
* a reader of manifest version 1 refuses a version 2 manifest instead of misreading it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_checkpoint.client.participant import ControlError
from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.layout import PartChain, PartReference, StoredManifest
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from .test_resources import Running, prepared, running

ROLLOUTS = 6
"""Sessions are spread over this many rollouts (several sessions per episode)."""


class IncrementalCounter(CounterServer):
    checkpoint_incremental = True


def read_records(directory: Path) -> tuple[StoredManifest, list[dict[str, Any]]]:
    """The part's records as a restore reads them (references resolved and verified)."""
    return LocalStorage().read_part(str(directory), "resources", "counter", lambda r: True)


def manifest_of(directory: Path) -> dict[str, Any]:
    path = Path(layout.part_path(str(directory), "resources", "counter")) / "manifest.json"
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


class Fleet:
    """One incremental counter server, its episodes' browsers, and its checkpoints."""

    def __init__(self, r: Running, root: Path) -> None:
        self.r = r
        self.root = root
        self.browsers: list[tuple[httpx.AsyncClient, str]] = []
        self.taken = 0
        self.reply: Any = None
        """The manifest the last Commit (or AwaitPart) replied with."""
        self.exported: list[str] = []
        """The capture keys the last Commit replied it exported."""

    async def seed(self, count: int) -> None:
        for _ in range(count):
            prefix = f"/ng-rollout/r{len(self.browsers) % ROLLOUTS}-a1"
            browser = self.r.browser()
            seeded = await browser.post(f"{prefix}/seed_session", json={"initial_count": 1})
            assert seeded.status_code == 200
            self.browsers.append((browser, prefix))

    async def increment(self, index: int) -> None:
        browser, prefix = self.browsers[index]
        reply = await browser.post(f"{prefix}/increment_counter", json={"count": 1})
        assert reply.status_code == 200

    async def close(self, index: int) -> None:
        browser, prefix = self.browsers[index]
        assert (await browser.post(f"{prefix}/close_session", json={})).status_code == 200

    def directory(self, name: str) -> Any:
        """Where the checkpoint `name` is committed: a sibling directory in the root."""
        return self.root / name

    async def checkpoint(
        self, *, asynchronous: bool = False, full: bool = False, name: str | None = None
    ) -> Any:
        """Prepare, commit into a new sibling directory (`name`, or the checkpoint's id) and
        resume; `full` commits this one cut as a full part (the same server with its opt-in
        switched off for it)."""
        self.taken += 1
        checkpoint_id = f"c{self.taken}"
        directory = self.directory(name or checkpoint_id)
        assert (await prepared(self.r, checkpoint_id)).state == (
            types_pb2.PARTICIPANT_STATE_PREPARED
        )
        participant = self.r.participant
        participant.incremental = not full
        try:
            committed = await self.r.client.commit(
                checkpoint_id, self.r.deadline(), str(directory), asynchronous=asynchronous
            )
            self.reply = committed.manifest
            self.exported = list(committed.exported)
            if asynchronous:
                part = await self.r.client.await_part(checkpoint_id, self.r.deadline())
                assert part.state == pb.PART_WRITE_STATE_DURABLE
                self.reply = part.manifest
        finally:
            participant.incremental = True
        await self.r.client.resume(checkpoint_id, self.r.deadline())
        return directory


async def restored_states(directory: Path) -> dict[str, Any]:
    """What a Restore of `directory` into a fresh server installs, as its hook exports it."""
    async with running(IncrementalCounter) as fresh:
        scope = [_episode(i) for i in range(ROLLOUTS)]
        await fresh.client.restore("restore-1", fresh.deadline(), str(directory), scope)
        held = sorted(fresh.participant.sessions)
        return dict(await fresh.server.export_session_states(held))


def _episode(index: int) -> EpisodeId:
    return EpisodeId(f"r{index}", 1)


Round = tuple[list[int], int, list[int]]
"""One round between two checkpoints: sessions incremented, sessions seeded, sessions closed."""

rounds = st.lists(
    st.tuples(
        st.lists(st.integers(0, 39), max_size=12),
        st.integers(0, 4),
        st.lists(st.integers(0, 39), max_size=2),
    ),
    min_size=1,
    max_size=5,
)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(history=rounds)
def test_an_incremental_part_reads_as_the_full_part_of_the_same_cut(
    tmp_path_factory: pytest.TempPathFactory, asynchronous: bool, history: list[Round]
) -> None:
    asyncio.run(_same_cut_history(tmp_path_factory.mktemp("root"), history, asynchronous))


async def _same_cut_history(root: Path, history: list[Round], asynchronous: bool) -> None:
    async with running(
        IncrementalCounter, incremental_full_every=3, incremental_max_stale_share=1.0
    ) as r:
        fleet = Fleet(r, root)
        await fleet.seed(12)
        closed: set[int] = set()
        await fleet.checkpoint(asynchronous=asynchronous)
        for touched, seeded, closing in history:
            for index in touched:
                if index < len(fleet.browsers) and index not in closed:
                    await fleet.increment(index)
            await fleet.seed(seeded)
            for index in closing:
                if index < len(fleet.browsers) and index not in closed:
                    await fleet.close(index)
                    closed.add(index)
            incremental = await fleet.checkpoint(asynchronous=asynchronous)
            full = await fleet.checkpoint(asynchronous=asynchronous, full=True)
            inc_manifest, inc_records = read_records(incremental)
            full_manifest, full_records = read_records(full)
            assert inc_records == full_records
            assert full_manifest.chain is None
            assert inc_manifest.chain_length <= 3
        # The last incremental part restores exactly what the full part of its cut restores.
        assert await restored_states(incremental) == await restored_states(full)


async def test_only_touched_sessions_are_exported_and_the_chain_is_bounded(
    tmp_path: Path,
) -> None:
    async with running(
        IncrementalCounter, incremental_full_every=3, incremental_max_stale_share=1.0
    ) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(10)
        first = await fleet.checkpoint()
        assert manifest_of(first)["schema_version"] == 1  # the first part is full
        await fleet.increment(3)
        second = await fleet.checkpoint()
        chain = manifest_of(second)
        assert chain["schema_version"] == 3
        assert (chain["own_records"], chain["referenced_records"], chain["chain_length"]) == (
            1,
            9,
            2,
        )
        assert [ref["checkpoint"] for ref in chain["references"]] == ["c1"]
        reply = fleet.reply  # the Commit reply says the same
        assert (reply.own_records, reply.referenced_records, reply.chain_length) == (1, 9, 2)
        assert reply.schema_version == 3
        third = await fleet.checkpoint()  # nothing changed: everything referenced
        assert (manifest_of(third)["own_records"], manifest_of(third)["chain_length"]) == (0, 3)
        # References are flattened: the third part points at the lines holding the states.
        assert sorted(ref["checkpoint"] for ref in manifest_of(third)["references"]) == [
            "c1",
            "c2",
        ]
        fourth = await fleet.checkpoint()  # the chain reached incremental_full_every
        assert manifest_of(fourth)["schema_version"] == 1
        assert read_records(fourth)[1] == read_records(third)[1] == read_records(second)[1]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_a_directory_no_reference_may_name_is_a_base_for_nothing(
    tmp_path: Path, asynchronous: bool
) -> None:
    """A controller may commit into a directory whose name a reference cannot hold (a
    timestamp with colons): that part is written, and the next one is full instead of
    planned against it and refused (before, every second commit failed INVALID_ARGUMENT)."""
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(4)
        for minute in range(4):
            await fleet.increment(minute)
            part = await fleet.checkpoint(
                asynchronous=asynchronous, name=f"2026-12-06T15:0{minute}:00"
            )
            assert manifest_of(part)["schema_version"] == 1
        assert (await restored_states(part)) == dict(
            await r.server.export_session_states(sorted(r.participant.sessions))
        )


async def test_a_failed_commit_leaves_its_sessions_changed(tmp_path: Path) -> None:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(4)
        await fleet.checkpoint()
        await fleet.increment(0)
        # A commit whose write fails (its directory's parent is a file) publishes nothing.
        (tmp_path / "blocker").write_text("")
        assert (await prepared(r, "broken")).state == types_pb2.PARTICIPANT_STATE_PREPARED
        with pytest.raises(ControlError):
            await r.client.commit("broken", r.deadline(), str(tmp_path / "blocker" / "x"))
        await r.client.resume("broken", r.deadline())
        after = await fleet.checkpoint()
        assert manifest_of(after)["own_records"] == 1  # session 0 is exported again
        assert (await restored_states(after)) == dict(
            await r.server.export_session_states(sorted(r.participant.sessions))
        )


async def test_the_first_part_after_a_restore_is_full(tmp_path: Path) -> None:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(4)
        await fleet.checkpoint()
        source = await fleet.checkpoint()
        assert manifest_of(source)["schema_version"] == 3
    async with running(IncrementalCounter) as b:
        scope = [_episode(i) for i in range(ROLLOUTS)]
        await b.client.restore("restore-1", b.deadline(), str(source), scope)
        await b.client.resume("restore-1", b.deadline())
        after = Fleet(b, tmp_path)
        after.taken = 10
        first = await after.checkpoint()
        assert manifest_of(first)["schema_version"] == 1
        assert manifest_of(await after.checkpoint())["schema_version"] == 3


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
async def test_a_damaged_referenced_file_fails_the_restore_naming_it(
    tmp_path: Path, damage: str
) -> None:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(4)
        base = await fleet.checkpoint()
        await fleet.increment(1)
        chained = await fleet.checkpoint()
    part = Path(layout.part_path(str(base), "resources", "counter"))
    records = next(part.glob("records-*.jsonl"))
    if damage == "missing":
        records.unlink()
    else:
        data = bytearray(records.read_bytes())
        data[-3] ^= 0x01  # inside the last record's state: same size, another digest
        records.write_bytes(bytes(data))
    async with running(IncrementalCounter) as fresh:
        scope = [_episode(i) for i in range(ROLLOUTS)]
        with pytest.raises(ControlError) as refused:
            await fresh.client.restore("restore-1", fresh.deadline(), str(chained), scope)
        assert refused.value.reason == "INVALID_CHECKPOINT_STATE"
        assert str(base / "participants") in refused.value.metadata["path"]
        assert not fresh.participant.sessions  # nothing installed
        assert not fresh.participant.has_served()


def _chain(checkpoint: str) -> PartChain:
    return PartChain(0, 1, 10, 2, (PartReference(checkpoint, layout.records_name("a" * 64), 10),))


@pytest.mark.parametrize("name", ["..", ".", "/etc", "a/b", "", "c2"])
def test_a_reference_must_name_a_sibling_on_write(tmp_path: Path, name: str) -> None:
    line = b'{"episode_id":{"rollout_id":"r","attempt":1},"$ref":[0,0,9,"' + b"a" * 64 + b'"]}'
    with pytest.raises(CheckpointError) as refused:
        LocalStorage().write_part(
            str(tmp_path / "c2"), "resources", "counter", "c2", [line], WriteFence(), _chain(name)
        )
    assert refused.value.reason.value == "INVALID_REQUEST"
    assert not (tmp_path / "c2").exists()


@pytest.mark.parametrize("name", ["..", "/etc", "a/b", "c2"])
async def test_a_reference_leaving_the_root_is_refused_on_read(tmp_path: Path, name: str) -> None:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(2)
        await fleet.checkpoint()
        chained = await fleet.checkpoint()
    path = Path(layout.part_path(str(chained), "resources", "counter")) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["references"][0]["checkpoint"] = name
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as refused:
        read_records(chained)
    assert refused.value.reason.value == "INVALID_CHECKPOINT_STATE"


def test_a_version_1_reader_refuses_a_version_2_manifest() -> None:
    """The v1 decoder's rule (exact fields of schema 1) refuses every chained manifest: an
    old reader fails DATA_LOSS on it and never takes its reference lines for records."""
    manifest = StoredManifest(
        2,
        "resources",
        "counter",
        "c2",
        layout.records_name("b" * 64),
        "b" * 64,
        1,
        100,
        _chain("c1"),
    )
    fields = json.loads(manifest.encode())
    assert StoredManifest.decode(manifest.encode()) == manifest
    with pytest.raises(ValueError, match="fields differ from schema 1"):
        layout.exact_fields(fields, frozenset(layout._V1_ORDER), "participant manifest")
    v1 = StoredManifest(
        1, "resources", "counter", "c1", layout.records_name("b" * 64), "b" * 64, 1, 9
    )
    assert set(json.loads(v1.encode())) == set(layout._V1_ORDER)


async def test_a_deleted_base_fails_the_commit_once_and_the_next_part_is_full(
    tmp_path: Path,
) -> None:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(4)
        base = await fleet.checkpoint()
        await fleet.increment(0)
        shutil.rmtree(base)  # an operator (or a retention that knew no references) took it
        assert (await prepared(r, "c2")).state == types_pb2.PARTICIPANT_STATE_PREPARED
        with pytest.raises(ControlError) as refused:
            await r.client.commit("c2", r.deadline(), str(tmp_path / "c2"))
        assert refused.value.reason == "INVALID_CHECKPOINT_STATE"
        assert str(base) in refused.value.metadata["path"]
        assert not (
            tmp_path / "c2" / "participants" / "resources" / "counter" / "manifest.json"
        ).exists()
        await r.client.resume("c2", r.deadline())
        fleet.taken = 2
        after = await fleet.checkpoint()
        assert manifest_of(after)["schema_version"] == 1  # full: nothing references c1 again
        assert (await restored_states(after)) == dict(
            await r.server.export_session_states(sorted(r.participant.sessions))
        )


async def test_a_change_after_the_cut_of_an_async_write_stays_changed(tmp_path: Path) -> None:
    """The snapshot is taken, admission reopens and a request changes a session while (or
    after) the part is written: publishing that part does not mark the session unchanged,
    since its last change is later than the part's cut."""
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(4)
        await fleet.checkpoint(asynchronous=True)
        assert (await prepared(r, "c2")).state == types_pb2.PARTICIPANT_STATE_PREPARED
        await r.client.commit("c2", r.deadline(), str(tmp_path / "c2"), asynchronous=True)
        await r.client.resume("c2", r.deadline())
        await fleet.increment(2)  # after the cut; the write may still be running
        durable = await r.client.await_part("c2", r.deadline())
        assert durable.state == pb.PART_WRITE_STATE_DURABLE
        assert durable.manifest.own_records == 0  # c2 exported nothing: nothing had changed
        fleet.taken = 2
        after = await fleet.checkpoint(asynchronous=True)
        assert manifest_of(after)["own_records"] == 1  # session 2, changed after c2's cut
        assert (await restored_states(after)) == dict(
            await r.server.export_session_states(sorted(r.participant.sessions))
        )


async def test_checkpoint_session_changed_exports_a_session_changed_outside_requests(
    tmp_path: Path,
) -> None:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(3)
        await fleet.checkpoint()
        session_id = sorted(r.participant.sessions)[1]
        r.server.counters[session_id] += 10  # a background task, not a request
        r.server.checkpoint_session_changed(session_id)
        after = await fleet.checkpoint()
        assert manifest_of(after)["own_records"] == 1
        assert (await restored_states(after))[session_id] == {"count": 11}


async def test_an_async_incremental_snapshot_holds_only_the_changed_records(
    tmp_path: Path,
) -> None:
    """The pause of an asynchronous incremental Commit serializes what changed, nothing per
    unchanged session: its snapshot is the one touched session's record, and the background
    write composes the reference lines of the other five (they are in the durable part)."""
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(6)
        await fleet.checkpoint(asynchronous=True)
        await fleet.increment(2)
        assert (await prepared(r, "c2")).state == types_pb2.PARTICIPANT_STATE_PREPARED
        directory = tmp_path / "c2"
        reply = await r.client.commit("c2", r.deadline(), str(directory), asynchronous=True)
        durable = await r.client.await_part("c2", r.deadline())
        await r.client.resume("c2", r.deadline())
        assert durable.state == pb.PART_WRITE_STATE_DURABLE
        part = Path(layout.part_path(str(directory), "resources", "counter"))
        lines = (part / durable.manifest.records_file).read_bytes().splitlines()
        own = [line for line in lines if b'"$ref":' not in line]
        assert (len(lines), len(own)) == (6, 1)
        assert reply.snapshot_records == 6
        assert reply.snapshot_bytes == len(own[0]) + 1 < durable.manifest.bytes
        assert (await restored_states(directory)) == dict(
            await r.server.export_session_states(sorted(r.participant.sessions))
        )
