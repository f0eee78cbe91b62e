"""Checkpoints on an object store, against a real S3 server (SeaweedFS, `tests/s3_server.py`).

Participants commit and restore their parts below `s3://…` through the real RPCs; a controller
publishes, moves LATEST, applies retention and inspects on the store. Credentials come only
from the environment (set per test, as a deployment would), and the refusals are the typed
ones of the local backend: a second, different commit is INVALID_CHECKPOINT_STATE, a store
that dies mid-commit is STORAGE_FAILED with nothing published, wrong credentials are
STORAGE_FAILED and never echoed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import obstore
import pytest

from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointConflict,
    CheckpointCorrupt,
    CheckpointRoot,
    NoPublishedCheckpoint,
    PublicationError,
    PublishedParticipant,
    open_checkpoint_root,
)
from rollout_checkpoint.client.checkpointing.publication.object_root import ObjectCheckpointRoot
from rollout_checkpoint.server.core.checkpoint_storage import PartStorage
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.object_parts import ObjectPartStorage
from rollout_checkpoint.server.core.object_store import ObjectLocation, client_for
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, drain, refused, start_harness, stop_harness
from .processes import kill_group, started
from .s3_server import S3Connection, SeaweedS3
from .test_s3_server import store_for

STATES = {
    EpisodeId("r1"): {"b": 1, "a": [1, 2, {"y": 0, "x": 2**70}]},
    EpisodeId("r2", 1): {"n": 2},
}


@pytest.fixture
def s3_env(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> S3Connection:
    """The standard AWS variables for the server, in this process's environment."""
    for name, value in s3_server.connection.environment().items():
        monkeypatch.setenv(name, value)
    return s3_server.connection


@pytest.fixture
def url(s3_env: S3Connection) -> str:
    """A fresh prefix on the session's server."""
    return s3_env.url(f"t/{secrets.token_hex(6)}")


def keys_below(connection: S3Connection, prefix_url: str) -> list[str]:
    location = ObjectLocation("s3", connection.bucket, prefix_url.split("/", 3)[3])
    client = client_for(location)
    root = location.prefix
    return sorted(o.key.removeprefix(root + "/") for o in client.list_below(root))


def get_object(connection: S3Connection, key_url: str) -> bytes:
    store = store_for(connection)
    return bytes(obstore.get(store, key_url.split("/", 3)[3]).bytes())


async def commit_states(
    checkpoint_dir: str, states: dict[EpisodeId, object], checkpoint_id: str = "c1"
) -> types_pb2.CommitResponse:
    h = await start_harness()
    try:
        for episode, state in states.items():
            h.participant.seed(episode, state)
        await drain(h.client.prepare(checkpoint_id, h.deadline()))
        return await h.client.commit(checkpoint_id, h.deadline(), checkpoint_dir)
    finally:
        await stop_harness(h)


async def test_commit_publishes_records_then_manifest_and_a_fresh_process_restores_it(
    s3_env: S3Connection, url: str
) -> None:
    checkpoint_dir = f"{url}/c1"
    h = await start_harness()
    try:
        for episode, state in STATES.items():
            h.participant.seed(episode, state)
        await drain(h.client.prepare("c1", h.deadline()))
        reply = await h.client.commit("c1", h.deadline(), checkpoint_dir)
        assert list(reply.exported) == ["r1", "r2-a1"]
        # A retry of the same commit is idempotent: the same manifest, nothing rewritten.
        again = await h.client.commit("c1", h.deadline(), checkpoint_dir)
        assert again.manifest_sha256 == reply.manifest_sha256
    finally:
        await stop_harness(h)
    part = "participants/resources/double"
    assert keys_below(s3_env, checkpoint_dir) == [
        f"{part}/manifest.json",
        f"{part}/{reply.manifest.records_file}",
    ]
    manifest = get_object(s3_env, f"{checkpoint_dir}/{part}/manifest.json")
    assert json.loads(manifest)["records_sha256"] == reply.manifest.records_sha256
    lines = get_object(s3_env, f"{checkpoint_dir}/{part}/{reply.manifest.records_file}")
    assert lines.splitlines()[0] == (
        b'{"episode_id":{"rollout_id":"r1","attempt":0},'
        b'"state":{"b":1,"a":[1,2,{"y":0,"x":1180591620717411303424}]}}'
    )
    fresh = await start_harness()
    try:
        restored = await fresh.client.restore(
            "restore-1", fresh.deadline(), checkpoint_dir, [EpisodeId("r1"), EpisodeId("r2", 1)]
        )
        assert restored.source_checkpoint_id == "c1"
        assert list(restored.restored) == ["r1-a1", "r2-a2"]
        assert fresh.participant.states == {
            EpisodeId("r1", 1): STATES[EpisodeId("r1")],
            EpisodeId("r2", 2): {"n": 2},
        }
    finally:
        await stop_harness(fresh)


