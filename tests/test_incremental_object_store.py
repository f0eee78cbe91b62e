"""Incremental parts below an object-store root (`s3://`), against a real S3 server (SeaweedFS).

The same rules as on disk (tests/test_incremental.py), on the store:

* a part committed below `s3://…/root/cN` references the records objects of earlier parts of
  the same participant in sibling prefixes, and reads back (and restores) exactly as the full
  part of the same cut, with synchronous and asynchronous commits;
* a referenced object that is missing, corrupt or no longer published fails the Restore
  INVALID_CHECKPOINT_STATE naming it, with nothing installed, and `inspect` refuses the same
  checkpoint (never verify-then-fail-restore);
* a reference that names anything but a plain sibling is refused on write and on read, and a
  checkpoint at the top of a bucket (which has no siblings) references nothing;
* retention on the store keeps every checkpoint a kept one references, transitively, with
  random chains (the property of tests/test_incremental_retention.py on the store), and
  deletes nothing when a manifest cannot be read.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointCorrupt,
    PublishedParticipant,
)
from rollout_checkpoint.client.checkpointing.publication.object_root import ObjectCheckpointRoot
from rollout_checkpoint.client.participant import ControlError
from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.checkpoint_storage import PartStorage
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.layout import PartChain, PartReference, StoredManifest
from rollout_checkpoint.server.core.object_parts import ObjectPartStorage, scan_part_records
from rollout_checkpoint.server.core.object_references import read_object_manifest
from rollout_checkpoint.server.core.object_store import (
    READ_CHUNK,
    ObjectStoreClient,
    ObjectStoreFailure,
    client_for,
    parse_object_url,
)
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence

from .s3_server import S3Connection
from .test_incremental import ROLLOUTS, Fleet, IncrementalCounter, _episode, restored_states
from .test_incremental_crash import run_until_marker
from .test_incremental_retention import INSTANCE, KIND, T0, Line, draw_part_contents, write
from .test_object_store import get_object, keys_below, s3_env, url
from .test_resources import Running, running
from .test_s3_server import store_for

__all__ = ["s3_env", "url"]  # fixtures used by this module's tests

PART = layout.part_path("", "resources", "counter")


class ObjectFleet(Fleet):
    """The incremental counter's fleet committing into sibling prefixes of an `s3://` root."""

    def __init__(self, r: Running, root_url: str) -> None:
        super().__init__(r, Path())
        self.root_url = root_url

    def directory(self, name: str) -> str:
        return f"{self.root_url}/{name}"


def read_records(checkpoint_url: str) -> tuple[StoredManifest, list[dict[str, Any]]]:
    """The part's records as a restore reads them from the store (references resolved)."""
    return ObjectPartStorage().read_part(checkpoint_url, "resources", "counter", lambda r: True)


