"""What a certification decided, kept durably in its report directory, so that an interrupted
run resumes (`--resume`) instead of starting over.

A thousand trials take hours; one Ctrl-C, a closed laptop lid or a reboot must not cost them.
The journal (`DIR/journal/`) holds one file per fact, each written whole (a temporary file,
fsynced, renamed over the old one, the folder fsynced: a crash at any instant leaves the old
file or the new, never half of one):

* `run.json`: what the run is (`RunIdentity`: the digests of the fleet file and the tasks, the
  seed, the trials and every flag that changes a trial), written before anything starts. A
  resume with other flags, another fleet or other tasks would mix two runs' trials under one
  verdict, so it is refused before anything is touched (`ResumeRefused`).
* `baseline.json`: what every trial is judged against (the members' kinds, the entry point,
  the baseline's observation, the findings of its second pass and of the stateless probe, the
  digest of the model recording the trials replay). Written once the baseline is complete; a
  resume skips the baseline, the probe and the discovery.
* `trial-N.json`: trial N's observation, written as soon as it ran, then again once its
  restore check is recorded. Only then is the trial decided: the restore check runs later,
  into the bench, from the trial's checkpoint root (kept until then), so a trial that ran but
  was never restored has its restore check run on resume, not its whole run.

The plan of every trial comes from the seed (`plan.plan_trial`), so nothing of it is stored:
a resumed run draws the very trials the interrupted one drew. The verdicts are drawn from the
stored observations by the same checks as in an uninterrupted run, so the combined report is
the one an uninterrupted run writes. Everything here blocks (file I/O, hashing, JSON): the
engine calls it through `asyncio.to_thread`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from rollout_checkpoint.client.certify.findings import Check, ServerFacts, TrialPlan, Violation
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.checkpointing.publication.files import replace_atomically
from rollout_checkpoint.client.collect.errors import CorruptFile, UsageError

JOURNAL = "journal"
"""The journal's folder in the report directory."""
FORMAT = "rollout-checkpoint-certify-journal/1"
RUN_NAME = "run.json"
BASELINE_NAME = "baseline.json"
DIGEST_CHUNK = 1 << 20
T = TypeVar("T")


class ResumeRefused(UsageError):
    """A `--resume` (or a run that would overwrite an unfinished one) that cannot go on: the
    report directory holds another run, or nothing to resume. Nothing was touched."""


@dataclass(frozen=True)
class RunIdentity:
    """Everything that decides which trials a run makes and how each runs: two runs with the
    same identity make the same trials, so one may finish what the other began."""

    fleet_sha256: str
    tasks_sha256: str
    seed: int
    trials: int
    concurrency: int
    num_repeats: int
    entry_url: str | None

    def differences(self, other: RunIdentity) -> list[str]:
        """What differs from `other` (the journaled run), one phrase each."""
        said = []
        if self.fleet_sha256 != other.fleet_sha256:
            said.append("the fleet file changed")
        if self.tasks_sha256 != other.tasks_sha256:
            said.append("the tasks file changed")
        for flag, mine, theirs in (
            ("--seed", self.seed, other.seed),
            ("--trials", self.trials, other.trials),
            ("--concurrency", self.concurrency, other.concurrency),
            ("--num-repeats", self.num_repeats, other.num_repeats),
            ("--entry-url", self.entry_url, other.entry_url),
        ):
            if mine != theirs:
                said.append(f"{flag} {theirs} there, {mine} here")
        return said


@dataclass
class Prepared:
    """What the trials are judged against: the discovery, the baseline, its findings."""

    facts: list[ServerFacts]
    entry_url: str
    baseline: RunObservation
    findings: list[Violation]
    """The baseline's second pass and the stateless probe's findings."""
    unreproduced: set[tuple[str, str]]
    recording_sha256: str
    """The model recording every trial replays: a resume replays the very same one."""
    seconds: float
    """How long the discovery, the baseline and the probe took."""