async def test_a_tampered_records_object_is_refused_on_restore_and_nothing_installed(
    s3_env: S3Connection, url: str
) -> None:
    checkpoint_dir = f"{url}/c1"
    reply = await commit_states(checkpoint_dir, STATES)
    key = f"{checkpoint_dir}/participants/resources/double/{reply.manifest.records_file}"
    data = bytearray(get_object(s3_env, key))
    data[30:31] = b"9" if data[30:31] != b"9" else b"8"  # same size, another digest
    obstore.put(store_for(s3_env), key.split("/", 3)[3], bytes(data))
    h = await start_harness()
    try:
        error = await refused(
            h.client.restore("restore-1", h.deadline(), checkpoint_dir, [EpisodeId("r1")]),
            "INVALID_CHECKPOINT_STATE",
            "DATA_LOSS",
        )
        assert "digest" in error.message
        assert h.participant.states == {}
    finally:
        await stop_harness(h)


async def test_a_conflicting_writer_is_refused_and_the_published_part_stays(
    s3_env: S3Connection, url: str
) -> None:
    checkpoint_dir = f"{url}/c1"
    first = await commit_states(checkpoint_dir, {EpisodeId("r1"): {"n": 1}})
    h = await start_harness()
    try:
        h.participant.seed(EpisodeId("r1"), {"n": "other"})
        await drain(h.client.prepare("c1", h.deadline()))
        error = await refused(
            h.client.commit("c1", h.deadline(), checkpoint_dir),
            "INVALID_CHECKPOINT_STATE",
            "FAILED_PRECONDITION",
        )
        assert "different commit" in error.message
    finally:
        await stop_harness(h)
    part = "participants/resources/double"
    # The loser's records are gone (the published manifest names others); the winner's stay.
    assert keys_below(s3_env, checkpoint_dir) == [
        f"{part}/manifest.json",
        f"{part}/{first.manifest.records_file}",
    ]


async def test_locations_outside_the_allowed_roots_and_malformed_urls_are_refused(
    s3_env: S3Connection, url: str
) -> None:
    h = await start_harness(allowed_checkpoint_roots=(f"{url}/allowed",))
    try:
        await drain(h.client.prepare("c1", h.deadline()))
        for bad in (
            f"{url}/elsewhere/c1",
            f"{url}/allowed/../c1",
            f"{url}/allowed//c1",
            f"s3://user:pw@{s3_env.bucket}/allowed/c1",
            "/tmp/local-is-not-allowed-either",
        ):
            error = await refused(
                h.client.commit("c1", h.deadline(), bad), "INVALID_REQUEST", "INVALID_ARGUMENT"
            )
            assert error.metadata["field"] == "checkpoint_dir"
            assert "pw" not in error.message
        reply = await h.client.commit("c1", h.deadline(), f"{url}/allowed/c1")
        assert reply.state == types_pb2.PARTICIPANT_STATE_COMMITTED
    finally:
        await stop_harness(h)
    assert keys_below(s3_env, f"{url}/elsewhere") == []


