"""The history on both backends (a directory, an object store) when the index or a details
file is not what the history wrote: an index over `READ_LIMIT` is set aside like a corrupt
one and recording goes on; a details file that is missing, too large or not a file is a
`details_problem` of GetCheckpoint, never an RPC error; an append that is refused (an index
of a newer format) leaves no details file behind."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_checkpoint.client.checkpointing.publication import history
from rollout_checkpoint.client.checkpointing.publication.history import (
    CORRUPT_INDEX_NAME,
    DETAILS_NAME,
    INDEX_NAME,
    HistoryNewer,
    MemberRecord,
    details_name,
    open_history,
)
from rollout_checkpoint.server.core.object_store import client_for, is_object_url, parse_object_url

from .s3_server import S3Connection, SeaweedS3
from .test_history import entry
from .test_history_api import get_checkpoint, history_coordinator

LIMIT = 4096
"""`READ_LIMIT` in these tests: larger is "too large" without writing 64 MiB."""
MEMBER = MemberRecord("m", "agent", "m-1", commit_seconds=0.5)


class Root:
    """A checkpoint root, local or on the object store, with raw access to its files."""

    def __init__(self, location: str) -> None:
        self.location = location

    def write(self, name: str, data: bytes) -> None:
        if is_object_url(self.location):
            where = parse_object_url(self.location)
            client_for(where).put(where.key(name), data, size=len(data))
        else:
            (Path(self.location) / name).write_bytes(data)

    def read(self, name: str) -> bytes:
        if is_object_url(self.location):
            where = parse_object_url(self.location)
            stored = client_for(where).get(where.key(name))
            assert stored is not None, name
            return stored.data
        return (Path(self.location) / name).read_bytes()

    def delete(self, name: str) -> None:
        if is_object_url(self.location):
            where = parse_object_url(self.location)
            client_for(where).delete([where.key(name)])
        else:
            (Path(self.location) / name).unlink()

    def details_files(self) -> list[str]:
        if is_object_url(self.location):
            where = parse_object_url(self.location)
            names = [o.key.rsplit("/", 1)[-1] for o in client_for(where).list_below(where.prefix)]
        else:
            names = [p.name for p in Path(self.location).iterdir()]
        return sorted(n for n in names if DETAILS_NAME.fullmatch(n))


@pytest.fixture(params=["local", "s3"])
def root(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Root]:
    monkeypatch.setattr(history, "READ_LIMIT", LIMIT)
    if request.param == "local":
        yield Root(str(tmp_path))
        return
    s3_server: SeaweedS3 = request.getfixturevalue("s3_server")
    connection: S3Connection = s3_server.connection
    for name, value in connection.environment().items():
        monkeypatch.setenv(name, value)
    yield Root(connection.url(f"history-storage-{secrets.token_hex(6)}"))


def test_an_index_over_the_read_limit_is_set_aside_and_recording_goes_on(root: Root) -> None:
    huge = b'{"format": 1, "entries": [' + b" " * LIMIT + b"]}"
    root.write(INDEX_NAME, huge)
    assert "history skipped" in (open_history(root.location).read().problem or "")
    open_history(root.location).append(entry(1), ())
    assert root.read(CORRUPT_INDEX_NAME) == huge
    assert [e.id for e in open_history(root.location).read().entries] == ["ckpt-1"]


@pytest.mark.parametrize("problem", ["missing", "too large", "a directory"])
async def test_a_details_file_that_cannot_be_read_is_a_details_problem(
    root: Root, problem: str
) -> None:
    name = details_name("ckpt-1")
    await asyncio.to_thread(open_history(root.location).append, entry(1, details=name), (MEMBER,))
    if problem == "missing":
        await asyncio.to_thread(root.delete, name)
    elif problem == "too large":
        await asyncio.to_thread(root.write, name, b" " * (LIMIT + 1))
    elif is_object_url(root.location):
        pytest.skip("an object store has no directories")
    else:
        (Path(root.location) / name).unlink()
        (Path(root.location) / name).mkdir()
    async with history_coordinator(root.location) as stub:  # type: ignore[arg-type]
        answer = await get_checkpoint(stub, "ckpt-1")
    assert answer.checkpoint.id == "ckpt-1" and answer.checkpoint.has_details
    assert not answer.members and answer.details_problem.startswith(name), answer


def test_appends_refused_by_a_newer_index_leave_no_details_files(root: Root) -> None:
    newer = b'{"format": 99, "entries": []}'
    root.write(INDEX_NAME, newer)
    for number in range(3):
        kept = entry(number, details=details_name(f"ckpt-{number}"))
        with pytest.raises(HistoryNewer):
            open_history(root.location).append(kept, (MEMBER,))
    assert root.details_files() == []
    assert root.read(INDEX_NAME) == newer
