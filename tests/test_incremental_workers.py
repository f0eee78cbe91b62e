"""Incremental checkpoints of a server with several workers (`serve ... --workers N`).

Real processes, as tests/test_workers.py starts them: `serve
tests.incremental_counter:IncrementalCounter --workers 2` (the counter example declaring
`checkpoint_incremental`), every request on a fresh connection (so any worker accepts it and
the cookie routes it to the session's owner), real Prepare / Commit / Resume / Restore. The
properties:

* each worker's change clock decides what its sessions contribute: a part after the first
  stores the touched sessions and references the others, with synchronous and asynchronous
  commits;
* the end of a chain reads back as the full part of the same cut (the same records), and
  restores into one worker and into three the state a restore of that full part gives;
* a worker SIGKILLed between two checkpoints takes its sessions with it: the next part is
  full and holds exactly the sessions the server still holds, and the chain starts again.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.v1 import participant_service_pb2 as pb

from .test_workers import (
    COOKIE,
    PREPARED,
    Served,
    counted,
    deadline,
    owner_of,
    post,
    serve_workers,
    until,
)

__all__ = ["serve_workers"]  # the fixture, used by name

SERVER = "tests.incremental_counter:IncrementalCounter"
INSTANCE = "counter"
WORKERS = 2


def serve(start: Callable[..., Served], *args: str, workers: int = WORKERS) -> Served:
    return start(SERVER, "--instance", INSTANCE, *args, workers=workers)


@pytest.fixture(autouse=True)
def chains_bounded_by_length_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A counter's record is shorter than a reference line, so after two parts most bytes of
    the files a part references are no longer live and the stale share alone would make
    every third part full: these chains end only every `incremental_full_every` parts."""
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_INCREMENTAL_MAX_STALE_SHARE", "1")


def manifest_of(directory: Path) -> dict[str, Any]:
    path = directory / "participants" / "resources" / INSTANCE / "manifest.json"
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


async def resolved_records(directory: Path) -> list[dict[str, Any]]:
    """The part's records as a restore reads them (references resolved and verified)."""
    _, records = await asyncio.to_thread(
        LocalStorage().read_part, str(directory), "resources", INSTANCE, lambda r: True
    )
    return records