async def test_wrong_credentials_are_storage_failed_and_never_echoed(
    s3_env: S3Connection, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong_secret = "wrong" + secrets.token_hex(16)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)
    h = await start_harness()
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await drain(h.client.prepare("c1", h.deadline()))
        error = await refused(
            h.client.commit("c1", h.deadline(), f"{url}/c1"), "STORAGE_FAILED", "UNAVAILABLE"
        )
        assert error.metadata["cause"] == "credentials_refused"
        text = f"{error.message} {dict(error.metadata)}"
        assert wrong_secret not in text and s3_env.secret_access_key not in text
        assert s3_env.access_key_id not in text
    finally:
        await stop_harness(h)
    with pytest.raises(PublicationError) as caught:
        open_checkpoint_root(url).latest()
    assert wrong_secret not in str(caught.value)


async def store_clock_past(connection: S3Connection, prefix_url: str) -> None:
    """Wait until the store stamps a new object later than every object below `prefix_url`
    (its times have a resolution of a second): retention orders checkpoints by them."""
    location = ObjectLocation("s3", connection.bucket, prefix_url.split("/", 3)[3])
    client = client_for(location)
    newest = max(o.last_modified for o in client.list_below(location.prefix))
    probe = f"probes/{secrets.token_hex(6)}"
    async with asyncio.timeout(10):
        while True:
            await asyncio.to_thread(client.put, probe, b"x", size=1)
            stamped = await asyncio.to_thread(client.list_below, "probes")
            if any(o.key == probe and o.last_modified > newest for o in stamped):
                return
            await asyncio.sleep(0.05)


def publish_parts(
    root: ObjectCheckpointRoot, checkpoint_id: str, reply: types_pb2.CommitResponse
) -> PublishedParticipant:
    return PublishedParticipant("double", "resources", "double", reply.manifest_sha256)


async def test_publish_latest_retention_and_inspect_on_the_store(
    s3_env: S3Connection, url: str
) -> None:
    clock = iter(datetime(2030, 1, 1, tzinfo=UTC) + timedelta(minutes=i) for i in range(100))
    root = open_checkpoint_root(url, clock=lambda: next(clock))
    assert isinstance(root, ObjectCheckpointRoot)
    assert await asyncio.to_thread(root.latest) is None
    ids = [root.new_checkpoint_id() for _ in range(3)]
    # An unfinished checkpoint started before the others: retention deletes it later.
    abandoned = await commit_states(f"{url}/abandoned", {EpisodeId("x"): 1}, "abandoned")
    assert abandoned.manifest_sha256
    await store_clock_past(s3_env, f"{url}/abandoned")
    published = []
    for number, checkpoint_id in enumerate(ids):
        reply = await commit_states(
            str(root.directory(checkpoint_id)), {EpisodeId(f"r{number}"): number}, checkpoint_id
        )
        part = publish_parts(root, checkpoint_id, reply)
        # The last one defers its retention, as a controller does until its fleet resumed.
        publish = functools.partial(
            root.publish,
            checkpoint_id,
            [part],
            [EpisodeId(f"r{number}")],
            b"state",
            keep=2,
            defer_retention=number == 2,
        )
        result = await asyncio.to_thread(publish)
        published.append(result)
        assert await asyncio.to_thread(root.latest) == checkpoint_id
        # A retry of the same publication is idempotent.
        again = await asyncio.to_thread(publish)
        assert again.already_published
        assert again.fleet_manifest_sha256 == result.fleet_manifest_sha256
        # The same id with another manifest is a conflict.
        with pytest.raises(CheckpointConflict):
            await asyncio.to_thread(root.publish, checkpoint_id, [part], [], b"other", keep=2)
    # The abandoned checkpoint, started before, goes with the first publication.
    assert published[0].deleted == ("abandoned",)
    assert keys_below(s3_env, f"{url}/abandoned") == []
    assert published[2].deleted == () and published[2].pending_retention is not None
    assert await asyncio.to_thread(root.published) == ids
    completed = await asyncio.to_thread(root.complete_retention, published[2])
    assert completed.deleted == (ids[0],) and completed.pending_retention is None
    assert await asyncio.to_thread(root.published) == ids[1:]
    assert keys_below(s3_env, f"{url}/{ids[0]}") == []
    # A late retry of an older publication completes but never moves LATEST back.
    older = await asyncio.to_thread(
        root.publish,
        ids[1],
        [
            PublishedParticipant(
                "double",
                "resources",
                "double",
                published[1].manifest.participants[0].manifest_sha256,
            )
        ],
        [EpisodeId("r1")],
        b"state",
        keep=2,
    )
    assert older.already_published
    assert await asyncio.to_thread(root.latest) == ids[2]
    summary = await asyncio.to_thread(root.inspect, None)
    assert summary.checkpoint_id == ids[2]
    assert summary.directory == f"{url}/{ids[2]}"
    assert summary.participants[0].episodes == ("r2",)
    # The CLI's inspect: a root follows LATEST, a checkpoint URL verifies that checkpoint.
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "rollout_checkpoint.client.cli.main", "inspect", url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["checkpoint_id"] == ids[2]
    # Tampering with a published records object is found by inspect (digest, streaming).
    part_url = f"{url}/{ids[2]}/participants/resources/double"
    records = summary.participants[0].records_file
    data = get_object(s3_env, f"{part_url}/{records}")
    obstore.put(store_for(s3_env), f"{part_url}/{records}".split("/", 3)[3], data[:-3] + b"7}\n")
    with pytest.raises(CheckpointCorrupt, match="digest"):
        await asyncio.to_thread(root.inspect, ids[2])
    with pytest.raises(NoPublishedCheckpoint):
        await asyncio.to_thread(root.inspect, "never-published")