def manifest_of(connection: S3Connection, checkpoint_url: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(manifest_bytes(connection, checkpoint_url))
    return loaded


def manifest_bytes(connection: S3Connection, checkpoint_url: str) -> bytes:
    return get_object(connection, f"{checkpoint_url}/{PART}/manifest.json")


def part_sha(connection: S3Connection, checkpoint_url: str) -> str:
    """The sha256 of the counter's part manifest (what a fleet manifest lists)."""
    return hashlib.sha256(manifest_bytes(connection, checkpoint_url)).hexdigest()


def put_object(connection: S3Connection, key_url: str, data: bytes) -> None:
    obstore.put(store_for(connection), key_url.split("/", 3)[3], data)


def delete_object(connection: S3Connection, key_url: str) -> None:
    obstore.delete(store_for(connection), key_url.split("/", 3)[3])


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_incremental_parts_on_the_store_read_and_restore_as_full_parts(
    s3_env: S3Connection, url: str, asynchronous: bool
) -> None:
    async with running(
        IncrementalCounter, incremental_full_every=4, incremental_max_stale_share=1.0
    ) as r:
        fleet = ObjectFleet(r, url)
        await fleet.seed(10)
        first = await fleet.checkpoint(asynchronous=asynchronous)
        assert manifest_of(s3_env, first)["schema_version"] == 1  # the first part is full
        await fleet.increment(3)
        second = await fleet.checkpoint(asynchronous=asynchronous)
        chain = manifest_of(s3_env, second)
        assert chain["schema_version"] == 3
        assert (chain["own_records"], chain["referenced_records"], chain["chain_length"]) == (
            1,
            9,
            2,
        )
        assert [ref["checkpoint"] for ref in chain["references"]] == ["c1"]
        await fleet.increment(5)
        await fleet.seed(2)
        await fleet.close(0)
        third = await fleet.checkpoint(asynchronous=asynchronous)
        assert (manifest_of(s3_env, third)["own_records"], fleet.reply.chain_length) == (3, 3)
        # Flattened: the third part points at the lines holding the states, in c1 and c2.
        assert sorted(ref["checkpoint"] for ref in manifest_of(s3_env, third)["references"]) == [
            "c1",
            "c2",
        ]
        full = await fleet.checkpoint(asynchronous=asynchronous, full=True)
        assert manifest_of(s3_env, full)["schema_version"] == 1
        live = dict(await r.server.export_session_states(sorted(r.participant.sessions)))
    assert read_records(third)[1] == read_records(full)[1]
    assert await restored_states(third) == await restored_states(full) == live


async def test_the_first_part_after_a_restore_from_the_store_is_full(
    s3_env: S3Connection, url: str
) -> None:
    """References never cross a restore boundary on the store either: the restored server's
    first part is full, its next one references that part (not the source's chain)."""
    async with running(IncrementalCounter) as r:
        fleet = ObjectFleet(r, url)
        await fleet.seed(4)
        await fleet.checkpoint()
        source = await fleet.checkpoint()
        assert manifest_of(s3_env, source)["schema_version"] == 3
    async with running(IncrementalCounter) as b:
        scope = [_episode(i) for i in range(ROLLOUTS)]
        await b.client.restore("restore-1", b.deadline(), source, scope)
        await b.client.resume("restore-1", b.deadline())
        after = ObjectFleet(b, url)
        after.taken = 10
        first = await after.checkpoint()
        assert manifest_of(s3_env, first)["schema_version"] == 1
        second = manifest_of(s3_env, await after.checkpoint())
        assert [ref["checkpoint"] for ref in second["references"]] == ["c11"]


@pytest.mark.parametrize("damage", ["missing", "corrupt", "unpublished"])
async def test_a_damaged_referenced_object_fails_restore_and_inspect_naming_it(
    s3_env: S3Connection, url: str, damage: str
) -> None:
    async with running(IncrementalCounter) as r:
        fleet = ObjectFleet(r, url)
        await fleet.seed(4)
        base = await fleet.checkpoint()
        records_file = fleet.reply.records_file
        await fleet.increment(1)
        chained = await fleet.checkpoint()
    root = ObjectCheckpointRoot(url)
    for number, checkpoint in enumerate((base, chained), start=1):
        entry = PublishedParticipant(
            "counter", "resources", "counter", part_sha(s3_env, checkpoint)
        )
        await asyncio.to_thread(
            root.publish, f"c{number}", [entry], [], b"", created_at=T0 + timedelta(hours=number)
        )
    summary = await asyncio.to_thread(root.inspect, "c2")
    (participant,) = summary.participants
    assert (participant.own_records, participant.referenced_records) == (1, 3)
    assert participant.chain_length == 2
    records = f"{base}/{PART}/{records_file}"
    if damage == "missing":
        delete_object(s3_env, records)
    elif damage == "corrupt":
        data = bytearray(get_object(s3_env, records))
        data[-3] ^= 0x01  # inside the last record's state: same size, another digest
        put_object(s3_env, records, bytes(data))
    else:
        delete_object(s3_env, f"{base}/{PART}/manifest.json")
    async with running(IncrementalCounter) as fresh:
        scope = [_episode(i) for i in range(ROLLOUTS)]
        with pytest.raises(ControlError) as refused:
            await fresh.client.restore("restore-1", fresh.deadline(), chained, scope)
        assert refused.value.reason == "INVALID_CHECKPOINT_STATE"
        assert f"{base}/{PART}" in refused.value.metadata["path"]
        assert not fresh.participant.sessions  # nothing installed
        assert not fresh.participant.has_served()
    with pytest.raises(CheckpointCorrupt) as corrupt:
        await asyncio.to_thread(root.inspect, "c2")
    assert f"{base}/{PART}" in str(corrupt.value)


def _chain(checkpoint: str) -> PartChain:
    return PartChain(0, 1, 10, 2, (PartReference(checkpoint, layout.records_name("a" * 64), 10),))


REFERENCE_LINE = b'{"$ref":[0,0,9,"' + b"a" * 64 + b'"]}'


@pytest.mark.parametrize("name", ["..", ".", "/etc", "a/b", "", "c2", "%2e%2e"])
def test_a_reference_must_name_a_sibling_on_write(
    s3_env: S3Connection, url: str, name: str
) -> None:
    with pytest.raises(CheckpointError) as refused:
        ObjectPartStorage().write_part(
            f"{url}/c2", KIND, INSTANCE, "c2", [REFERENCE_LINE], WriteFence(), _chain(name)
        )
    assert refused.value.reason.value == "INVALID_REQUEST"
    assert keys_below(s3_env, url) == []


def test_a_part_at_the_top_of_a_bucket_references_nothing(s3_env: S3Connection) -> None:
    top = s3_env.url()
    assert parse_object_url(top).split() is None
    with pytest.raises(CheckpointError) as refused:
        ObjectPartStorage().write_part(
            top, KIND, INSTANCE, "c2", [REFERENCE_LINE], WriteFence(), _chain("c1")
        )
    assert refused.value.reason.value == "INVALID_REQUEST"
    assert "top of a bucket" in refused.value.message


def test_a_reference_to_an_unpublished_part_is_refused_on_write(
    s3_env: S3Connection, url: str
) -> None:
    with pytest.raises(CheckpointError) as refused:
        ObjectPartStorage().write_part(
            f"{url}/c2", KIND, INSTANCE, "c2", [REFERENCE_LINE], WriteFence(), _chain("c1")
        )
    assert refused.value.reason.value == "INVALID_CHECKPOINT_STATE"
    assert f"{url}/c1/" in refused.value.metadata["path"]
    assert keys_below(s3_env, url) == []


@pytest.mark.parametrize("name", ["..", "/etc", "a/b", "c2", "other-bucket/c1"])
def test_a_reference_leaving_the_root_is_refused_on_read(
    s3_env: S3Connection, url: str, name: str
) -> None:
    _, lines = write(url, "c1", 2, [], ObjectPartStorage())
    write(url, "c2", 1, lines, ObjectPartStorage())
    key = f"{url}/c2/{layout.part_path('', KIND, INSTANCE)}/manifest.json"
    manifest = json.loads(get_object(s3_env, key))
    manifest["references"][0]["checkpoint"] = name
    put_object(s3_env, key, json.dumps(manifest).encode())
    with pytest.raises(CheckpointError) as refused:
        ObjectPartStorage().read_part(f"{url}/c2", KIND, INSTANCE, lambda r: True)
    assert refused.value.reason.value == "INVALID_CHECKPOINT_STATE"


# -- retention ------------------------------------------------------------------------------


def object_restorable(root_url: str, checkpoint: str) -> bool:
    ObjectPartStorage().read_part(f"{root_url}/{checkpoint}", KIND, INSTANCE, lambda r: True)
    return True


def checkpoints_on_store(connection: S3Connection, root_url: str) -> set[str]:
    return {key.split("/", 1)[0] for key in keys_below(connection, root_url)} - {"LATEST"}


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_retention_on_the_store_keeps_every_checkpoint_a_kept_one_references(
    s3_env: S3Connection, data: st.DataObject
) -> None:
    """tests/test_incremental_retention.py's property, below an `s3://` root: random chains
    of real parts (own records and references to lines of parts still on the store), some
    left unpublished, published with a random `keep`; after every publication each published
    checkpoint still on the store reads back whole."""
    root_url = s3_env.url(f"t/{secrets.token_hex(6)}")
    root = ObjectCheckpointRoot(root_url)
    storage = ObjectPartStorage()
    lines: list[Line] = []
    for number in range(data.draw(st.integers(2, 7), label="checkpoints")):
        checkpoint = f"c{number}"
        present = checkpoints_on_store(s3_env, root_url)
        referenced, own = draw_part_contents(data, lines, present.__contains__)
        part, written = write(root_url, checkpoint, own, referenced, storage)
        lines += written
        if data.draw(st.booleans(), label="publication fails"):
            continue  # the part stays, published as a part, in an unpublished checkpoint
        entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
        keep = data.draw(st.integers(1, 3), label="keep")
        root.publish(
            checkpoint, [entry], [], b"", created_at=T0 + timedelta(hours=number), keep=keep
        )
        for kept in root.published():
            assert object_restorable(root_url, kept)
        assert checkpoint in root.published()


def test_retention_on_the_store_deletes_nothing_when_a_manifest_cannot_be_read(
    s3_env: S3Connection, url: str
) -> None:
    """Retention cannot tell what a checkpoint whose part manifest it cannot read references:
    it deletes nothing (the next publication retries) rather than an object a kept
    checkpoint may need. The store fails every part manifest GET once the publication is
    past its verification."""
    real_get = ObjectStoreClient.get
    part_manifest = f"/{layout.part_path('', KIND, INSTANCE)}/manifest.json"

    def failing_manifest_get(self: ObjectStoreClient, key: str, limit: int | None = None) -> Any:
        if key.endswith(part_manifest):
            raise ObjectStoreFailure("GET", self.url(key), ConnectionError("the store is down"))
        return real_get(self, key, limit)

    store_down = pytest.MonkeyPatch()

    def fail_manifests_after(step: str) -> None:
        if step == "after_latest":
            store_down.setattr(ObjectStoreClient, "get", failing_manifest_get)

    root = ObjectCheckpointRoot(url, crash_hook=fail_manifests_after)
    storage = ObjectPartStorage()
    try:
        for number in range(3):
            store_down.undo()
            part, _ = write(url, f"c{number}", 1, [], storage)
            entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
            published = root.publish(
                f"c{number}", [entry], [], b"", created_at=T0 + timedelta(hours=number), keep=1
            )
            assert published.deleted == ()
    finally:
        store_down.undo()
    assert checkpoints_on_store(s3_env, url) == {"c0", "c1", "c2"}


def test_retention_on_the_store_follows_references_past_a_checkpoint_not_on_the_store(
    s3_env: S3Connection, url: str
) -> None:
    """A chain names a checkpoint the store does not hold (its manifest edited, or copied
    from another root): retention still keeps what a kept checkpoint references, and does
    not stumble on the name it cannot find."""
    root = ObjectCheckpointRoot(url)
    storage = ObjectPartStorage()
    _, base_lines = write(url, "c0", 2, [], storage)
    _, lines = write(url, "c1", 1, base_lines[:1], storage)
    part, _ = write(url, "c2", 0, lines, storage)
    key = f"{url}/c1/{layout.part_path('', KIND, INSTANCE)}/manifest.json"
    manifest = json.loads(get_object(s3_env, key))
    manifest["references"][0]["checkpoint"] = "never-here"
    put_object(s3_env, key, json.dumps(manifest).encode())
    entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
    root.publish("c2", [entry], [], b"", created_at=T0, keep=1)
    # c1 (unpublished, older) is referenced by c2: kept. (c0 may go or stay: the store's
    # modification times have a resolution of a second.)
    assert {"c1", "c2"} <= checkpoints_on_store(s3_env, url)


# -- SIGKILL during an incremental write, and during retention with references ---------------

CHILD = r"""
import sys, time
from datetime import timedelta
from pathlib import Path

from rollout_checkpoint.client.checkpointing.publication import PublishedParticipant
from rollout_checkpoint.client.checkpointing.publication.object_root import ObjectCheckpointRoot
from rollout_checkpoint.server.core.object_parts import ObjectPartStorage, scan_part_records
from rollout_checkpoint.server.core.object_references import read_object_manifest
from rollout_checkpoint.server.core.object_store import ObjectStoreClient
from tests.test_incremental_retention import INSTANCE, KIND, T0, write
from tests.test_incremental_object_store import object_lines_of

mode, root, step, marker = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])


def stall():
    marker.touch()
    time.sleep(120)


if mode == "write":
    storage = ObjectPartStorage(crash_hook=lambda name: stall() if name == step else None)
    write(root, "c2", 1, object_lines_of(root, "c1")[:2], storage)
else:
    real_delete = ObjectStoreClient.delete

    def stalling_delete(self, keys):
        real_delete(self, keys)  # the first deletion is a checkpoint.json: then stop
        stall()

    ObjectStoreClient.delete = stalling_delete
    referenced = object_lines_of(root, "c0")[:1] + object_lines_of(root, "c2")[:1]
    part, _ = write(root, "c3", 1, referenced, ObjectPartStorage())
    entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
    ObjectCheckpointRoot(root).publish(
        "c3", [entry], [], b"", created_at=T0 + timedelta(hours=3), keep=1
    )
print("finished", flush=True)
"""

WRITE_STEPS = ("before_records_put", "before_publish", "before_manifest_create")


def object_lines_of(root_url: str, checkpoint: str) -> list[Line]:
    """The own record lines of a full part on the store, as a later part references them."""
    manifest, _ = ObjectPartStorage().read_part(
        f"{root_url}/{checkpoint}", KIND, INSTANCE, lambda r: True
    )
    location = parse_object_url(f"{root_url}/{checkpoint}")
    key = location.key(layout.part_path("", KIND, INSTANCE), manifest.records_file)
    stored = client_for(location).get(key)
    assert stored is not None
    lines, offset = [], 0
    for line in stored.data.splitlines():
        episode = json.dumps(json.loads(line)["episode_id"]).encode()
        lines.append(Line(checkpoint, manifest.records_file, manifest.bytes, offset, line, episode))
        offset += len(line) + 1
    return lines


def object_records(root_url: str, checkpoint: str) -> list[dict[str, Any]]:
    return read_part_records(f"{root_url}/{checkpoint}")


def read_part_records(checkpoint_url: str) -> list[dict[str, Any]]:
    return ObjectPartStorage().read_part(checkpoint_url, KIND, INSTANCE, lambda r: True)[1]


@pytest.mark.parametrize("step", WRITE_STEPS)
def test_a_chained_write_to_the_store_killed_at_any_step_is_all_or_nothing(
    s3_env: S3Connection, url: str, tmp_path: Path, step: str
) -> None:
    write(url, "c1", 3, [], ObjectPartStorage())
    base_before = object_records(url, "c1")
    run_until_marker(tmp_path, "write", url, step, script=CHILD)
    assert object_records(url, "c1") == base_before  # the referenced part is untouched
    with pytest.raises(CheckpointError) as refused:  # killed before its manifest: unpublished
        object_records(url, "c2")
    assert refused.value.reason.value == "INVALID_CHECKPOINT_STATE"
    # A retry (a restarted process committing the same cut) publishes the complete part.
    write(url, "c2", 1, object_lines_of(url, "c1")[:2], ObjectPartStorage())
    assert object_records(url, "c2")[1:] == base_before[:2]


def test_retention_on_the_store_killed_while_deleting_keeps_every_referenced_checkpoint(
    s3_env: S3Connection, url: str, tmp_path: Path
) -> None:
    root = ObjectCheckpointRoot(url)
    for number in range(3):
        part, _ = write(url, f"c{number}", 2, [], ObjectPartStorage())
        entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
        root.publish(
            f"c{number}", [entry], [], b"", created_at=T0 + timedelta(hours=number), keep=5
        )
    # c3 references c0 and c2 and is published with keep=1: c1 goes, c0 and c2 stay; the
    # child is killed right after c1's checkpoint.json is deleted.
    run_until_marker(tmp_path, "retention", url, "", script=CHILD)
    assert root.published() == ["c0", "c2", "c3"]
    for kept in root.published():
        assert object_restorable(url, kept)
    part, _ = write(url, "c4", 0, object_lines_of(url, "c0")[:1], ObjectPartStorage())
    entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
    published = root.publish("c4", [entry], [], b"", created_at=T0 + timedelta(hours=4), keep=1)
    assert published.deleted == ("c1", "c2", "c3")  # c1's leftovers too
    assert checkpoints_on_store(s3_env, url) == {"c0", "c4"}
    for kept in root.published():
        assert object_restorable(url, kept)


# -- what reading a chained part costs ------------------------------------------------------


def large_base(root_url: str, count: int, state_bytes: int) -> list[Line]:
    """Publish the part of `c1` below `root_url`: `count` records of about `state_bytes`
    each; its lines, as a later part references them."""
    pad = "x" * state_bytes
    data, episodes = [], []
    for index in range(count):
        episode = json.dumps({"rollout_id": f"c1-{index}", "attempt": 0}).encode()
        data.append(b'{"episode_id":' + episode + f',"state":"{pad}"}}'.encode())
        episodes.append(episode)
    part = ObjectPartStorage().write_part(
        f"{root_url}/c1", KIND, INSTANCE, "c1", data, WriteFence()
    )
    lines, offset = [], 0
    for line, episode in zip(data, episodes, strict=True):
        manifest = part.manifest
        lines.append(Line("c1", manifest.records_file, manifest.bytes, offset, line, episode))
        offset += len(line) + 1
    return lines


class Streams:
    """Every streamed GET of the store's client in this test: the bytes it delivered by key,
    and whether it was closed (a GET left open holds a connection until it is collected)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.delivered: dict[str, list[int]] = {}
        """The size of each chunk delivered, by key."""
        self.opened: list[TrackedStream] = []
        real_stream = ObjectStoreClient.stream

        def stream(client: ObjectStoreClient, key: str) -> tuple[int, Iterator[bytes]] | None:
            streamed = real_stream(client, key)
            if streamed is None:
                return None
            tracked = TrackedStream(self, key, streamed[1])
            self.opened.append(tracked)
            return streamed[0], tracked

        monkeypatch.setattr(ObjectStoreClient, "stream", stream)

    def unclosed(self) -> list[str]:
        return [stream.key for stream in self.opened if not stream.closed]

    def below(self, part_url: str) -> list[int]:
        """The chunks delivered from the objects below `part_url`."""
        prefix = part_url.split("/", 3)[3]
        return [
            size
            for key, sizes in self.delivered.items()
            if key.startswith(prefix)
            for size in sizes
        ]


class TrackedStream(Iterator[bytes]):
    def __init__(self, streams: Streams, key: str, chunks: Iterator[bytes]) -> None:
        self.streams, self.key, self.chunks, self.closed = streams, key, chunks, False

    def __next__(self) -> bytes:
        chunk = next(self.chunks)
        self.streams.delivered.setdefault(self.key, []).append(len(chunk))
        return chunk

    def close(self) -> None:
        self.closed = True
        getattr(self.chunks, "close", lambda: None)()


def peak_bytes(operation: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        operation()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_scanning_a_chained_part_holds_one_chunk_not_its_records(
    s3_env: S3Connection, url: str
) -> None:
    """Verifying (`inspect`) a part that references 3,000 records of 5 KB (15 MB) holds
    about a chunk of the referenced object, not every record; a restore's read in the part's
    order holds the referenced lines' bytes, never every record decoded at once."""
    lines = large_base(url, 3000, 5000)
    write(url, "c2", 0, lines, ObjectPartStorage())
    checkpoint = parse_object_url(f"{url}/c2")
    client = client_for(checkpoint)
    manifest = read_object_manifest(
        client, checkpoint.child(*layout.part_components(KIND, INSTANCE))
    )
    data_bytes = sum(len(line.data) + 1 for line in lines)
    seen: list[int] = []
    scanned = peak_bytes(
        lambda: scan_part_records(client, checkpoint, manifest, lambda r, n: seen.append(n))
    )
    assert sorted(seen) == list(range(1, 3001))
    assert scanned < 3 * READ_CHUNK < data_bytes
    restored = peak_bytes(
        lambda: ObjectPartStorage().read_part(f"{url}/c2", KIND, INSTANCE, lambda r: False)
    )
    assert restored < data_bytes + 3 * READ_CHUNK


def test_one_reference_downloads_the_chunk_holding_its_line_and_every_stream_is_closed(
    s3_env: S3Connection, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = large_base(url, 3000, 5000)  # a 15 MB object: four chunks
    write(url, "c2", 0, lines[:1], ObjectPartStorage())
    streams = Streams(monkeypatch)
    _, records = ObjectPartStorage().read_part(f"{url}/c2", KIND, INSTANCE, lambda r: True)
    assert [json.dumps(r["episode_id"]).encode() for r in records] == [lines[0].episode]
    (chunk,) = streams.below(f"{url}/c1")  # of a 15 MB object
    assert chunk < 2 * READ_CHUNK
    assert streams.unclosed() == []


def test_a_referenced_object_of_another_size_is_refused_with_its_stream_closed(
    s3_env: S3Connection, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, lines = write(url, "c1", 3, [], ObjectPartStorage())
    write(url, "c2", 0, lines, ObjectPartStorage())
    records = f"{url}/c1/{PART}/{lines[0].records_file}"
    put_object(s3_env, records, get_object(s3_env, records) + b"\n")
    streams = Streams(monkeypatch)
    with pytest.raises(CheckpointError) as refused:
        ObjectPartStorage().read_part(f"{url}/c2", KIND, INSTANCE, lambda r: True)
    assert refused.value.reason.value == "INVALID_CHECKPOINT_STATE"
    assert records in refused.value.metadata["path"]
    assert streams.opened and streams.unclosed() == []


def test_publication_checks_references_without_downloading_them_and_inspect_reads_them(
    s3_env: S3Connection, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parts a chained part references were verified when they were published: its
    publication checks they still are (manifest, object size) and reads only its own
    records object; `inspect` still hashes every referenced line, so damage made after the
    base's publication (same size, other bytes) is found by `inspect` and by a restore."""
    root = ObjectCheckpointRoot(url)
    base, lines = write(url, "c1", 3, [], ObjectPartStorage())
    publish_part(root, "c1", base.manifest_sha256, 1)
    chained, _ = write(url, "c2", 1, lines, ObjectPartStorage())
    later, _ = write(url, "c3", 0, lines[1:], ObjectPartStorage())
    records = f"{url}/c1/{PART}/{lines[0].records_file}"
    data = bytearray(get_object(s3_env, records))
    data[-3] ^= 0x01
    put_object(s3_env, records, bytes(data))
    streams = Streams(monkeypatch)
    publish_part(root, "c2", chained.manifest_sha256, 2)
    assert streams.below(f"{url}/c1") == []
    assert streams.below(f"{url}/c2") != []
    with pytest.raises(CheckpointCorrupt) as corrupt:
        root.inspect("c2")
    assert records in str(corrupt.value)
    # A referenced part no longer published is refused: the check of references remains.
    delete_object(s3_env, f"{url}/c1/{PART}/manifest.json")
    with pytest.raises(CheckpointCorrupt) as unpublished:
        publish_part(root, "c3", later.manifest_sha256, 3)
    assert f"{url}/c1/{PART}" in str(unpublished.value)


def publish_part(
    root: ObjectCheckpointRoot, checkpoint: str, manifest_sha256: str, hour: int
) -> None:
    entry = PublishedParticipant("counter", KIND, INSTANCE, manifest_sha256)
    root.publish(checkpoint, [entry], [], b"", created_at=T0 + timedelta(hours=hour))


@pytest.mark.parametrize("backend", ["object_store", "disk"])
def test_a_part_at_an_allowed_root_itself_never_reads_or_writes_references_beside_it(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> None:
    """Allowed roots `<root>/tenantA`: a checkpoint at `tenantA` itself is accepted, but its
    sibling references would resolve beside it (`tenantB`, another tenant): a chained part
    there is refused on write and on read, before anything of `tenantB` is read, on both
    backends; a chain strictly below the root reads as usual."""
    root = request.getfixturevalue("url") if backend == "object_store" else str(tmp_path)
    unrestricted = ObjectPartStorage() if backend == "object_store" else LocalStorage()
    confined = PartStorage(allowed_roots=[f"{root}/tenantA"])
    _, other_tenant = write(root, "tenantB", 2, [], unrestricted)
    write(root, "tenantA", 0, other_tenant, unrestricted)  # as a store without roots would
    with pytest.raises(CheckpointError) as unread:
        confined.read_part(f"{root}/tenantA", KIND, INSTANCE, lambda r: True)
    assert unread.value.reason.value == "INVALID_CHECKPOINT_STATE"
    with pytest.raises(CheckpointError) as unwritten:
        write(root, "tenantA", 0, other_tenant, confined)
    assert unwritten.value.reason.value == "INVALID_REQUEST"
    _, own = write(f"{root}/tenantA", "c1", 2, [], confined)
    write(f"{root}/tenantA", "c2", 0, own, confined)
    _, records = confined.read_part(f"{root}/tenantA/c2", KIND, INSTANCE, lambda r: True)
    assert [json.dumps(r["episode_id"]).encode() for r in records] == [line.episode for line in own]
