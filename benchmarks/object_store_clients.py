"""Which S3 client library the object-store backend should use, decided by measurement.

    python -m benchmarks.object_store_clients                    # every installed candidate
    python -m benchmarks.object_store_clients --repeats 5 --clients obstore,aiobotocore

Starts a real SeaweedFS S3 server on 127.0.0.1 (`tests/s3_server.py`, binary from
`scripts/seaweedfs`), then, for every candidate that is installed (`obstore`,
`aiobotocore`, `boto3`, `s3fs`; none is a runtime dependency of the project except the
winner, in the `s3` extra):

1. Correctness of what checkpoints need, each a pass/fail with what was seen: a second
   `If-None-Match: *` create of a key is refused with a distinguishable error; an `If-Match`
   overwrite with the current ETag succeeds and with a stale one is refused (LATEST's
   compare-and-swap); a 64 MiB multipart upload with concurrent parts reads back identical,
   streamed; an aborted multipart upload leaves no object and no pending upload; list by
   prefix; delete; wrong credentials give a typed error that does not echo the secret; and
   the option that allows a plain-HTTP endpoint.
2. Speed: put and get of 1 x 50 MiB (multipart, 8 MiB parts, 8 in flight) and of
   1,000 x 5 KiB objects (32 in flight), each client in turn within every repeat (so the
   ratios compare runs made moments apart on the same server), as the median over repeats:
   wall seconds, and the CPU seconds the client's process spent (on 2 cores shared with the
   server, a client's CPU is taken from the server too).

Prints a table and writes `benchmarks/results/object_store_clients.json`. The numbers are
end to end through a real server on 2 shared cores: the server's own cost is in every figure,
so the ratios between clients understate the differences between the clients themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from tests.s3_server import S3Connection, SeaweedS3, weed_binary

from .common import BenchResult, ratios

MiB = 1 << 20
PART_SIZE = 8 * MiB
PART_CONCURRENCY = 8
SMALL_CONCURRENCY = 32
LARGE_BYTES = 50 * MiB
SMALL_BYTES = 5 * 1024
MULTIPART_CHECK_BYTES = 64 * MiB
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "object_store_clients.json"
CANDIDATES = ("obstore", "aiobotocore", "boto3", "s3fs")
BASELINE = "obstore"
R = TypeVar("R")
Chunk = bytes | memoryview
"""A piece of a streamed read, as the library hands it over (no copy added)."""


class Refused(Exception):
    """A conditional write the server refused, as the client reported it."""


# -- the candidates -------------------------------------------------------------------------
#
# Each adapter does every operation the way an application would with that library (its own
# transfer manager or multipart helper where it has one) and sorts its errors into a few
# kinds, keeping the library's own exception type name: "typed" below means the kind can be
# told from the exception's type or a structured code, without parsing a message.


@dataclass
class Seen:
    """What an operation raised: our kind, the library's type and its message."""

    kind: str
    type: str
    message: str


class Client:
    """The operations the checkpoint backend needs, over one library."""

    name = ""
    http_option = ""
    """How this library is told that a plain-HTTP endpoint is allowed."""

    async def open(self, conn: S3Connection) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None

    async def check_plain_http(self, conn: S3Connection) -> str:
        """What it takes for this library to use an http:// endpoint."""
        return self.http_option

    async def put(self, key: str, data: bytes) -> str:
        raise NotImplementedError

    async def create(self, key: str, data: bytes) -> str:
        """Put only if absent (`If-None-Match: *`)."""
        raise NotImplementedError

    async def update(self, key: str, data: bytes, etag: str) -> str:
        """Put only if the current ETag is `etag` (`If-Match`)."""
        raise NotImplementedError

    async def get(self, key: str) -> bytes:
        raise NotImplementedError

    def stream(self, key: str) -> AsyncIterator[Chunk]:
        raise NotImplementedError

    async def put_large(self, key: str, data: bytes) -> None:
        """Multipart: PART_SIZE parts, PART_CONCURRENCY in flight."""
        raise NotImplementedError

    async def abort_midway(self, key: str, parts: list[bytes]) -> None:
        """Start a multipart upload, upload `parts`, then fail before completing it."""
        raise NotImplementedError

    async def list(self, prefix: str) -> list[str]:
        raise NotImplementedError

    async def delete(self, key: str) -> None:
        raise NotImplementedError

    def classify(self, exc: BaseException) -> str:
        """'exists', 'precondition', 'not_found', 'auth' or 'other'."""
        raise NotImplementedError

    def seen(self, exc: BaseException) -> Seen:
        return Seen(self.classify(exc), f"{type(exc).__module__}.{type(exc).__name__}", str(exc))