async def test_latest_moves_by_compare_and_swap_when_publishers_race(
    s3_env: S3Connection, url: str
) -> None:
    """Eight publications moving LATEST at once: it ends on the newest whatever order the
    swaps land in (with a plain PUT a slower, older one could land last and win)."""
    base = datetime(2030, 1, 1, tzinfo=UTC)
    root = ObjectCheckpointRoot(url)
    for number in range(8):
        reply = await commit_states(
            f"{url}/c{number}", {EpisodeId(f"r{number}"): number}, f"c{number}"
        )
        await asyncio.to_thread(
            root.publish,
            f"c{number}",
            [PublishedParticipant("double", "resources", "double", reply.manifest_sha256)],
            [],
            b"",
            keep=100,
            created_at=base + timedelta(seconds=number),
        )
    obstore.put(store_for(s3_env), f"{url}/LATEST".split("/", 3)[3], b"c0\n")

    def move(number: int) -> None:
        ObjectCheckpointRoot(url)._move_latest(f"c{number}", base + timedelta(seconds=number))

    await asyncio.gather(*(asyncio.to_thread(move, n) for n in reversed(range(8))))
    assert await asyncio.to_thread(root.latest) == "c7"
    assert await asyncio.to_thread(root.published) == [f"c{n}" for n in range(8)]


async def test_the_store_killed_mid_commit_is_storage_failed_and_a_retry_publishes(
    s3_server: SeaweedS3, s3_env: S3Connection, url: str
) -> None:
    """SIGKILL of the whole S3 server between the records upload and the manifest create:
    the commit fails typed (STORAGE_FAILED, retryable), nothing is published, and once the
    server is back the same commit publishes. Uses the session's server (a restart costs
    ~17 s; a server of its own would cost ~10 s more)."""
    checkpoint_dir = f"{url}/c1"
    killed: list[str] = []

    def kill_before_manifest(step: str) -> None:
        if step == "before_manifest_create" and not killed:
            killed.append(step)
            s3_server.kill()

    storage = PartStorage(objects=ObjectPartStorage(crash_hook=kill_before_manifest))
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await drain(h.client.prepare("c1", h.deadline()))
        error = await refused(
            h.client.commit("c1", h.deadline(), checkpoint_dir), "STORAGE_FAILED", "UNAVAILABLE"
        )
        assert killed and error.metadata["storage"] == "object_store"
        assert s3_env.secret_access_key not in error.message
        await asyncio.to_thread(s3_server.start)
        part = "participants/resources/double"
        assert f"{part}/manifest.json" not in keys_below(s3_env, checkpoint_dir)
        reply = await h.client.commit("c1", h.deadline(), checkpoint_dir)
        assert reply.state == types_pb2.PARTICIPANT_STATE_COMMITTED
    finally:
        await stop_harness(h)
    assert f"{part}/manifest.json" in keys_below(s3_env, checkpoint_dir)


