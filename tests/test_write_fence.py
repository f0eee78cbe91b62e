"""The fence between a part's writer thread and a Resume, and the litter stopped or killed
writers leave: called directly (blocking code) against tmp_path, with threads and barriers.

A Resume stopping a write must learn whether the writer will never publish (nothing to wait
for) or is already publishing (a manifest link cannot be withdrawn: wait for it). Both sides
must agree on which, whatever the interleaving.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest

from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.server.core.layout import MANIFEST_NAME
from rollout_checkpoint.server.core.part_storage import (
    LocalStorage,
    PublishedPart,
    StopRequested,
    WriteFence,
)

from .test_storage import part_of, read, refused, sample_lines, within, write

# -- the fence alone -------------------------------------------------------------------------


def test_a_fence_stopped_before_publishing_refuses_publication() -> None:
    fence = WriteFence()
    assert not fence.stopped and not fence.publishing
    fence.check()

    assert fence.stop() is False

    assert fence.stopped and not fence.publishing
    with pytest.raises(StopRequested):
        fence.check()
    with pytest.raises(StopRequested):
        fence.begin_publish()
    assert not fence.publishing
    assert fence.stop() is False  # asked again, the same answer


def test_a_fence_stopped_while_publishing_says_so() -> None:
    fence = WriteFence()
    fence.begin_publish()
    assert fence.publishing and not fence.stopped

    assert fence.stop() is True

    assert fence.stopped and fence.publishing
    assert fence.stop() is True


# -- the fence in a write --------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def test_a_stop_once_the_link_is_under_way_is_told_to_wait_and_the_part_publishes(
    ckpt: Path,
) -> None:
    """The Resume of the old code set its flag right after the writer's last check and could
    not know that a publication followed; now stop() answers True and the part is complete."""
    fence = WriteFence()
    answers: list[bool] = []

    def hook(step: str) -> None:
        if step == "before_manifest_link":
            answers.append(fence.stop())

    published = write(ckpt, sample_lines(), fence=fence, storage=LocalStorage(crash_hook=hook))

    assert answers == [True]
    assert read(ckpt)[0] == published.manifest


def test_a_stop_before_the_link_is_told_nothing_will_publish(ckpt: Path) -> None:
    fence = WriteFence()
    answers: list[bool] = []

    def hook(step: str) -> None:
        if step == "after_rename":
            answers.append(fence.stop())

    with pytest.raises(StopRequested):
        write(ckpt, sample_lines(), fence=fence, storage=LocalStorage(crash_hook=hook))

    assert answers == [False]
    assert not (part_of(ckpt) / MANIFEST_NAME).exists()


def race_stop(ckpt: Path, step: str) -> tuple[bool, PublishedPart | BaseException]:
    """Writer and Resume meet at a barrier at `step`, then the Resume stops the fence while
    the writer goes on: (stop()'s answer, the writer's outcome)."""
    fence = WriteFence()
    barrier = threading.Barrier(2, timeout=10)
    outcome: list[PublishedPart | BaseException] = []

    def hook(name: str) -> None:
        if name == step:
            barrier.wait()

    def writer() -> None:
        try:
            outcome.append(write(ckpt, sample_lines(), fence=fence, storage=LocalStorage(hook)))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    barrier.wait()
    answer = fence.stop()
    thread.join(10)
    assert not thread.is_alive()
    return answer, outcome[0]


def test_a_stop_racing_the_writer_agrees_with_what_happened(tmp_path: Path) -> None:
    """Released together right before the writer's begin_publish, the stop and the writer go
    in whichever order the scheduler picks; every time stop() answers True exactly when the
    part published (and False exactly when the writer raised StopRequested)."""
    for attempt in range(100):
        ckpt = tmp_path / f"ckpt-{attempt}"
        answer, outcome = race_stop(ckpt, "before_publish")
        published = (part_of(ckpt) / MANIFEST_NAME).exists()
        assert answer == published, (attempt, answer, outcome)
        assert isinstance(outcome, PublishedPart if published else StopRequested), outcome


# -- litter: stopped, failed and killed writers ----------------------------------------------

STALE_RECORDS_TMP = ".records-0123456789abcdef.tmp"
STALE_MANIFEST_TMP = ".manifest-fedcba9876543210.tmp"
STALE_RECORDS = f"records-{'ab' * 32}.jsonl"


def test_a_write_stopped_after_the_rename_leaves_no_records_file(ckpt: Path) -> None:
    fence = WriteFence()

    def hook(step: str) -> None:
        if step == "after_rename":
            assert fence.stop() is False

    with pytest.raises(StopRequested):
        write(ckpt, sample_lines(), fence=fence, storage=LocalStorage(crash_hook=hook))

    assert os.listdir(part_of(ckpt)) == []


def test_a_stale_temporary_and_an_unnamed_records_file_are_swept_by_the_next_write(
    ckpt: Path,
) -> None:
    """What a SIGKILLed writer leaves (no process holds a lock on it any more)."""
    part = part_of(ckpt)
    part.mkdir(parents=True)
    for name in (STALE_RECORDS_TMP, STALE_MANIFEST_TMP, STALE_RECORDS):
        (part / name).write_bytes(b"left by a dead writer\n")

    published = write(ckpt, sample_lines())

    assert sorted(os.listdir(part)) == [MANIFEST_NAME, published.manifest.records_file]


def test_a_retry_into_a_published_part_sweeps_only_what_the_manifest_does_not_name(
    ckpt: Path,
) -> None:
    published = write(ckpt, sample_lines())
    part = part_of(ckpt)
    manifest_before = (part / MANIFEST_NAME).read_bytes()
    for name in (STALE_RECORDS_TMP, STALE_RECORDS):
        (part / name).write_bytes(b"left by a dead writer\n")

    assert write(ckpt, sample_lines()) == published  # the idempotent retry

    assert sorted(os.listdir(part)) == [MANIFEST_NAME, published.manifest.records_file]
    assert (part / MANIFEST_NAME).read_bytes() == manifest_before
    assert read(ckpt)[0] == published.manifest


def test_a_temporary_whose_writer_holds_its_lock_is_not_swept(ckpt: Path) -> None:
    part = part_of(ckpt)
    part.mkdir(parents=True)
    live = part / STALE_RECORDS_TMP
    live.write_bytes(b"a live writer's records so far\n")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the writer does for its temporary's lifetime

        published = write(ckpt, sample_lines())

        assert sorted(os.listdir(part)) == sorted(
            [MANIFEST_NAME, published.manifest.records_file, STALE_RECORDS_TMP]
        )
    finally:
        os.close(fd)  # the writer dies: its temporary is now litter
    write(ckpt, sample_lines())
    assert STALE_RECORDS_TMP not in os.listdir(part)


def test_a_live_writer_keeps_its_temporary_while_another_writer_of_the_part_runs(
    ckpt: Path,
) -> None:
    """A second writer of the same part (a retry from a restarted process) sweeps at its
    start; the first, still writing records, must find its temporary when it renames it."""
    reached, release = threading.Event(), threading.Event()

    def hook(step: str) -> None:
        if step == "after_record" and not release.is_set():
            reached.set()
            assert release.wait(10)

    first: list[PublishedPart | BaseException] = []

    def slow_writer() -> None:
        try:
            first.append(write(ckpt, sample_lines(), storage=LocalStorage(crash_hook=hook)))
        except BaseException as exc:
            first.append(exc)

    thread = threading.Thread(target=slow_writer)
    thread.start()
    try:
        assert reached.wait(10)
        second = write(ckpt, sample_lines())
    finally:
        release.set()
        thread.join(10)
    assert not thread.is_alive()
    assert first == [second]  # identical content: the slow writer's retry is idempotent
    assert sorted(os.listdir(part_of(ckpt))) == [MANIFEST_NAME, second.manifest.records_file]


class ProbedFence(WriteFence):
    """A fence that reports its writer finding the part locked: once armed, a check() can only
    come from the wait for the part lock (the records are all written by then)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.blocked = threading.Event()

    def check(self) -> None:
        if self.armed:
            self.blocked.set()
        super().check()