class Obstore(Client):
    name = "obstore"
    http_option = 'client_options={"allow_http": True} (or AWS_ALLOW_HTTP=true)'

    def __init__(self) -> None:
        import obstore

        self.obs = obstore
        self.store: Any = None

    async def open(self, conn: S3Connection) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            conn.bucket,
            endpoint=conn.endpoint,
            region=conn.region,
            access_key_id=conn.access_key_id,
            secret_access_key=conn.secret_access_key,
            virtual_hosted_style_request=False,
            client_options={"allow_http": True},
            # No retries: the benchmark measures one attempt, and a refused credential
            # must surface at once.
            retry_config={"max_retries": 0},
        )

    async def check_plain_http(self, conn: S3Connection) -> str:
        from obstore.store import S3Store

        https_only = S3Store(
            conn.bucket,
            endpoint=conn.endpoint,
            region=conn.region,
            access_key_id=conn.access_key_id,
            secret_access_key=conn.secret_access_key,
            retry_config={"max_retries": 0},
        )
        try:
            await self.obs.head_async(https_only, "anything")
        except Exception as exc:
            first = str(exc).splitlines()[0][:100]
            return f"{self.http_option}; without it: {type(exc).__name__} ({first})"
        raise AssertionError("an http:// endpoint was used without allow_http")

    async def put(self, key: str, data: bytes) -> str:
        result = await self.obs.put_async(self.store, key, data, use_multipart=False)
        return str(result["e_tag"])

    async def create(self, key: str, data: bytes) -> str:
        result = await self.obs.put_async(self.store, key, data, mode="create")
        return str(result["e_tag"])

    async def update(self, key: str, data: bytes, etag: str) -> str:
        result = await self.obs.put_async(self.store, key, data, mode={"e_tag": etag})
        return str(result["e_tag"])

    async def get(self, key: str) -> bytes:
        result = await self.obs.get_async(self.store, key)
        return bytes(await result.bytes_async())

    async def stream(self, key: str) -> AsyncIterator[Chunk]:
        result = await self.obs.get_async(self.store, key)
        async for chunk in result.stream(min_chunk_size=MiB):
            yield memoryview(chunk)  # obstore.Bytes is a buffer: no copy

    async def put_large(self, key: str, data: bytes) -> None:
        await self.obs.put_async(
            self.store, key, data, chunk_size=PART_SIZE, max_concurrency=PART_CONCURRENCY
        )

    async def abort_midway(self, key: str, parts: list[bytes]) -> None:
        # obstore has no explicit multipart handle: a streamed put whose source fails is
        # aborted by the library (put.rs: on error, `writer.abort()`).
        async def source() -> AsyncIterator[bytes]:
            for part in parts:
                yield part
            await asyncio.sleep(0.5)  # let the parts reach the server
            raise RuntimeError("source failed midway")

        await self.obs.put_async(
            self.store, key, source(), chunk_size=PART_SIZE, max_concurrency=PART_CONCURRENCY
        )

    async def list(self, prefix: str) -> list[str]:
        metas = await self.obs.list(self.store, prefix=prefix).collect_async()
        return sorted(m["path"] for m in metas)

    async def delete(self, key: str) -> None:
        await self.obs.delete_async(self.store, key)

    def classify(self, exc: BaseException) -> str:
        from obstore import exceptions as e

        kinds: list[tuple[type[BaseException], str]] = [
            (e.AlreadyExistsError, "exists"),
            (e.PreconditionError, "precondition"),
            (e.NotFoundError, "not_found"),
            (e.PermissionDeniedError, "auth"),
            (e.UnauthenticatedError, "auth"),
        ]
        # obstore 0.12 raises the builtin FileNotFoundError for a missing key (not its own
        # NotFoundError, which is kept in the list for other versions).
        kinds.append((FileNotFoundError, "not_found"))
        for kind_type, kind in kinds:
            if isinstance(exc, kind_type):
                return kind
        return "other"


