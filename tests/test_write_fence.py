"""The fence between a part's writer thread and a Resume, and the litter stopped or killed
writers leave: called directly (blocking code) against tmp_path, with threads and barriers.

A Resume stopping a write must learn whether the writer will never publish (nothing to wait
for) or is already publishing (a manifest link cannot be withdrawn: wait for it). Both sides
must agree on which, whatever the interleaving.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rollout_checkpoint.server.storage import (
    MANIFEST_NAME,
    LocalStorage,
    PublishedPart,
    StopRequested,
    WriteFence,
)

from .test_storage import part_of, read, sample_lines, write

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
