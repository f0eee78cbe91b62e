"""The S3 server the object-store tests run against is real, and honours what they rely on.

A smoke test of `tests/s3_server.py` with the chosen client (obstore), in the default suite:
if SeaweedFS stopped honouring a conditional put, or the fixture stopped starting it, this
fails here, with a plain reason, before any checkpoint test misreads it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import obstore
import pytest
from obstore.exceptions import (
    AlreadyExistsError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import S3Store

from .s3_server import S3Connection, SeaweedS3

PART = 5 * 1024 * 1024  # S3's smallest part (all but the last)


def store_for(connection: S3Connection) -> S3Store:
    """An obstore client for the server: path-style requests, plain HTTP allowed (it is off by
    default), and no retries, so a refusal surfaces at once as what the server said."""
    return S3Store(
        connection.bucket,
        endpoint=connection.endpoint,
        region=connection.region,
        access_key_id=connection.access_key_id,
        secret_access_key=connection.secret_access_key,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
    )


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix: the session's server is shared by every test."""
    return f"smoke/{secrets.token_hex(6)}/"


async def test_a_second_create_of_the_same_key_is_refused(
    s3_server: SeaweedS3, prefix: str
) -> None:
    store = store_for(s3_server.connection)
    key = prefix + "manifest.json"
    first = await obstore.put_async(store, key, b'{"part": 1}', mode="create")
    assert first["e_tag"]
    with pytest.raises(AlreadyExistsError) as refused:
        await obstore.put_async(store, key, b'{"part": "other"}', mode="create")
    assert s3_server.connection.secret_access_key not in str(refused.value)
    got = await obstore.get_async(store, key)
    assert bytes(await got.bytes_async()) == b'{"part": 1}'
    assert got.meta["e_tag"] == first["e_tag"]


async def test_of_concurrent_creates_and_swaps_exactly_one_wins(
    s3_server: SeaweedS3, prefix: str
) -> None:
    """Two participants publishing the same manifest, or two writers moving LATEST from the
    same version, at the same moment: the server, not the client, must pick one winner."""
    store = store_for(s3_server.connection)

    async def attempt(key: str, body: bytes, mode: Any) -> str:
        try:
            await obstore.put_async(store, key, body, mode=mode)
        except (AlreadyExistsError, PreconditionError) as exc:
            return type(exc).__name__
        return "won"

    creates = await asyncio.gather(
        *(attempt(prefix + "manifest.json", b"%d" % i, "create") for i in range(8))
    )
    assert sorted(creates) == ["AlreadyExistsError"] * 7 + ["won"], creates
    base = await obstore.put_async(store, prefix + "LATEST", b"base")
    swaps = await asyncio.gather(
        *(attempt(prefix + "LATEST", b"%d" % i, {"e_tag": base["e_tag"]}) for i in range(8))
    )
    assert sorted(swaps) == ["PreconditionError"] * 7 + ["won"], swaps


async def test_latest_moves_by_compare_and_swap_on_its_etag(
    s3_server: SeaweedS3, prefix: str
) -> None:
    store = store_for(s3_server.connection)
    key = prefix + "LATEST"
    v1 = await obstore.put_async(store, key, b"ckpt-1")
    v2 = await obstore.put_async(store, key, b"ckpt-2", mode={"e_tag": v1["e_tag"]})
    assert v2["e_tag"] != v1["e_tag"]
    # A writer that read v1 loses: its swap is refused and LATEST keeps the winner's value.
    with pytest.raises(PreconditionError):
        await obstore.put_async(store, key, b"ckpt-0", mode={"e_tag": v1["e_tag"]})
    got = await obstore.get_async(store, key)
    assert bytes(await got.bytes_async()) == b"ckpt-2"
    head = await obstore.head_async(store, key)
    assert head["e_tag"] == v2["e_tag"]
    # An update of a key that does not exist is refused too (SeaweedFS answers 404 NoSuchKey,
    # which object_store reports as a failed precondition, not as a missing key).
    with pytest.raises(PreconditionError):
        await obstore.put_async(store, prefix + "absent", b"x", mode={"e_tag": v1["e_tag"]})


async def test_multipart_upload_completes_and_an_aborted_one_leaves_nothing(
    s3_server: SeaweedS3, prefix: str
) -> None:
    store = store_for(s3_server.connection)
    data = os.urandom(2 * PART + 12345)
    done = await obstore.put_async(
        store, prefix + "records.jsonl", data, chunk_size=PART, max_concurrency=3
    )
    assert str(done["e_tag"]).strip('"').endswith("-3"), done  # a 3-part upload's ETag
    got = await obstore.get_async(store, prefix + "records.jsonl")
    assert bytes(await got.bytes_async()) == data

    async def failing_source() -> AsyncIterator[bytes]:
        yield os.urandom(PART)
        yield os.urandom(PART)
        await asyncio.sleep(0.2)  # the parts reach the server before the source fails
        raise OSError("source failed midway")

    key = prefix + "aborted.jsonl"
    with pytest.raises(Exception, match="source failed midway"):
        await obstore.put_async(store, key, failing_source(), chunk_size=PART)
    with pytest.raises(FileNotFoundError):  # obstore raises the builtin for a missing key
        await obstore.head_async(store, key)
    # obstore aborted the upload: the server lists no pending upload for the key.
    pending = s3_server.request("GET", query="uploads")
    assert pending.status == 200, pending
    assert key.encode() not in pending.body, pending.body[:2000]


async def test_wrong_credentials_are_a_typed_error_that_does_not_echo_them(
    s3_server: SeaweedS3, prefix: str
) -> None:
    wrong_secret = replace(s3_server.connection, secret_access_key="nope" + secrets.token_hex(16))
    wrong_key = replace(s3_server.connection, access_key_id="AKUNKNOWN" + secrets.token_hex(4))
    for connection in (wrong_secret, wrong_key):
        store = store_for(connection)
        for attempt in (
            obstore.put_async(store, prefix + "x", b"x"),
            obstore.get_async(store, prefix + "x"),
        ):
            with pytest.raises((PermissionDeniedError, UnauthenticatedError)) as refused:
                await attempt
            text = f"{refused.value}\n{refused.value!r}"
            assert connection.secret_access_key not in text
            assert s3_server.connection.secret_access_key not in text


async def test_a_killed_server_restarts_with_its_data(s3_server: SeaweedS3, prefix: str) -> None:
    """What the kill-mid-commit tests rely on: after a SIGKILL of the whole server the endpoint
    refuses, and `restart()` brings the same endpoint back over the same data, accepting
    writes again (SeaweedFS serves reads ~2 s after a restart but holds writes for its 15 s
    warm-up; `start()` returns only once a write has gone through).

    It reuses the session's server (a server of its own would add ~10 s to the default suite);
    it runs last in this module and leaves the server running."""
    store = store_for(s3_server.connection)
    await obstore.put_async(store, prefix + "before-kill", b"kept", mode="create")
    s3_server.kill()
    assert not s3_server.running
    with pytest.raises(Exception):  # noqa: B017, PT011 - connection refused, whatever its type
        await obstore.get_async(store, prefix + "before-kill")
    await asyncio.to_thread(s3_server.start)
    got = await obstore.get_async(store, prefix + "before-kill")
    assert bytes(await got.bytes_async()) == b"kept"
    with pytest.raises(AlreadyExistsError):
        await obstore.put_async(store, prefix + "before-kill", b"other", mode="create")
    await obstore.put_async(store, prefix + "after-restart", b"new", mode="create")
