"""What a page of a long checkpoint history costs through the coordinator (issue 32).

    python -m benchmarks.history_api --entries 10000 --calls 200

Writes a history of `--entries` attempts (one in ten failed, naming a member, one in twenty a
restore; each with its stages, about 600 bytes as a 1,000-member fleet's are) into a fresh
local root, starts a coordinator of that root in this process (gRPC and HTTP on 127.0.0.1:0),
and times, from a client in the same process over the loopback:

* `first`: the first ListCheckpoints (50 entries), which reads and parses the whole index;
* `page`: ListCheckpoints of the first page (50), then a page 20 pages deep (by its token),
  then the failed ones (a filter), each `--calls` times: the index is unchanged, so each is
  served from the parsed index (`HistoryView`'s cache);
* `rest`: `GET /checkpoints` (50), the same through the HTTP port as JSON;
* `after_append`: the first page after a checkpoint appended one attempt (`--appends` times):
  the index changed, and only its new line is decoded;
* `uncached`: the parse the cache saves, a fresh `HistoryView` read of the index.

Prints one JSON line: per measurement its median, p90 and max in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from grpc import aio

from rollout_checkpoint.client.checkpointing.publication.history import (
    INDEX_NAME,
    HistoryEntry,
    StageTiming,
    encode_index,
    open_history,
)
from rollout_checkpoint.client.checkpointing.publication.history_view import HistoryView
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .common import percentile

TOKEN = "t" * 32
AUTH = (("authorization", f"Bearer {TOKEN}"),)
STAGES = ("prepare", "commit", "publish", "resume", "retention")


def attempt(number: int) -> HistoryEntry:
    """The `number`th attempt of a 1,000-member fleet."""
    failed = number % 10 == 9
    restore = number % 20 == 0
    started = f"2026-01-01T{number // 3600 % 24:02d}:{number // 60 % 60:02d}:{number % 60:02d}"
    return HistoryEntry(
        id=f"ckpt-{number:06d}" if not restore else f"restore-{number:06d}",
        operation="restore" if restore else "checkpoint",
        trigger="periodic",
        mode="fresh" if restore else "sync",
        status="failed" if failed else "completed",
        started_at=f"{started}.000000Z",
        ended_at=f"{started}.900000Z",
        duration_seconds=0.9,
        reason="PARTICIPANT_FAILED" if failed else "",
        message="resources-0417: disk on fire" if failed else "",
        failed_members=("resources-0417",) if failed else (),
        stages=tuple(StageTiming(stage, 0.18) for stage in STAGES),
        members=1000,
        records=64_000,
        bytes=256 << 20,
        continued=64_000,
    )


def write_history(root: Path, entries: int) -> int:
    """The index of `entries` attempts, written at once (appending them one by one would
    rewrite it `entries` times); its size in bytes."""
    lines = [
        json.dumps(attempt(n).to_json(), sort_keys=True, separators=(",", ":")).encode()
        for n in range(entries)
    ]
    index = encode_index(lines)
    (root / INDEX_NAME).write_bytes(index)
    return len(index)


async def timed(calls: int, call: Callable[[], Awaitable[Any]]) -> dict[str, float]:
    spent = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        spent.append((time.perf_counter() - started) * 1000)
    return {
        "median_ms": round(percentile(spent, 50), 3),
        "p90_ms": round(percentile(spent, 90), 3),
        "max_ms": round(max(spent), 3),
    }


async def run(entries: int, calls: int, appends: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="history-api-") as directory:
        root = Path(directory)
        size = write_history(root, entries)
        spec = FleetSpec(
            members=(MemberSpec("unused", "127.0.0.1:9"),), token=TOKEN, checkpoint_root=str(root)
        )
        coordinator = Coordinator(spec, "127.0.0.1:0", http_address="127.0.0.1:0")
        await coordinator.start()
        assert coordinator.http_listener is not None
        http_base = f"http://{coordinator.http_listener.bound_address}"
        try:
            async with (
                aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel,
                httpx.AsyncClient(base_url=http_base, headers=dict(AUTH)) as http,
            ):
                stub = cpb_grpc.CoordinatorServiceStub(channel)

                async def page(**fields: Any) -> cpb.ListCheckpointsResponse:
                    reply: cpb.ListCheckpointsResponse = await stub.ListCheckpoints(
                        cpb.ListCheckpointsRequest(**fields), metadata=AUTH, timeout=60
                    )
                    return reply

                results: dict[str, Any] = {"entries": entries, "index_bytes": size}
                results["first"] = await timed(1, page)
                token = ""
                for _ in range(20):
                    token = (await page(page_token=token)).next_page_token
                results["page"] = await timed(calls, page)
                results["page_20_deep"] = await timed(calls, lambda: page(page_token=token))
                results["failed_only"] = await timed(
                    calls, lambda: page(status=cpb.ATTEMPT_STATUS_FAILED)
                )
                results["rest"] = await timed(calls, lambda: http.get("/checkpoints"))
                history = open_history(root)
                spent = []
                for number in range(entries, entries + appends):
                    await asyncio.to_thread(history.append, attempt(number), ())
                    spent.append(await timed(1, page))
                results["after_append"] = {
                    name: round(percentile([s[name] for s in spent], q), 3)
                    for name, q in (("median_ms", 50), ("p90_ms", 90), ("max_ms", 100))
                }
                results["uncached"] = await timed(
                    max(1, calls // 20), lambda: asyncio.to_thread(HistoryView(root).snapshot)
                )
                return results
        finally:
            await coordinator.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.history_api")
    parser.add_argument("--entries", type=int, default=10_000, help="attempts in the history")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per measurement")
    parser.add_argument("--appends", type=int, default=20, help="timed pages after an append")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args.entries, args.calls, args.appends))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
