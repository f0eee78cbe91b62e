"""Certify's journal (`client/certify/journal.py`): what an interrupted run resumes from.

A resumed run judges its journaled trials by the same checks as an uninterrupted one, so what
the journal reads back must be the very observation it was given: a pair read back as a list
(JSON has no tuples) is not found among the pairs a check looks for, and a resumed run would
report a violation the uninterrupted one never saw. A file the journal did not write is a
typed error, never a run resumed from facts nobody decided. (The whole interrupt-and-resume
path, on real fleets, is in `tests/test_certify.py`.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollout_checkpoint.client.certify.findings import Check, ServerFacts, Violation
from rollout_checkpoint.client.certify.journal import (
    Journal,
    Prepared,
    RanTrial,
    ResumeRefused,
    RunIdentity,
)
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.plan import plan_trials
from rollout_checkpoint.client.collect.errors import CorruptFile

MEMBERS = ["environment", "policy_model", "agent", "counter"]
IDENTITY = RunIdentity(
    "f" * 64, "t" * 64, seed=3, trials=4, concurrency=4, num_repeats=1, entry_url=None
)


def observation(label: str) -> RunObservation:
    """An observation with every field away from its default."""
    return RunObservation(
        label=label,
        expected=["task-0", "task-1"],
        tasks={"task-0": {"resources_server": "counter", "n": 1.0}},
        rows=[{"rollout_id": "task-0", "status": "ok", "attempt": 1, "reward": 1}],
        exports={"counter": {"task-0": {"count": 2, "history": [1, True, None]}}},
        published=["ckpt-1", "ckpt-2"],
        restore_failures={"ckpt-2": "does not read back"},
        reopen_seconds=1.25,
        reopen_deadline=76.0,
        untyped=["agent: Traceback"],
        model_misses=[("task-1", "$.messages[2]")],
        restarted={"task-1": "attempt 1 sent from its input"},
        sent_before_kill={"counter": [("task-0", 0), ("task-1", 0)]},
        held_after={"environment": 2},
        controller_exit=0,
        notes=["collect: recovered"],
    )


def test_a_journaled_trial_reads_back_as_it_was_recorded(tmp_path: Path) -> None:
    journal = Journal.begin(tmp_path, IDENTITY, resume=False)
    plans = plan_trials(IDENTITY.seed, IDENTITY.trials, MEMBERS)
    trial = RanTrial(plans[1], observation("trial 2"), True, "SIGKILLed counter", 9.5)
    journal.record_trial(trial)
    trial.restore_checked, trial.seconds = True, 11.0
    journal.record_trial(trial)  # its restore check recorded: the same file, replaced whole
    (back,) = journal.trials(plans)
    assert back == trial
    assert back.observation.sent_before_kill["counter"][0] == ("task-0", 0)
    assert journal.kept(IDENTITY.trials) == (1, 1)
    assert sorted(p.name for p in journal.directory.iterdir()) == ["run.json", "trial-2.json"]


def test_the_journaled_baseline_reads_back_as_it_was_recorded(tmp_path: Path) -> None:
    journal = Journal.begin(tmp_path, IDENTITY, resume=False)
    assert journal.prepared() is None
    prepared = Prepared(
        facts=[ServerFacts("agent", "agent"), ServerFacts("counter", "resources", "exported")],
        entry_url="http://127.0.0.1:1",
        baseline=observation("baseline"),
        findings=[Violation(Check.DETERMINISTIC, "differs", "counter", "task-0", 2, "$.count")],
        unreproduced={("counter", "task-0")},
        recording_sha256="r" * 64,
        seconds=31.5,
    )
    journal.record_prepared(prepared)
    assert Journal.begin(tmp_path, IDENTITY, resume=True).prepared() == prepared


def test_a_new_run_over_an_unfinished_one_is_refused_once_its_baseline_is_decided(
    tmp_path: Path,
) -> None:
    journal = Journal.begin(tmp_path, IDENTITY, resume=False)
    Journal.begin(tmp_path, IDENTITY, resume=False)  # nothing decided yet: it may start over
    prepared = Prepared([], "http://127.0.0.1:1", observation("baseline"), [], set(), "r", 1.0)
    journal.record_prepared(prepared)
    with pytest.raises(ResumeRefused, match="0 of 4 trials decided"):
        Journal.begin(tmp_path, IDENTITY, resume=False)
    other = dataclasses.replace(IDENTITY, num_repeats=2)
    with pytest.raises(ResumeRefused, match="--num-repeats 1 there, 2 here"):
        Journal.begin(tmp_path, other, resume=True)


@pytest.mark.parametrize(
    "text",
    [
        '{"format": "something-else/1"}',
        "{not json",
        '{"format": "rollout-checkpoint-certify-journal/1"}',
    ],
)
def test_a_journal_file_it_did_not_write_is_a_typed_error(tmp_path: Path, text: str) -> None:
    journal = Journal.begin(tmp_path, IDENTITY, resume=False)
    plans = plan_trials(IDENTITY.seed, IDENTITY.trials, MEMBERS)
    (journal.directory / "trial-1.json").write_text(text)
    with pytest.raises(CorruptFile, match=r"trial-1\.json"):
        journal.trials(plans)