@dataclass
class Counters:
    """The sessions a test drives through one server, and the count each must hold."""

    served: Served
    cookies: dict[str, dict[str, str]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    taken: int = 0

    async def seed(self, rollout: str, count: int) -> None:
        reply = await post(
            self.served.base_url, f"/ng-rollout/{rollout}/seed_session", {"initial_count": count}
        )
        assert reply.status_code == 200, reply.text
        self.cookies[rollout] = {COOKIE: reply.cookies[COOKIE]}
        self.counts[rollout] = count

    async def increment(self, rollout: str) -> None:
        reply = await post(
            self.served.base_url,
            f"/ng-rollout/{rollout}/increment_counter",
            {"count": 1},
            self.cookies[rollout],
        )
        assert reply.status_code == 200, reply.text
        self.counts[rollout] += 1

    async def close(self, rollout: str) -> None:
        url = f"/ng-rollout/{rollout}/close_session"
        reply = await post(self.served.base_url, url, {}, self.cookies.pop(rollout))
        assert reply.status_code == 200, reply.text
        del self.counts[rollout]

    def owned_by(self, worker: int) -> list[str]:
        return [r for r, c in self.cookies.items() if owner_of(c[COOKIE], WORKERS) == worker]

    async def seed_on_both_workers(self, prefix: str, least: int) -> None:
        """Seed `prefix<i>` sessions (count i) until each worker owns at least `least` of
        the sessions held (a session's id, so its worker, is drawn at random)."""
        for i in itertools.count():
            if i >= 2 * least and min(len(self.owned_by(w)) for w in range(WORKERS)) >= least:
                return
            assert i < 60, f"60 seeds did not reach both workers {least} times"
            await self.seed(f"{prefix}{i}", i)

    async def checkpoint(
        self, directory: Path, *, asynchronous: bool, scoped: bool = False
    ) -> dict[str, Any]:
        """Prepare, Commit into `directory` (`scoped`: naming every session's episode),
        (await the part), Resume; its manifest."""
        self.taken += 1
        checkpoint_id = f"c{self.taken}"
        client = self.served.client
        final = await client.prepare_until_final(checkpoint_id, deadline())
        assert final.state == PREPARED, final
        scope = self.scope if scoped else None
        committed = await client.commit(
            checkpoint_id, deadline(), str(directory), scope, asynchronous=asynchronous
        )
        assert sorted(committed.exported) == sorted(self.counts)
        if asynchronous:
            part = await client.await_part(checkpoint_id, deadline())
            assert part.state == pb.PART_WRITE_STATE_DURABLE, part
        await client.resume(checkpoint_id, deadline())
        return manifest_of(directory)

    async def holds_the_counts(self, directory: Path) -> None:
        """The part holds exactly the sessions the server holds, with their counts."""
        records = await resolved_records(directory)
        held = {
            EpisodeId.from_json(r["episode_id"]).capture_key: r["state"]["count"] for r in records
        }
        assert held == self.counts
        assert len(records) == len(self.counts)

    @property
    def scope(self) -> list[EpisodeId]:
        return [EpisodeId.from_capture_key(key) for key in self.counts]


async def restored_counts(target: Served, counters: Counters, directory: Path, **how: Any) -> None:
    """Restore `directory` into `target`, resume, and read every session's counter through
    its old cookie as attempt 1: the counts the checkpoint holds."""
    client = target.client
    restore_id = f"restore-{directory.parent.name}-{directory.name}"
    restored = await client.restore(restore_id, deadline(), str(directory), counters.scope, **how)
    assert sorted(restored.restored) == sorted(f"{r}-a1" for r in counters.counts)
    await client.resume(restore_id, deadline())
    for rollout, count in counters.counts.items():
        url = f"/ng-rollout/{rollout}-a1/get_counter_value"
        reply = await post(target.base_url, url, {}, counters.cookies[rollout])
        assert reply.content == counted(count), (directory, rollout, reply.text)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_incremental_parts_of_workers_restore_as_the_full_part_of_the_same_cut(
    serve_workers: Callable[..., Served], tmp_path: Path, asynchronous: bool
) -> None:
    source, one, two, three = await asyncio.gather(
        asyncio.to_thread(serve, serve_workers),
        *(asyncio.to_thread(serve, serve_workers, "--start-closed", workers=n) for n in (1, 2, 3)),
    )
    counters = Counters(source)
    for i in range(10):
        await counters.seed(f"r{i}", i)
    await counters.seed_on_both_workers("x", 1)  # untouched: referenced by every part
    root = tmp_path / "chain"
    root.mkdir()
    first = await counters.checkpoint(root / "c1", asynchronous=asynchronous)
    assert "chain_length" not in first  # the first part is full
    rounds = [  # each round also increments r<number>; the records it stores again
        (lambda: counters.increment("r1"), 2, False),
        # A scoped Commit: each worker visits its covered sessions, and the next part's base
        # is not complete, so the one after it visits them too.
        (lambda: counters.close("r7"), 1, True),
        (lambda: counters.seed("r10", 100), 2, False),
    ]
    for number, (change, own, scoped) in enumerate(rounds, start=2):
        await counters.increment(f"r{number}")
        await change()
        manifest = await counters.checkpoint(
            root / f"c{number}", asynchronous=asynchronous, scoped=scoped
        )
        # Only what a worker's requests touched is stored again; the rest is referenced.
        assert manifest["chain_length"] == number, manifest
        assert manifest["own_records"] == own, manifest
        assert manifest["referenced_records"] == len(counters.counts) - own, manifest
        await counters.holds_the_counts(root / f"c{number}")
    end = root / f"c{len(rounds) + 1}"
    full = tmp_path / "elsewhere" / "full"  # not a sibling: a full part of the same cut
    full.parent.mkdir()
    assert "chain_length" not in await counters.checkpoint(full, asynchronous=asynchronous)
    assert await resolved_records(end) == await resolved_records(full)
    await source.client.close()

    # Each restore reads every session back through its old cookie, byte for byte.
    await restored_counts(two, counters, full)
    await restored_counts(one, counters, end)
    await restored_counts(three, counters, end)

    # The first part after the Restore is full; the next references it again.
    restored = Counters(
        three,
        {f"{r}-a1": cookies for r, cookies in counters.cookies.items()},
        {f"{r}-a1": count for r, count in counters.counts.items()},
    )
    after = tmp_path / "after"
    after.mkdir()
    assert "chain_length" not in await restored.checkpoint(after / "c1", asynchronous=asynchronous)
    await restored.increment("r0-a1")
    second = await restored.checkpoint(after / "c2", asynchronous=asynchronous)
    assert (second["chain_length"], second["own_records"]) == (2, 1), second
    await restored.holds_the_counts(after / "c2")
    for target in (one, two, three):
        await target.client.close()


async def test_a_worker_sigkilled_between_incremental_checkpoints_makes_the_next_part_full(
    serve_workers: Callable[..., Served], tmp_path: Path
) -> None:
    served, target = await asyncio.gather(
        asyncio.to_thread(serve, serve_workers),
        asyncio.to_thread(serve, serve_workers, "--start-closed", workers=1),
    )
    counters = Counters(served)
    await counters.seed_on_both_workers("k", 2)
    kept, lost = counters.owned_by(0), counters.owned_by(1)
    root = tmp_path / "chain"
    root.mkdir()
    await counters.checkpoint(root / "c1", asynchronous=True)
    await counters.increment(kept[0])
    await counters.increment(lost[0])
    assert (await counters.checkpoint(root / "c2", asynchronous=True))["chain_length"] == 2

    os.kill(served.announced["worker_pids"][1], signal.SIGKILL)
    for rollout in lost:  # gone with its worker
        del counters.counts[rollout]
        del counters.cookies[rollout]

    async def replaced() -> bool:
        counts = (await served.client.get_status()).readiness.counts
        return counts["workers"] == WORKERS and counts["sessions"] == len(kept)

    await until(replaced, "worker 1 restarted, without the sessions it held")
    third = await counters.checkpoint(root / "c3", asynchronous=True)
    assert "chain_length" not in third, third  # nothing of before the restart is referenced
    await counters.holds_the_counts(root / "c3")

    await counters.increment(kept[1])
    fourth = await counters.checkpoint(root / "c4", asynchronous=True)
    assert fourth["chain_length"] == 2 and fourth["own_records"] == 1, fourth
    await counters.holds_the_counts(root / "c4")
    await served.client.close()
    await restored_counts(target, counters, root / "c4")
    await target.client.close()


async def test_a_failed_full_commit_elsewhere_does_not_wedge_the_next_commits(
    serve_workers: Callable[..., Served], tmp_path: Path
) -> None:
    """A full export into another root (here one that cannot be written) replaces every
    worker's pending share: the latest published part is then no base the workers can
    serve. The next commits beside it must succeed (full, then chained again), not fail
    every export until a restart (`PoolChanges.usable`)."""
    served = await asyncio.to_thread(serve, serve_workers)
    counters = Counters(served)
    await counters.seed_on_both_workers("w", 1)
    root = tmp_path / "chain"
    root.mkdir()
    await counters.checkpoint(root / "c1", asynchronous=False)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    client = served.client
    assert (await client.prepare_until_final("c2", deadline())).state == PREPARED
    with pytest.raises(ControlError):
        await client.commit("c2", deadline(), str(blocker / "c2"), None)
    await client.resume("c2", deadline())
    counters.taken = 2
    await counters.increment(counters.owned_by(0)[0])
    third = await counters.checkpoint(root / "c3", asynchronous=False)
    assert third.get("chain_length") is None  # full: the workers hold no share of c1 now
    await counters.increment(counters.owned_by(1)[0])
    fourth = await counters.checkpoint(root / "c4", asynchronous=True)
    assert fourth["chain_length"] == 2 and fourth["own_records"] == 1
    await counters.holds_the_counts(root / "c4")
