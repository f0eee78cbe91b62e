"""A hand-made certify report: a baseline finding, a held, a violated and an unreached trial,
and a rollout id that is hostile markup in HTML, in rich and in a shell."""

from __future__ import annotations

from rollout_checkpoint.client.certify.findings import (
    Check,
    Fault,
    Outcome,
    Phase,
    TrialPlan,
    TrialResult,
    Violation,
)
from rollout_checkpoint.client.certify.report import CertifyReport

from .certify_runs import SERVERS

HOSTILE_ID = "<img src=http://evil.example/x onerror=alert(1)>[bold]t1[/bold]&amp;\"'.0"
"""A rollout id that would be an image (and a request to the network) if it were not
escaped, rich markup if it were printed as markup, and an entity if escaped twice."""
HOSTILE_PATH = '$["</td><script>alert(2)</script>"]'
COMMAND = "rollout-checkpoint certify --fleet fleet.toml --tasks tasks.jsonl --trials 3 --seed 5"


def sample_report(*, violated: bool = True) -> CertifyReport:
    lost_field = Violation(
        Check.EXPORTED_STATE_EQUALS_BASELINE,
        f"counter's exported state of session {HOSTILE_ID!r} differs at {HOSTILE_PATH}",
        server="counter",
        session=HOSTILE_ID,
        step=2,
        path=HOSTILE_PATH,
        trial=2,
    )
    trials = [
        TrialResult(
            TrialPlan(1, Fault.KILL_MEMBER, Phase.PREPARE, "counter"),
            Outcome.HELD,
            restarted={"t2.0": "its session was not in the checkpoint"},
            seconds=2.5,
        ),
        TrialResult(
            TrialPlan(2, Fault.KILL_FLEET, Phase.AFTER_SNAPSHOT, None, checkpoint=2),
            Outcome.VIOLATED if violated else Outcome.HELD,
            violations=[lost_field] if violated else [],
            seconds=3.0,
        ),
        TrialResult(
            TrialPlan(3, Fault.STOP_MEMBER, Phase.RESTORE, "agent", trigger="counter"),
            Outcome.NOT_REACHED,
            note="the run ended before its second checkpoint",
            seconds=1.0,
        ),
    ]
    baseline_findings = (
        [
            Violation(
                Check.DETERMINISTIC,
                "rollout 't3.0' got another reply in the second baseline pass",
                server="prompt_injection",
                session="t3.0",
                step=0,
                path="$.messages[3].content",
            )
        ]
        if violated
        else []
    )
    return CertifyReport(
        command=COMMAND,
        seed=5,
        fleet="fleet.toml",
        tasks="tasks.jsonl",
        servers=list(SERVERS),
        baseline_rollouts=3,
        concurrencies=(4, 1),
        baseline_findings=baseline_findings,
        trials=trials,
        seconds=6.5,
        trials_per_minute=27.7,
        exported_sessions={"prompt_injection": 0, "counter": 3},
    )