def _botocore_config() -> Any:
    from botocore.config import Config  # type: ignore[import-untyped]

    return Config(
        s3={"addressing_style": "path"},
        max_pool_connections=64,
        retries={"max_attempts": 1, "mode": "standard"},
    )


def _botocore_kind(exc: BaseException) -> str:
    from botocore.exceptions import ClientError  # type: ignore[import-untyped]

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
            return "precondition"
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            return "not_found"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied") or status in (
            401,
            403,
        ):
            return "auth"
    return "other"


class AioBotocore(Client):
    name = "aiobotocore"
    http_option = "none needed: an http:// endpoint_url is used as given"

    def __init__(self) -> None:
        from aiobotocore.session import get_session  # type: ignore[import-untyped]

        self.session = get_session()
        self.stack = contextlib.AsyncExitStack()
        self.s3: Any = None
        self.bucket = ""

    async def open(self, conn: S3Connection) -> None:
        self.bucket = conn.bucket
        self.s3 = await self.stack.enter_async_context(
            self.session.create_client(
                "s3",
                endpoint_url=conn.endpoint,
                region_name=conn.region,
                aws_access_key_id=conn.access_key_id,
                aws_secret_access_key=conn.secret_access_key,
                config=_botocore_config(),
            )
        )

    async def close(self) -> None:
        await self.stack.aclose()

    async def put(self, key: str, data: bytes) -> str:
        out = await self.s3.put_object(Bucket=self.bucket, Key=key, Body=data)
        return str(out["ETag"])

    async def create(self, key: str, data: bytes) -> str:
        out = await self.s3.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
        return str(out["ETag"])

    async def update(self, key: str, data: bytes, etag: str) -> str:
        out = await self.s3.put_object(Bucket=self.bucket, Key=key, Body=data, IfMatch=etag)
        return str(out["ETag"])

    async def get(self, key: str) -> bytes:
        out = await self.s3.get_object(Bucket=self.bucket, Key=key)
        async with out["Body"] as body:
            return bytes(await body.read())

    async def stream(self, key: str) -> AsyncIterator[Chunk]:
        out = await self.s3.get_object(Bucket=self.bucket, Key=key)
        async with out["Body"] as body:
            async for chunk in body.iter_chunks(MiB):
                yield chunk

    async def put_large(self, key: str, data: bytes) -> None:
        # No transfer manager in aiobotocore: the parts by hand, PART_CONCURRENCY at a time.
        upload = await self.s3.create_multipart_upload(Bucket=self.bucket, Key=key)
        upload_id = upload["UploadId"]
        gate = asyncio.Semaphore(PART_CONCURRENCY)

        async def part(number: int, offset: int) -> dict[str, Any]:
            async with gate:
                out = await self.s3.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data[offset : offset + PART_SIZE],
                )
            return {"PartNumber": number, "ETag": out["ETag"]}

        try:
            parts = await asyncio.gather(
                *(part(i + 1, off) for i, off in enumerate(range(0, len(data), PART_SIZE)))
            )
            await self.s3.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": list(parts)},
            )
        except BaseException:
            await self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    async def abort_midway(self, key: str, parts: list[bytes]) -> None:
        upload = await self.s3.create_multipart_upload(Bucket=self.bucket, Key=key)
        for number, body in enumerate(parts, 1):
            await self.s3.upload_part(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload["UploadId"],
                PartNumber=number,
                Body=body,
            )
        await self.s3.abort_multipart_upload(
            Bucket=self.bucket, Key=key, UploadId=upload["UploadId"]
        )
        raise RuntimeError("aborted")

    async def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        paginator = self.s3.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return sorted(keys)

    async def delete(self, key: str) -> None:
        await self.s3.delete_object(Bucket=self.bucket, Key=key)

    def classify(self, exc: BaseException) -> str:
        return _botocore_kind(exc)


