"""What an incremental export reads from the change log, and the chained part versions it reads.

The pause of an incremental Commit names only the sessions touched since its base's cut (the
change log, `server/resources/change_log.py`) and keeps the base's other records without
naming them (`ChangeSet.kept`). Everything that can change what a part must hold without a
request on the session has to reach the log, or the part would reference a session gone or
leave out one its base did not hold: a close and a new seed of the same cookie, a seed during
a checkpoint (left out of that part, exported once admission reopens), a retired rollout, a
change the server reports itself, a scoped part (it holds only its scope's records). The property: with any history of those, every incremental
part reads back as the full part of the same cut, byte for byte, and the export did take the
log's path whenever its base was complete (it never fell back to visiting every session).

Chained parts are written as manifest version 3 (reference lines without the episode); a
version 2 part (last release's) still restores, and a reader of either version refuses the
other's reference lines.
"""

from __future__ import annotations

import asyncio
import json
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.resources.change_log import SLACK, ChangeLog
from rollout_checkpoint.server.resources.session_table import TrackedSession
from rollout_checkpoint.server.runtime.participant import ChangeSet, ExportBase

from .test_incremental import Fleet, IncrementalCounter, manifest_of, read_records
from .test_resources import Running, prepared, running


class ExportSpy:
    """Records what each incremental export of the participant returned."""

    def __init__(self, r: Running) -> None:
        self.changes: list[tuple[ChangeSet, ExportBase | None]] = []
        participant = r.participant
        export_changes = participant.export_changes

        async def spied(scope: Any, base: ExportBase | None) -> ChangeSet:
            changes = await export_changes(scope, base)
            self.changes.append((changes, base))
            return changes

        participant.export_changes = spied  # type: ignore[method-assign]

    def last(self) -> tuple[ChangeSet, ExportBase | None]:
        return self.changes[-1]


Step = tuple[str, int]
LIVE_ROLLOUTS = 3
"""Rollouts 0-2 are never retired (a retire takes 5, 4, then 3): later seeds go there."""

steps = st.lists(
    st.tuples(
        st.sampled_from(
            ["increment", "seed", "close", "reseed", "changed", "retire", "closed", "scoped"]
        ),
        st.integers(0, 11),
    ),
    min_size=1,
    max_size=6,
)


async def _seed(fleet: Fleet, prefix: str) -> None:
    browser = fleet.r.browser()
    seeded = await browser.post(f"{prefix}/seed_session", json={"initial_count": 3})
    assert seeded.status_code == 200
    fleet.browsers.append((browser, prefix))


async def _apply(fleet: Fleet, step: Step, spare: list[int]) -> None:
    """One change between two checkpoints (see the module docstring)."""
    r = fleet.r
    what, index = step
    index %= len(fleet.browsers)
    browser, prefix = fleet.browsers[index]
    if what == "increment":
        await browser.post(f"{prefix}/increment_counter", json={"count": 1})
    elif what == "seed":
        await _seed(fleet, f"/ng-rollout/r{index % LIVE_ROLLOUTS}-a1")
    elif what == "close":
        await browser.post(f"{prefix}/close_session", json={})
    elif what == "reseed":
        # The same cookie seeded again after its close, under another rollout: a new
        # session object under the same id.
        await browser.post(f"{prefix}/close_session", json={})
        other = f"/ng-rollout/r{(index + 1) % LIVE_ROLLOUTS}-a1"
        await browser.post(f"{other}/seed_session", json={"initial_count": 7})
        fleet.browsers[index] = (browser, other)
    elif what == "changed":
        held = sorted(r.participant.sessions)
        if held:
            session_id = held[index % len(held)]
            r.server.counters[session_id] += 5  # outside any request
            r.server.checkpoint_session_changed(session_id)
    elif what == "retire":
        rollout = spare.pop() if spare else None
        if rollout is not None:
            await r.client.retire(f"retire-{rollout}", r.deadline(), [EpisodeId(f"r{rollout}", 1)])
    elif what == "closed":
        # Seeded while a checkpoint is open: that part leaves it out, the next holds it.
        fleet.taken += 1
        checkpoint_id = f"c{fleet.taken}"
        await prepared(r, checkpoint_id)
        await _seed(fleet, "/ng-rollout/r0-a1")
        await r.client.commit(checkpoint_id, r.deadline(), str(fleet.root / checkpoint_id))
        await r.client.resume(checkpoint_id, r.deadline())
    elif what == "scoped":
        # A part of some episodes only: it holds no record of the others, so the next export
        # must not take it for a complete base (it visits every session instead).
        fleet.taken += 1
        checkpoint_id = f"c{fleet.taken}"
        await prepared(r, checkpoint_id)
        scope = [EpisodeId(f"r{index % 6}", 1)]
        directory = str(fleet.root / checkpoint_id)
        await r.client.commit(checkpoint_id, r.deadline(), directory, scope)
        await r.client.resume(checkpoint_id, r.deadline())


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(history=st.lists(steps, min_size=1, max_size=4))
def test_an_export_from_the_change_log_reads_as_the_full_part_of_its_cut(
    tmp_path_factory: pytest.TempPathFactory, history: list[list[Step]]
) -> None:
    asyncio.run(_logged_history(tmp_path_factory.mktemp("root"), history))


