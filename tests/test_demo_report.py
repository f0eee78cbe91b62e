"""The demo's report keeps every check a JSON boolean, even when no rollout finished."""

from __future__ import annotations

import json
from pathlib import Path

from rollout_checkpoint.examples.demo import Demo, Options, Rollout


def test_mean_reward_check_is_false_not_an_empty_list_when_no_rollout_finished(
    tmp_path: Path,
) -> None:
    """Without a finished rollout there is no mean reward to compare: the check must fail as
    ``false`` in report.json, not leak the empty list of rewards (``[]``) that a consumer
    reading ``checks`` as booleans (``is False``, a JSON schema) would misread."""
    demo = Demo(Options(json=True))
    unfinished = Rollout("r000", {"environment": {}})
    demo.compare(
        {"directory": str(tmp_path)},
        [unfinished],
        {"r000": Rollout("r000", {"environment": {}})},
        in_scope=set(),
        attempt=1,
    )
    checks = json.loads(json.dumps(demo.report.checks))
    assert checks["mean_reward_equals_baseline"] is False
    assert all(isinstance(ok, bool) for ok in checks.values()), checks
    assert not demo.report.passed