class Boto3(Client):
    """boto3 is synchronous: every call runs on a thread pool, as an asyncio service would
    have to run it (a pool of SMALL_CONCURRENCY threads, so it is not starved of workers)."""

    name = "boto3"
    http_option = "none needed: an http:// endpoint_url is used as given"

    def __init__(self) -> None:
        import boto3  # type: ignore[import-untyped]

        self.boto3 = boto3
        self.pool = ThreadPoolExecutor(SMALL_CONCURRENCY, thread_name_prefix="boto3")
        self.s3: Any = None
        self.bucket = ""

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda: fn(*args, **kwargs)
        )

    async def open(self, conn: S3Connection) -> None:
        self.bucket = conn.bucket
        self.s3 = self.boto3.session.Session().client(
            "s3",
            endpoint_url=conn.endpoint,
            region_name=conn.region,
            aws_access_key_id=conn.access_key_id,
            aws_secret_access_key=conn.secret_access_key,
            config=_botocore_config(),
        )

    async def close(self) -> None:
        self.pool.shutdown(wait=False)

    async def put(self, key: str, data: bytes) -> str:
        out = await self.call(self.s3.put_object, Bucket=self.bucket, Key=key, Body=data)
        return str(out["ETag"])

    async def create(self, key: str, data: bytes) -> str:
        out = await self.call(
            self.s3.put_object, Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*"
        )
        return str(out["ETag"])

    async def update(self, key: str, data: bytes, etag: str) -> str:
        out = await self.call(
            self.s3.put_object, Bucket=self.bucket, Key=key, Body=data, IfMatch=etag
        )
        return str(out["ETag"])

    async def get(self, key: str) -> bytes:
        out = await self.call(self.s3.get_object, Bucket=self.bucket, Key=key)
        return bytes(await self.call(out["Body"].read))

    async def stream(self, key: str) -> AsyncIterator[Chunk]:
        out = await self.call(self.s3.get_object, Bucket=self.bucket, Key=key)
        body = out["Body"]
        try:
            while chunk := await self.call(body.read, MiB):
                yield chunk
        finally:
            body.close()

    async def put_large(self, key: str, data: bytes) -> None:
        import io

        from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]

        config = TransferConfig(
            multipart_threshold=PART_SIZE,
            multipart_chunksize=PART_SIZE,
            max_concurrency=PART_CONCURRENCY,
        )
        await self.call(self.s3.upload_fileobj, io.BytesIO(data), self.bucket, key, Config=config)

    async def abort_midway(self, key: str, parts: list[bytes]) -> None:
        upload = await self.call(self.s3.create_multipart_upload, Bucket=self.bucket, Key=key)
        for number, body in enumerate(parts, 1):
            await self.call(
                self.s3.upload_part,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload["UploadId"],
                PartNumber=number,
                Body=body,
            )
        await self.call(
            self.s3.abort_multipart_upload,
            Bucket=self.bucket,
            Key=key,
            UploadId=upload["UploadId"],
        )
        raise RuntimeError("aborted")

    async def list(self, prefix: str) -> list[str]:
        def collect() -> list[str]:
            paginator = self.s3.get_paginator("list_objects_v2")
            return [
                item["Key"]
                for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix)
                for item in page.get("Contents", [])
            ]

        return sorted(await self.call(collect))

    async def delete(self, key: str) -> None:
        await self.call(self.s3.delete_object, Bucket=self.bucket, Key=key)

    def classify(self, exc: BaseException) -> str:
        return _botocore_kind(exc)