@dataclass
class RanTrial:
    """A trial that ran, before its checks: its plan, `run_trial`'s result, the seconds it
    took, and whether its restore check is recorded (then it is decided)."""

    plan: TrialPlan
    observation: RunObservation
    reached: bool
    note: str
    seconds: float
    restore_checked: bool = False
    elapsed: float = 0.0
    """The run's seconds (over every session, downtime left out) when it was recorded."""


class Journal:
    """One report directory's journal (see the module docstring). Blocking: call it in a
    thread."""

    def __init__(self, report: Path, identity: RunIdentity) -> None:
        self.directory = report / JOURNAL
        self.identity = identity

    @classmethod
    def begin(cls, report: Path, identity: RunIdentity, *, resume: bool) -> Journal:
        """The journal of the run `identity`, checked before anything is touched: a resume of
        the run the directory holds (`ResumeRefused` when it holds another, or none), or a
        new run, which starts the journal over unless that would lose an unfinished run's
        decided trials (`ResumeRefused`: resume it, or report elsewhere)."""
        journal = cls(report, identity)
        journaled = journal.journaled_identity()
        if resume:
            if journaled is None:
                raise ResumeRefused(
                    f"nothing to resume in {report}: no certification was journaled there "
                    "(run without --resume)"
                )
            differences = identity.differences(journaled)
            if differences:
                raise ResumeRefused(
                    f"{report} holds another certification ({'; '.join(differences)}): "
                    "resume with the flags, fleet file and tasks it was started with, or "
                    "give another --report"
                )
            return journal
        journal.refuse_to_lose_decided_trials("a new run")
        journal.start_over()
        return journal

    def refuse_to_lose_decided_trials(self, what: str) -> None:
        """`ResumeRefused` when the directory holds an unfinished run with something decided
        (its baseline, or trials): `what` would overwrite its work area or its report."""
        journaled = self.journaled_identity()
        if journaled is None or not self.path(BASELINE_NAME).exists():
            return
        _, decided = self.kept(journaled.trials)
        if decided >= journaled.trials:
            return
        raise ResumeRefused(
            f"{self.directory.parent} holds an unfinished certification ({decided} of "
            f"{journaled.trials} trials decided): {what} would overwrite it; finish it with "
            "the same command and --resume, or give another --report"
        )

    def kept(self, trials: int) -> tuple[int, int]:
        """Of trials 1..`trials`, how many ran and how many of those are decided (their
        restore check recorded), as the files say."""
        ran = decided = 0
        for number in range(1, trials + 1):
            path = self.path(trial_name(number))
            if path.exists():
                ran += 1
                decided += read_document(path).get("restore_checked") is True
        return ran, decided

    def journaled_identity(self) -> RunIdentity | None:
        """The identity of the run the journal holds (None: no journal)."""
        return self._read(RUN_NAME, "run", lambda document: RunIdentity(**document["identity"]))

    def start_over(self) -> None:
        """Forget an earlier run's journal, then journal this run's identity."""
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(parents=True)
        write_document(self.path(RUN_NAME), {"identity": dataclasses.asdict(self.identity)})

    def record_prepared(self, prepared: Prepared) -> None:
        write_document(
            self.path(BASELINE_NAME),
            {
                "facts": [dataclasses.asdict(f) for f in prepared.facts],
                "entry_url": prepared.entry_url,
                "baseline": observation_json(prepared.baseline),
                "findings": [v.to_json() for v in prepared.findings],
                "unreproduced": sorted(prepared.unreproduced),
                "recording_sha256": prepared.recording_sha256,
                "seconds": prepared.seconds,
            },
        )

    def prepared(self) -> Prepared | None:
        """The journaled baseline (None: the run was interrupted before it was complete)."""
        return self._read(BASELINE_NAME, "baseline", prepared_from_json)

    def record_trial(self, trial: RanTrial) -> None:
        document = dataclasses.asdict(trial)
        document["plan"] = trial.plan.number  # the seed draws the rest (`plan.plan_trial`)
        document["observation"] = observation_json(trial.observation)
        write_document(self.path(trial_name(trial.plan.number)), document)

    def trials(self, plans: Sequence[TrialPlan]) -> list[RanTrial]:
        """The journaled trials among `plans` (the run's, drawn again from the seed)."""
        found = []
        for plan in plans:
            trial = self._read(trial_name(plan.number), "trial", partial(trial_from_json, plan))
            if trial is not None:
                found.append(trial)
        return found

    def path(self, name: str) -> Path:
        return self.directory / name

    def _read(self, name: str, what: str, parse: Callable[[dict[str, Any]], T]) -> T | None:
        """`parse` of the journal's file `name` (None: there is none); `CorruptFile` for a
        file that is not the journal's `what`."""
        path = self.path(name)
        if not path.exists():
            return None
        document = read_document(path)
        try:
            return parse(document)
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptFile(f"{path}: not a certify journal's {what}: {error}") from None