def test_of_two_identical_writers_the_stopped_one_never_removes_the_others_records(
    ckpt: Path,
) -> None:
    """Same content, same records name. Writer A has renamed its records into place and is
    then stopped, while writer B, records ready, is trying to publish the same name. Without
    the part lock B could rename and link between A's rename and A's cleanup, and A would
    delete the file B's manifest names. With it, B is held at the lock until A has cleaned
    up, and then renames its own file and publishes."""
    fence_a, fence_b = WriteFence(), ProbedFence()
    b_ready, a_in_critical_section = threading.Event(), threading.Event()

    def hook_b(step: str) -> None:
        if step == "before_part_lock":
            b_ready.set()
            assert a_in_critical_section.wait(10)
            fence_b.armed = True

    def hook_a(step: str) -> None:
        if step == "after_rename":
            a_in_critical_section.set()
            assert fence_b.blocked.wait(10), "writer B never found the part locked"
            assert fence_a.stop() is False

    outcome_b: list[PublishedPart | BaseException] = []

    def writer_b() -> None:
        try:
            outcome_b.append(
                write(ckpt, sample_lines(), fence=fence_b, storage=LocalStorage(hook_b))
            )
        except BaseException as exc:
            outcome_b.append(exc)

    thread = threading.Thread(target=writer_b)
    thread.start()
    try:
        assert b_ready.wait(10)
        with pytest.raises(StopRequested):
            write(ckpt, sample_lines(), fence=fence_a, storage=LocalStorage(hook_a))
    finally:
        a_in_critical_section.set()
        thread.join(10)
    assert not thread.is_alive()
    (published,) = outcome_b
    assert isinstance(published, PublishedPart), published
    assert sorted(os.listdir(part_of(ckpt))) == [MANIFEST_NAME, published.manifest.records_file]
    assert read(ckpt)[0] == published.manifest