class S3Fs(Client):
    """fsspec's S3 filesystem (over aiobotocore). It has no If-Match put: `update` goes
    through its underlying aiobotocore client, which is noted in the results."""

    name = "s3fs"
    http_option = "none needed: an http:// endpoint_url is used as given"

    def __init__(self) -> None:
        import s3fs  # type: ignore[import-untyped]

        self.s3fs = s3fs
        self.fs: Any = None
        self.bucket = ""

    async def open(self, conn: S3Connection) -> None:
        self.bucket = conn.bucket
        self.fs = self.s3fs.S3FileSystem(
            key=conn.access_key_id,
            secret=conn.secret_access_key,
            endpoint_url=conn.endpoint,
            client_kwargs={"region_name": conn.region},
            config_kwargs={
                "s3": {"addressing_style": "path"},
                "max_pool_connections": 64,
                "retries": {"max_attempts": 1, "mode": "standard"},
            },
            asynchronous=True,
            skip_instance_cache=True,
            use_listings_cache=False,
            max_concurrency=PART_CONCURRENCY,
        )
        await self.fs.set_session()

    async def close(self) -> None:
        if self.fs is not None and self.fs._s3 is not None:
            await self.fs._s3.close()

    def path(self, key: str) -> str:
        return f"{self.bucket}/{key}"

    async def put(self, key: str, data: bytes) -> str:
        out = await self.fs._pipe_file(self.path(key), data)
        return str(out["ETag"])

    async def create(self, key: str, data: bytes) -> str:
        out = await self.fs._pipe_file(self.path(key), data, mode="create")
        return str(out["ETag"])

    async def update(self, key: str, data: bytes, etag: str) -> str:
        s3 = await self.fs.get_s3(self.bucket)
        out = await s3.put_object(Bucket=self.bucket, Key=key, Body=data, IfMatch=etag)
        return str(out["ETag"])

    async def get(self, key: str) -> bytes:
        return bytes(await self.fs._cat_file(self.path(key)))

    async def stream(self, key: str) -> AsyncIterator[Chunk]:
        handle = await self.fs.open_async(self.path(key), "rb")
        try:
            while chunk := await handle.read(MiB):
                yield chunk
        finally:
            await handle.close()

    async def put_large(self, key: str, data: bytes) -> None:
        await self.fs._pipe_file(
            self.path(key), data, chunksize=PART_SIZE, max_concurrency=PART_CONCURRENCY
        )

    async def abort_midway(self, key: str, parts: list[bytes]) -> None:
        # No public multipart handle in s3fs; its own helpers abort on failure
        # (`_abort_mpu`), reached here through its aiobotocore client.
        s3 = await self.fs.get_s3(self.bucket)
        upload = await s3.create_multipart_upload(Bucket=self.bucket, Key=key)
        for number, body in enumerate(parts, 1):
            await s3.upload_part(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload["UploadId"],
                PartNumber=number,
                Body=body,
            )
        await self.fs._abort_mpu(self.bucket, key, upload["UploadId"])
        raise RuntimeError("aborted")

    async def list(self, prefix: str) -> list[str]:
        found = await self.fs._find(self.path(prefix.rstrip("/")))
        return sorted(p.removeprefix(self.bucket + "/") for p in found)

    async def delete(self, key: str) -> None:
        await self.fs._rm_file(self.path(key))

    def classify(self, exc: BaseException) -> str:
        if isinstance(exc, FileExistsError):
            return "exists"
        if isinstance(exc, FileNotFoundError):
            return "not_found"
        if isinstance(exc, PermissionError):
            return "auth"
        return _botocore_kind(exc)


FACTORIES: dict[str, Callable[[], Client]] = {
    "obstore": Obstore,
    "aiobotocore": AioBotocore,
    "boto3": Boto3,
    "s3fs": S3Fs,
}


# -- correctness ----------------------------------------------------------------------------


@dataclass
class Check:
    """One correctness check of one client: passed, and what was seen (error types...)."""

    name: str
    passed: bool
    detail: str
    seconds: float = 0.0


async def _raises(op: Awaitable[Any], client: Client) -> Seen | None:
    try:
        await op
    except Exception as exc:
        return client.seen(exc)
    return None


async def check_conditional_create(c: Client, server: SeaweedS3, p: str) -> str:
    key = f"{p}create/manifest.json"
    first = secrets.token_bytes(64)
    etag = await c.create(key, first)
    seen = await _raises(c.create(key, secrets.token_bytes(64)), c)
    assert seen is not None, "the second create succeeded: If-None-Match was ignored"
    assert seen.kind in ("exists", "precondition"), f"refused, but as {seen}"
    assert await c.get(key) == first, "the refused create replaced the object"
    return f"refused as {seen.type} ({seen.kind}); first ETag {etag}"