def test_without_obstore_a_url_is_a_typed_error_naming_the_extra(tmp_path: object) -> None:
    """A process without the `[s3]` extra that is asked for an object-store location says
    which extra to install (obstore hidden from its imports)."""
    code = (
        "import sys; sys.modules['obstore'] = None\n"
        "from rollout_checkpoint.client.checkpointing.publication import open_checkpoint_root, PublicationError\n"
        "from rollout_checkpoint.server.core.object_parts import ObjectPartStorage\n"
        "from rollout_checkpoint.server.core.part_storage import WriteFence\n"
        "from rollout_checkpoint.server.core.errors import CheckpointError\n"
        "try:\n"
        "    open_checkpoint_root('s3://bucket-x/p')\n"
        "except PublicationError as e:\n"
        "    print('root:', e)\n"
        "try:\n"
        "    ObjectPartStorage().write_part('s3://bucket-x/p', 'k', 'i', 'c', [], WriteFence())\n"
        "except CheckpointError as e:\n"
        "    print('part:', e.reason, e.code, dict(e.metadata))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert (
        "root: object-store checkpoint locations (s3://, gs://, az://) needs obstore" in out.stdout
    )
    assert "install rollout-checkpoint[s3]" in out.stdout
    assert (
        "part: STORAGE_FAILED UNAVAILABLE" in out.stdout and "'missing_extra': 's3'" in out.stdout
    )