def test_a_writer_stopped_after_another_published_the_same_records_keeps_them(
    ckpt: Path,
) -> None:
    published = write(ckpt, sample_lines())
    fence = WriteFence()

    def hook(step: str) -> None:
        if step == "after_rename":
            assert fence.stop() is False

    with pytest.raises(StopRequested):
        write(ckpt, sample_lines(), fence=fence, storage=LocalStorage(crash_hook=hook))

    assert sorted(os.listdir(part_of(ckpt))) == [MANIFEST_NAME, published.manifest.records_file]
    assert read(ckpt)[0] == published.manifest


# -- a part directory locked by someone else -------------------------------------------------


def test_a_part_directory_locked_forever_is_a_bounded_storage_failure(ckpt: Path) -> None:
    part = part_of(ckpt)
    part.mkdir(parents=True)
    holder = os.open(part, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # a hostile (or wedged) process of the same user

        error = refused(
            lambda: within(
                lambda: write(ckpt, sample_lines(), storage=LocalStorage(lock_timeout=0.2))
            ),
            Reason.STORAGE_FAILED,
            "UNAVAILABLE",
        )
    finally:
        os.close(holder)

    assert "locked" in error.message
    assert os.listdir(part) == []


def test_a_stop_ends_a_wait_for_the_part_lock(ckpt: Path) -> None:
    part = part_of(ckpt)
    part.mkdir(parents=True)
    fence = WriteFence()
    waiting = threading.Event()

    def hook(step: str) -> None:
        if step == "before_sweep":
            waiting.set()

    outcome: list[BaseException | PublishedPart] = []

    def writer() -> None:
        try:
            outcome.append(write(ckpt, sample_lines(), fence=fence, storage=LocalStorage(hook)))
        except BaseException as exc:
            outcome.append(exc)

    holder = os.open(part, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        thread = threading.Thread(target=writer)
        thread.start()
        assert waiting.wait(10)
        assert fence.stop() is False
        thread.join(10)
        assert not thread.is_alive()
    finally:
        os.close(holder)
    assert isinstance(outcome[0], StopRequested), outcome
    assert os.listdir(part) == []
