"""Benchmark 9: commit and restore of a part on an object store (SeaweedFS) against a raw put
and get of the same bytes with the same client, in one run.

A real S3 server (`weed server -s3` on loopback, `tests/s3_server.py`) and the participant's
own object-store backend (`ObjectPartStorage`), driven in this process through obstore with the
credentials in the standard variables, as a participant gets them:

* commit: `write_part` of N records of S bytes (serialize, hash, a GET that finds no
  published manifest, the records PUT — a concurrent multipart upload beyond 8 MB —, the
  manifest PUT with `If-None-Match: *`), each into a fresh checkpoint prefix;
* restore: `read_part` of that part (the manifest GET, the records streamed, hashed and every
  line parsed and selected);
* raw: one PUT of the same records bytes (same client, same part size and concurrency), and
  one GET of them into memory; and that GET plus `json.loads` of every line, the part of a
  restore no store can avoid (parsing dominates a restore of small records).

Commits alternate with raw puts and restores with raw gets, so each ratio compares runs taken
side by side. The conditional put's own cost is measured apart: the same small manifest
created with `If-None-Match: *` at a fresh key vs a plain PUT, interleaved.

Without a built `weed` binary (`scripts/seaweedfs`, which `scripts/test` builds) this
benchmark measures nothing and says why; it never builds it (minutes).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import tempfile
from pathlib import Path
from typing import Any

from rollout_checkpoint.server.core.object_parts import ObjectPartStorage
from rollout_checkpoint.server.core.object_store import ObjectLocation, client_for
from rollout_checkpoint.server.core.part_storage import WriteFence

from .common import REPO, BenchResult, ms, now, ratios

MB = 1e6


def built_weed() -> Path | None:
    """The cached `weed` binary if it is already built ($ROLLOUT_CHECKPOINT_WEED first)."""
    override = os.environ.get("ROLLOUT_CHECKPOINT_WEED")
    if override:
        return Path(override) if os.access(override, os.X_OK) else None
    script = (REPO / "scripts" / "seaweedfs").read_text()
    match = re.search(r"^VERSION=(\S+)$", script, re.M)
    if match is None:
        return None
    cache = os.environ.get("ROLLOUT_CHECKPOINT_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollout-checkpoint"
    )
    weed = Path(cache) / "seaweedfs" / match.group(1) / "weed"
    return weed if os.access(weed, os.X_OK) else None


def records(count: int, size: int) -> list[bytes]:
    """`count` JSON records of about `size` bytes each (a state with a string blob)."""
    blob = "x" * max(size - 80, 1)
    return [
        json.dumps(
            {"episode_id": {"rollout_id": f"o{i:06d}", "attempt": 0}, "state": {"blob": blob}},
            separators=(",", ":"),
        ).encode()
        for i in range(count)
    ]


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    cases: list[tuple[int, int]] = params.object_store_states
    repeats: int = params.object_store_repeats
    result = BenchResult(
        "object_store",
        "9. Object store (SeaweedFS): commit and restore vs raw put/get",
        "A part of N records of S bytes on `weed server -s3` (loopback) through the "
        "participant's object-store backend. Commit: serialize, hash, records PUT (multipart "
        "beyond 8 MB), manifest PUT If-None-Match. Restore: manifest GET, records streamed, "
        "hashed, parsed. Raw: one PUT / one GET of the same bytes with the same client. "
        "Conditional put: the manifest created If-None-Match vs a plain PUT.",
        params={"states": cases, "repeats": repeats},
    )
    weed = built_weed()
    if weed is None:
        result.skipped = "no SeaweedFS weed binary built here (scripts/seaweedfs builds it)"
        ctx.say(f"object_store: skipped: {result.skipped}")
        return result
    from tests.s3_server import SeaweedS3

    work = Path(tempfile.mkdtemp(prefix="object-store-", dir=ctx.workdir))
    server = SeaweedS3(weed, work)
    saved = {name: os.environ.get(name) for name in server.connection.environment()}
    try:
        ctx.say("object_store: starting SeaweedFS")
        await asyncio.to_thread(server.start)
        os.environ.update(server.connection.environment())
        await asyncio.to_thread(_measure, ctx, result, server, cases, repeats)
    finally:
        server.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return result


def _measure(
    ctx: Any, result: BenchResult, server: Any, cases: list[tuple[int, int]], repeats: int
) -> None:
    """Blocking, in a thread: obstore's sync API, as the participant's writer thread uses it."""
    bucket = server.connection.bucket
    storage = ObjectPartStorage()
    run_prefix = f"bench/{secrets.token_hex(4)}"
    client = client_for(ObjectLocation("s3", bucket, run_prefix))
    for count, size in cases:
        lines = records(count, size)
        body = b"".join(line + b"\n" for line in lines)
        ctx.say(f"object_store: {count} x {size} B ({len(body) / MB:.1f} MB), {repeats} repeats")
        # One unmeasured round of each first: connections, the volume's first growth.
        _commit(storage, bucket, run_prefix, f"warm-{count}x{size}", lines)
        client.put(f"{run_prefix}/raw-warm-{count}x{size}", body, size=len(body))
        commits: list[float] = []
        puts: list[float] = []
        restores: list[float] = []
        gets: list[float] = []
        parses: list[float] = []
        for repeat in range(repeats):
            name = f"c{count}x{size}-{repeat}"
            started = now()
            _commit(storage, bucket, run_prefix, name, lines)
            commits.append(now() - started)
            started = now()
            client.put(f"{run_prefix}/raw-{name}", body, size=len(body))
            puts.append(now() - started)
            started = now()
            _, kept = storage.read_part(
                f"s3://{bucket}/{run_prefix}/{name}", "resources", "bench", lambda r: True
            )
            restores.append(now() - started)
            if len(kept) != count:
                raise RuntimeError(f"restored {len(kept)} of {count}")
            started = now()
            stored = client.get(f"{run_prefix}/raw-{name}")
            gets.append(now() - started)
            if stored is None or len(stored.data) != len(body):
                raise RuntimeError("the raw get lost bytes")
            # The part of a restore no store can avoid: parsing every record it keeps.
            started = now()
            parsed = [json.loads(line) for line in stored.data.split(b"\n") if line]
            parses.append(gets[-1] + now() - started)
            del parsed
        case = f"{count} x {size / 1000:g} KB ({len(body) / MB:.1f} MB)"
        result.figure(f"{case}: commit", "write_part", "ms", map(ms, commits))
        result.figure(f"{case}: raw put", "one PUT", "ms", map(ms, puts))
        result.figure(f"{case}: restore", "read_part", "ms", map(ms, restores))
        result.figure(f"{case}: raw get", "one GET", "ms", map(ms, gets))
        result.ratio(f"{case}: commit / raw put", "commit", "raw put", ratios(commits, puts))
        result.figure(
            f"{case}: raw get + parse", "one GET, json.loads per line", "ms", map(ms, parses)
        )
        result.ratio(f"{case}: restore / raw get", "restore", "raw get", ratios(restores, gets))
        result.ratio(
            f"{case}: restore / raw get + parse",
            "restore",
            "raw get + parse",
            ratios(restores, parses),
        )
    # What a conditional put costs on its own: a small manifest, If-None-Match vs plain.
    manifest = b'{"schema_version": 1, "records_file": "records-x.jsonl"}\n' * 4
    creates: list[float] = []
    plain: list[float] = []
    for repeat in range(max(repeats * 10, 20)):
        started = now()
        if not client.create(f"{run_prefix}/cond/{repeat}/manifest.json", manifest):
            raise RuntimeError("a fresh key already existed")
        creates.append(now() - started)
        started = now()
        client.put(f"{run_prefix}/plain/{repeat}/manifest.json", manifest, size=len(manifest))
        plain.append(now() - started)
    result.figure("manifest: PUT If-None-Match", "conditional create", "ms", map(ms, creates))
    result.figure("manifest: plain PUT", "overwrite", "ms", map(ms, plain))
    result.ratio(
        "manifest: conditional / plain PUT", "If-None-Match", "plain", ratios(creates, plain)
    )


def _commit(
    storage: ObjectPartStorage, bucket: str, prefix: str, name: str, lines: list[bytes]
) -> None:
    storage.write_part(
        f"s3://{bucket}/{prefix}/{name}", "resources", "bench", name, iter(lines), WriteFence()
    )
