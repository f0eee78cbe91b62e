"""A five-member fleet heals itself: `rollout-checkpoint demo --self-heal`, as a user runs it.

Real processes: the five example servers, `rollout-checkpoint coordinator --supervise`, and
a trainer that drives its rollouts itself and follows `WatchFleet`. One member is SIGKILLed
with rollouts in flight and its replacement started closed on the same addresses; the
supervisor restores the whole fleet from `LATEST` (the survivors rejoin) and reopens it, and
every rollout ends with the trajectory of an uninterrupted run — the cut ones continued as
attempt N+1 from their boundary. Each victim stands for a kind: the policy model (its callers
wait at their boundary while it is gone), the agent (the environment waits for it), and a
resources server (tool calls to it fail, the rollouts restart or continue).
"""

from __future__ import annotations

import pytest

from .test_demo import demo


@pytest.mark.parametrize("victim", ["policy_model", "agent", "prompt_injection"])
def test_one_member_killed_mid_flight_the_supervisor_restores_and_reopens_the_fleet(
    tmp_path, victim: str
) -> None:
    code, report, stderr = demo(
        tmp_path,
        "--self-heal",
        "--victim",
        victim,
        "--rollouts",
        "24",
        "--concurrency",
        "16",
        "--latency",
        "0.1",
    )
    assert code == 0, (report, stderr)
    checks = report["checks"]
    assert all(checks.values()), report
    for check in (
        "every_rollout_finished",
        "trajectories_equal_baseline",
        "some_rollout_continued_from_the_checkpoint",
        "no_traceback_in_server_logs",
    ):
        assert checks[check], report
    numbers = report["numbers"]
    assert numbers["in_flight_at_kill"] > 0 and numbers["recoveries"] >= 1
    assert numbers["rollouts_continued"] > 0