def trial_name(number: int) -> str:
    return f"trial-{number}.json"


def write_document(path: Path, document: Mapping[str, Any]) -> None:
    """`document` (with the journal's `format`) into `path`, whole or not at all, durably."""
    data = json.dumps({"format": FORMAT, **document}, ensure_ascii=False).encode()
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        replace_atomically(directory, path.name, f".{path.name}.{uuid.uuid4().hex}.tmp", data)
    finally:
        os.close(directory)


def read_document(path: Path) -> dict[str, Any]:
    """A document `write_document` wrote; `CorruptFile` for anything else (a file the
    journal never wrote would resume a run from facts nobody decided)."""
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:
        raise CorruptFile(f"{path}: not a readable JSON document: {error}") from None
    if not isinstance(document, dict) or document.pop("format", None) != FORMAT:
        raise CorruptFile(f"{path}: not a certify journal file of format {FORMAT!r}")
    return document


def file_sha256(path: Path) -> str:
    """The SHA-256 of `path`'s bytes, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(DIGEST_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def prepared_from_json(document: Mapping[str, Any]) -> Prepared:
    return Prepared(
        facts=[ServerFacts(**f) for f in document["facts"]],
        entry_url=str(document["entry_url"]),
        baseline=observation_from_json(document["baseline"]),
        findings=[violation_from_json(v) for v in document["findings"]],
        unreproduced={(str(a), str(b)) for a, b in document["unreproduced"]},
        recording_sha256=str(document["recording_sha256"]),
        seconds=float(document["seconds"]),
    )


def trial_from_json(plan: TrialPlan, document: dict[str, Any]) -> RanTrial:
    """Trial `plan.number` as `Journal.record_trial` wrote it."""
    if document["plan"] != plan.number:
        raise ValueError(f"it holds trial {document['plan']}")
    observation = observation_from_json(document["observation"])
    return RanTrial(**{**document, "plan": plan, "observation": observation})


def observation_json(observation: RunObservation) -> dict[str, Any]:
    return dataclasses.asdict(observation)


def observation_from_json(document: Mapping[str, Any]) -> RunObservation:
    """The observation `observation_json` wrote, its pairs tuples again (the checks compare
    them with tuples)."""
    fields = {f.name for f in dataclasses.fields(RunObservation)}
    if set(document) != fields:
        raise ValueError(f"fields {sorted(set(document) ^ fields)} do not match")
    observation = RunObservation(**document)
    observation.model_misses = _pairs(observation.model_misses)
    observation.sent_before_kill = {
        member: _pairs(sent) for member, sent in observation.sent_before_kill.items()
    }
    return observation


def violation_from_json(document: Mapping[str, Any]) -> Violation:
    return Violation(**{**document, "check": Check(document["check"])})


def _pairs(values: Iterable[Sequence[Any]]) -> list[Any]:
    return [tuple(value) for value in values]