async def check_cas_etag(c: Client, server: SeaweedS3, p: str) -> str:
    key = f"{p}cas/LATEST"
    old = await c.put(key, b"checkpoint-1")
    new = await c.update(key, b"checkpoint-2", old)
    assert new != old, "the ETag did not change with the content"
    seen = await _raises(c.update(key, b"checkpoint-0", old), c)
    assert seen is not None, "an If-Match with a stale ETag succeeded"
    assert seen.kind == "precondition", f"refused, but as {seen}"
    assert await c.get(key) == b"checkpoint-2"
    return f"stale ETag refused as {seen.type}; ETags {old} -> {new}"


async def check_multipart(c: Client, server: SeaweedS3, p: str) -> str:
    key = f"{p}multipart/records.jsonl"
    data = os.urandom(MULTIPART_CHECK_BYTES)
    await c.put_large(key, data)
    digest = hashlib.sha256()
    chunks = 0
    async for chunk in c.stream(key):
        digest.update(chunk)
        chunks += 1
    assert digest.digest() == hashlib.sha256(data).digest(), "read back differs"
    head = server.request("HEAD", key)
    return (
        f"64 MiB in {PART_SIZE // MiB} MiB parts x{PART_CONCURRENCY} in flight, "
        f"read back streamed in {chunks} chunks, sha256 equal; ETag {head.headers.get('etag')}"
    )


async def check_abort(c: Client, server: SeaweedS3, p: str) -> str:
    key = f"{p}abort/records.jsonl"
    parts = [os.urandom(PART_SIZE), os.urandom(PART_SIZE)]
    seen = await _raises(c.abort_midway(key, parts), c)
    assert seen is not None, "the upload did not fail"
    missing = await _raises(c.get(key), c)
    assert missing is not None and missing.kind == "not_found", f"after abort, get: {missing}"
    pending = server.request("GET", query="uploads")
    assert pending.status == 200, pending
    assert key.encode() not in pending.body, "ListMultipartUploads still lists the upload"
    return "no object, and ListMultipartUploads lists no upload for the key"


async def check_list_delete(c: Client, server: SeaweedS3, p: str) -> str:
    keys = [f"{p}list/a/1", f"{p}list/a/2", f"{p}list/a/sub/3"]
    for key in [*keys, f"{p}list/b/1"]:
        await c.put(key, b"x")
    listed = await c.list(f"{p}list/a/")
    assert listed == keys, listed
    await c.delete(keys[0])
    missing = await _raises(c.get(keys[0]), c)
    assert missing is not None and missing.kind == "not_found", missing
    assert await c.list(f"{p}list/a/") == keys[1:]
    return f"prefix listed {len(keys)} of 4 (recursive); deleted key reads as {missing.type}"


async def check_wrong_credentials(c: Client, server: SeaweedS3, p: str) -> str:
    bad = replace(server.connection, secret_access_key="WRONG" + secrets.token_urlsafe(24))
    other = FACTORIES[c.name]()
    await other.open(bad)
    try:
        seen = await _raises(other.get(f"{p}anything"), other)
        put_seen = await _raises(other.put(f"{p}anything", b"x"), other)
    finally:
        await other.close()
    assert seen is not None and put_seen is not None, "a wrong secret was accepted"
    for s in (seen, put_seen):
        assert bad.secret_access_key not in s.message, "the secret is echoed in the error"
        assert server.connection.secret_access_key not in s.message
        assert s.kind == "auth", f"not typed as an auth error: {s}"
    return f"{seen.type} ({seen.message.splitlines()[0][:120]}); secret not echoed"


CHECKS: dict[str, Callable[[Client, SeaweedS3, str], Awaitable[str]]] = {
    "create_if_absent": check_conditional_create,
    "cas_on_etag": check_cas_etag,
    "multipart_64mib_streamed": check_multipart,
    "multipart_abort": check_abort,
    "list_prefix_delete": check_list_delete,
    "wrong_credentials": check_wrong_credentials,
}