def test_cli_checkpoint_inspect_and_restore_source_on_s3(
    tmp_path: Path, s3_env: S3Connection, url: str
) -> None:
    """The fleet verbs with an s3:// root: `checkpoint` publishes there, `inspect` verifies
    it, and `restore --source` installs it into a fresh fleet started closed; every process
    gets the store's credentials from the environment only (the fleet file holds a URL)."""
    env = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rollout_checkpoint.client.cli.main", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def counter(*extra: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
        command = [sys.executable, "-m", "rollout_checkpoint.examples.serve", "counter"]
        return started([*command, "--session-secret", "fixed-secret", *extra], env=env)

    def fleet_file(name: str, announced: dict[str, str]) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(
            f'checkpoint_root = "{url}"\n[[participants]]\nname = "counter"\n'
            f'address = "{announced["grpc"]}"\n'
        )
        return path

    first, announced = counter()
    try:
        with httpx.Client(base_url=f"http://{announced['http']}") as episode:
            seeded = episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 4})
            assert seeded.status_code == 200
            episode.post("/ng-rollout/r1/increment_counter", json={"count": 3})
            cookies = episode.cookies
        taken = cli("checkpoint", "--fleet", str(fleet_file("first", announced)), "ckpt-a")
        assert taken.returncode == 0, taken.stderr
    finally:
        kill_group(first)
    inspected = cli("inspect", f"{url}/ckpt-a", "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["participants"][0]["episodes"] == ["r1"]
    fresh, fresh_announced = counter("--start-closed")
    try:
        fresh_file = fleet_file("fresh", fresh_announced)
        restored = cli("restore", "--fleet", str(fresh_file), "--source", "ckpt-a", "restore-1")
        assert restored.returncode == 0, restored.stderr
        assert cli("resume", "--fleet", str(fresh_file), "restore-1").returncode == 0
        with httpx.Client(base_url=f"http://{fresh_announced['http']}", cookies=cookies) as ep:
            got = ep.post("/ng-rollout/r1-a1/get_counter_value", json={})
            assert got.json() == {"count": 7}
    finally:
        kill_group(fresh)
    # With credentials the store refuses, the CLI fails in one typed line, echoing none.
    wrong = "wrong" + secrets.token_hex(16)
    env["AWS_SECRET_ACCESS_KEY"] = wrong
    refused = cli("inspect", url)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "refused the credentials" in refused.stderr
    assert wrong not in refused.stderr + refused.stdout
    assert s3_env.access_key_id not in refused.stderr + refused.stdout


async def test_a_resume_during_an_object_store_write_stops_it_before_the_manifest(
    s3_env: S3Connection, url: str
) -> None:
    """The WriteFence on the store: a Resume while the records are on their way makes the
    writer stop before its conditional manifest put, the Commit answers STALE_CHECKPOINT, and
    no manifest ever appears (a checkpoint the controller abandoned never publishes)."""
    checkpoint_dir = f"{url}/c1"
    reached, release = threading.Event(), threading.Event()

    def hold_before_records(step: str) -> None:
        if step == "before_records_put":
            reached.set()
            release.wait(30)

    storage = PartStorage(objects=ObjectPartStorage(crash_hook=hold_before_records))
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await drain(h.client.prepare("c1", h.deadline()))
        commit = asyncio.ensure_future(h.client.commit("c1", h.deadline(), checkpoint_dir))
        assert await asyncio.to_thread(reached.wait, 30)
        resumed = await h.client.resume("c1", h.deadline())
        assert resumed.state == types_pb2.PARTICIPANT_STATE_IDLE
        release.set()
        await refused(commit, "STALE_CHECKPOINT", "ABORTED")
        status = await h.client.get_status()
        assert status.admission_open
    finally:
        release.set()
        await stop_harness(h)
    assert "participants/resources/double/manifest.json" not in keys_below(s3_env, checkpoint_dir)


async def test_a_referencing_part_copied_to_the_store_verifies_exactly_when_it_restores(
    s3_env: S3Connection, url: str, tmp_path: Path
) -> None:
    """An operator copies a local root holding incremental parts to a bucket (a backup): its
    references name sibling checkpoints, which the copy holds too, so `inspect` on the store
    verifies every reference and a restore from the store reads the same records as from the
    disk. A copy missing a referenced object fails both, naming it: never one without the
    other (before incremental parts on stores, it verified and then failed to restore)."""
    from .test_incremental_retention import INSTANCE, KIND, T0, write

    local = tmp_path / "root"
    local.mkdir()
    full, lines = write(local, "c0", 2, [])
    referencing, _ = write(local, "c1", 1, lines)
    for number, (checkpoint, part) in enumerate((("c0", full), ("c1", referencing))):
        CheckpointRoot(local).publish(
            checkpoint,
            [PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)],
            [],
            b"",
            created_at=T0 + timedelta(hours=number),
            keep=2,
        )
    store = store_for(s3_env)
    prefix = url.split("/", 3)[3]
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        obstore.put(store, f"{prefix}/{path.relative_to(local)}", path.read_bytes())
    root = open_checkpoint_root(url)
    assert (await asyncio.to_thread(root.inspect, "c0")).checkpoint_id == "c0"
    (participant,) = (await asyncio.to_thread(root.inspect, "c1")).participants
    assert (participant.referenced_records, participant.chain_length) == (2, 2)

    def records(storage: LocalStorage | ObjectPartStorage, location: str) -> list[object]:
        return storage.read_part(f"{location}/c1", KIND, INSTANCE, lambda r: True)[1]

    assert await asyncio.to_thread(records, ObjectPartStorage(), url) == records(
        LocalStorage(), str(local)
    )
    obstore.delete(
        store, f"{prefix}/c0/participants/{KIND}/{INSTANCE}/{full.manifest.records_file}"
    )
    with pytest.raises(CheckpointCorrupt, match="referenced records file is missing"):
        await asyncio.to_thread(root.inspect, "c1")
    with pytest.raises(CheckpointError) as refused:
        await asyncio.to_thread(records, ObjectPartStorage(), url)
    assert refused.value.reason.value == "INVALID_CHECKPOINT_STATE"
    assert f"{url}/c0/participants" in refused.value.metadata["path"]