async def _logged_history(root: Path, history: list[list[Step]]) -> None:
    async with running(
        IncrementalCounter, incremental_full_every=64, incremental_max_stale_share=1.0
    ) as r:
        fleet = Fleet(r, root)
        spy = ExportSpy(r)
        spare = [5, 4, 3]
        await fleet.seed(12)
        await fleet.checkpoint()
        for changes in history:
            for step in changes:
                await _apply(fleet, step, spare)
            incremental = await fleet.checkpoint()
            keys = fleet.exported
            exported, base = spy.last()
            assert base is not None
            # From the log after a complete base; after a scoped one, by visiting every session.
            assert (exported.kept is not None) == base.complete, "the export visited all"
            full = await fleet.checkpoint(full=True)
            assert read_records(incremental)[1] == read_records(full)[1]
            assert keys == fleet.exported, "the Commit reply's exported keys"


async def test_the_pause_names_only_the_touched_sessions(tmp_path: Path) -> None:
    """Before the change log, an incremental export named every session it held (an
    `UnchangedRecord` each), inside the pause; now it names the touched one."""
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        spy = ExportSpy(r)
        await fleet.seed(8)
        await fleet.checkpoint()
        await fleet.increment(5)
        part = await fleet.checkpoint()
        exported, _ = spy.last()
        assert len(exported.items) == 1
        assert exported.kept is not None and exported.kept.count == 7
        assert (manifest_of(part)["own_records"], manifest_of(part)["referenced_records"]) == (
            1,
            7,
        )


async def _chained_part(tmp_path: Path) -> Path:
    async with running(IncrementalCounter) as r:
        fleet = Fleet(r, tmp_path)
        await fleet.seed(3)
        await fleet.checkpoint()
        await fleet.increment(1)
        return await fleet.checkpoint()


def _rewrite(part_dir: Path, version: int, lines: list[bytes]) -> None:
    """The part's records replaced by `lines` and its manifest restated as `version`."""
    part = Path(layout.part_path(str(part_dir), "resources", "counter"))
    manifest = json.loads((part / "manifest.json").read_text())
    (part / manifest["records_file"]).unlink()
    data = b"".join(line + b"\n" for line in lines)
    digest = sha256(data).hexdigest()
    (part / layout.records_name(digest)).write_bytes(data)
    manifest.update(
        schema_version=version,
        records_file=layout.records_name(digest),
        records_sha256=digest,
        bytes=len(data),
    )
    (part / "manifest.json").write_text(json.dumps(manifest))


def _lines(part_dir: Path) -> list[bytes]:
    part = Path(layout.part_path(str(part_dir), "resources", "counter"))
    manifest = json.loads((part / "manifest.json").read_text())
    return (part / manifest["records_file"]).read_bytes().splitlines()


def _with_episodes(lines: list[bytes], records: list[dict[str, Any]]) -> list[bytes]:
    """Version 2's lines: each reference line names the episode of the record it stands for."""
    rewritten = []
    for line, record in zip(lines, records, strict=True):
        parsed = json.loads(line)
        if layout.REFERENCE_FIELD in parsed:
            parsed = {"episode_id": record["episode_id"], **parsed}
            line = json.dumps(parsed, separators=(",", ":")).encode()
        rewritten.append(line)
    return rewritten


async def test_a_version_2_part_still_restores(tmp_path: Path) -> None:
    chained = await _chained_part(tmp_path)
    manifest, records = read_records(chained)
    assert manifest.schema_version == layout.COMPACT_CHAIN_SCHEMA_VERSION
    assert not any(b'"episode_id"' in line for line in _lines(chained) if b'"$ref"' in line)
    _rewrite(chained, layout.CHAIN_SCHEMA_VERSION, _with_episodes(_lines(chained), records))
    manifest, again = read_records(chained)
    assert manifest.schema_version == layout.CHAIN_SCHEMA_VERSION
    assert again == records


@pytest.mark.parametrize("version", [2, 3])
async def test_a_reference_line_of_the_other_version_is_refused(
    tmp_path: Path, version: int
) -> None:
    chained = await _chained_part(tmp_path)
    _, records = read_records(chained)
    lines = _lines(chained)
    # Version 2's lines under a version 3 manifest, or version 3's under a version 2 one.
    foreign = _with_episodes(lines, records) if version == 3 else lines
    _rewrite(chained, version, foreign)
    with pytest.raises(CheckpointError) as refused:
        read_records(chained)
    assert refused.value.reason.value == "INVALID_CHECKPOINT_STATE"
    assert "a reference line holds exactly" in str(refused.value)


def test_the_change_log_stays_bounded_and_never_answers_below_what_it_forgot() -> None:
    """A server that never exports incrementally touches sessions forever: the log is cleared
    once it outgrows the sessions held, and a cut it no longer reaches back to gets no answer
    (the export then visits every session) rather than a partial one."""
    log = ChangeLog()
    episode = EpisodeId("r", 1)
    for clock in range(1, 3 * SLACK):
        log.note(TrackedSession(f"s{clock}", episode), clock, tracked=10)
        assert len(log) <= 2 * 10 + SLACK
    assert log.horizon > 0
    assert log.since(log.horizon - 1) is None
    last = 3 * SLACK - 1
    assert [s.session_id for s in log.since(last - 2) or []] == [f"s{last}", f"s{last - 1}"]
    log.forget_until(last - 1)
    assert log.since(last - 2) is None
    assert [s.session_id for s in log.since(last - 1) or []] == [f"s{last}"]