async def correctness(client: Client, server: SeaweedS3) -> list[Check]:
    results = []
    for name, check in CHECKS.items():
        prefix = f"correctness/{client.name}/{secrets.token_hex(4)}/"
        started = time.perf_counter()
        try:
            detail = await check(client, server, prefix)
            passed = True
        except AssertionError as exc:
            passed, detail = False, f"FAILED: {exc}"
        except Exception as exc:
            passed = False
            detail = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(limit=3)
        results.append(Check(name, passed, detail, time.perf_counter() - started))
    try:
        results.append(
            Check("plain_http_endpoint", True, await client.check_plain_http(server.connection))
        )
    except AssertionError as exc:
        results.append(Check("plain_http_endpoint", False, f"FAILED: {exc}"))
    return results


# -- speed ----------------------------------------------------------------------------------


@dataclass
class Timings:
    """Per operation and client: wall seconds, and the benchmark process's CPU seconds (every
    thread: the event loop, boto3's pool, obstore's Rust runtime) over the same interval."""

    wall: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    cpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @contextlib.contextmanager
    def measure(self, op: str, client: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        self.wall.setdefault(op, {}).setdefault(client, []).append(time.perf_counter() - wall)
        self.cpu.setdefault(op, {}).setdefault(client, []).append(time.process_time() - cpu)


async def _bounded(limit: int, count: int, op: Callable[[int], Awaitable[R]]) -> list[R]:
    """`op(0) ... op(count - 1)`, at most `limit` in flight; results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(i: int) -> R:
        async with gate:
            return await op(i)

    return await asyncio.gather(*(one(i) for i in range(count)))


def _small_key(c: Client, repeat: int, i: int) -> str:
    return f"speed/{c.name}/{repeat}/small/{i:05d}"


async def _put_small(c: Client, repeat: int, small: list[bytes], i: int) -> str:
    return await c.put(_small_key(c, repeat, i), small[i])


async def _get_small(c: Client, repeat: int, i: int) -> bytes:
    return await c.get(_small_key(c, repeat, i))


async def speed_round(
    clients: list[Client], timings: Timings, repeat: int, large: bytes, small: list[bytes]
) -> None:
    """One repeat: every op, each client in turn (rotated each repeat, so no client is
    always first after another's load)."""
    order = clients[repeat % len(clients) :] + clients[: repeat % len(clients)]
    digest = hashlib.sha256(large).digest()
    for c in order:
        with timings.measure("put 1 x 50 MiB", c.name):
            await c.put_large(f"speed/{c.name}/{repeat}/large.bin", large)
    for c in order:
        with timings.measure("get 1 x 50 MiB", c.name):
            # Streamed, as a digest-verifying read would be; the hashing itself is kept out
            # of the clock (it costs the same whatever the client).
            chunks = [chunk async for chunk in c.stream(f"speed/{c.name}/{repeat}/large.bin")]
        assert hashlib.sha256(b"".join(chunks)).digest() == digest, c.name
    put_small = f"put {len(small):,} x 5 KiB"
    for c in order:
        with timings.measure(put_small, c.name):
            await _bounded(
                SMALL_CONCURRENCY, len(small), functools.partial(_put_small, c, repeat, small)
            )
    get_small = f"get {len(small):,} x 5 KiB"
    for c in order:
        with timings.measure(get_small, c.name):
            got = await _bounded(
                SMALL_CONCURRENCY, len(small), functools.partial(_get_small, c, repeat)
            )
        assert got == small, c.name


# -- the run --------------------------------------------------------------------------------


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def weed_version(weed: Path) -> str:
    done = subprocess.run([str(weed), "version"], capture_output=True, text=True, check=False)
    return " ".join(done.stdout.split()[1:3])  # "version 30GB 4.53 linux amd64"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    wanted = [n.strip() for n in args.clients.split(",") if n.strip()]
    clients: list[Client] = []
    skipped: dict[str, str] = {}
    for name in wanted:
        try:
            clients.append(FACTORIES[name]())
        except ImportError as exc:
            skipped[name] = f"not installed ({exc.name})"
    if not clients:
        raise SystemExit(f"no candidate installed: {skipped}")
    names = [c.name for c in clients]
    baseline = BASELINE if BASELINE in names else names[0]

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="object-store-bench-") as work:
        server = SeaweedS3(weed_binary(), Path(work))
        try:
            server.start()
            for c in clients:
                await c.open(server.connection)
            checks = {c.name: await correctness(c, server) for c in clients}
            large = os.urandom(LARGE_BYTES)
            small = [os.urandom(SMALL_BYTES) for _ in range(args.small_count)]
            timings = Timings()
            for repeat in range(args.repeats):
                await speed_round(clients, timings, repeat, large, small)
        finally:
            for c in clients:
                with contextlib.suppress(Exception):
                    await c.close()
            server.close()

    result = BenchResult(
        "object_store_clients",
        "S3 client libraries against SeaweedFS",
        "end-to-end seconds per operation batch through a real S3 server on 127.0.0.1",
        params={
            "repeats": args.repeats,
            "small_count": args.small_count,
            "part_size": PART_SIZE,
            "part_concurrency": PART_CONCURRENCY,
            "small_concurrency": SMALL_CONCURRENCY,
            "baseline": baseline,
        },
    )
    for kind, table, unit in (("wall", timings.wall, "s"), ("cpu", timings.cpu, "cpu-s")):
        for op, by_client in table.items():
            for name, samples in by_client.items():
                result.figure(name, f"{op} [{kind}]", unit, samples)
                if name != baseline:
                    result.ratio(
                        f"{op} [{kind}]: {name} / {baseline}",
                        name,
                        baseline,
                        ratios(samples, by_client[baseline]),
                    )
    result.seconds = time.perf_counter() - started
    return {
        "benchmark": result.to_json(),
        "correctness": {
            name: [{"check": k.name, "passed": k.passed, "detail": k.detail} for k in found]
            for name, found in checks.items()
        },
        "skipped": skipped,
        "versions": {n: _version(n) for n in (*CANDIDATES, "botocore")}
        | {"seaweedfs": weed_version(server.weed)},
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }


def render(payload: dict[str, Any]) -> str:
    bench = payload["benchmark"]
    baseline = bench["params"]["baseline"]
    clients = list(payload["correctness"])
    out = ["Correctness (against SeaweedFS):"]
    rows = [["check", *clients]]
    for i, first in enumerate(payload["correctness"][clients[0]]):
        rows.append(
            [first["check"]]
            + ["ok" if payload["correctness"][c][i]["passed"] else "FAIL" for c in clients]
        )
    out.append(_table(rows))
    for c in clients:
        for entry in payload["correctness"][c]:
            out.append(f"  {c} {entry['check']}: {entry['detail']}")
    out.append("")
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    for f in bench["figures"]:
        figures.setdefault(f["metric"], {})[f["case"]] = f
    ratio_of = {r["name"]: r["median"] for r in bench["ratios"]}
    for kind, what in (
        ("wall", "wall seconds"),
        ("cpu", "CPU seconds of the benchmark process (client side, all threads)"),
    ):
        out.append(
            f"Speed, {what}: median over {bench['params']['repeats']} repeats (min-max); "
            f"xN = {baseline}'s figure times N (median of per-repeat ratios):"
        )
        rows = [["operation", *clients]]
        for metric, by_client in figures.items():
            if not metric.endswith(f"[{kind}]"):
                continue
            row = [metric.removesuffix(f" [{kind}]")]
            for c in clients:
                f = by_client[c]
                cell = f"{f['median']:.3f} ({f['min']:.3f}-{f['max']:.3f})"
                if c != baseline:
                    cell += f" x{ratio_of[f'{metric}: {c} / {baseline}']:.2f}"
                row.append(cell)
            rows.append(row)
        out.append(_table(rows))
        out.append("")
    if payload["skipped"]:
        out.append(f"skipped: {payload['skipped']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=",".join(CANDIDATES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small-count", type=int, default=1000)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    payload = asyncio.run(run(args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(render(payload))
    print(f"\nwrote {args.output}")
    failed = [
        f"{c}:{e['check']}"
        for c, es in payload["correctness"].items()
        for e in es
        if not e["passed"]
    ]
    if failed:
        print(f"correctness failures: {', '.join(failed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
