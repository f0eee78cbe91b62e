"""Which trials a certify run makes: every one decided by the seed, none by the clock.

The trials walk the capability matrix (fault x phase) in an order shuffled by the seed, so a
run of 35 trials or more reaches every cell once before any cell twice: a short run on a
laptop already says something about every fault and every phase. Everything else a trial
needs (the member struck, the member whose loss makes a recovery, the checkpoint, the moment)
is drawn from one random generator per trial, seeded by (seed, trial number): rerunning one
trial (`--only N`) draws exactly what the full run drew for it, whatever came before.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rollout_checkpoint.client.certify.findings import Fault, Phase, TrialPlan

CELLS: tuple[tuple[Fault, Phase], ...] = tuple((f, p) for f in Fault for p in Phase)
"""Every (fault, phase) the matrix has."""
RECOVERY_PHASES = frozenset({Phase.RESTORE, Phase.AFTER_RESUME})
"""Phases that exist only during a recovery: a first member kill (the trigger) makes one."""
MOMENTS = (0.2, 0.8)
"""MID_STEP trials strike when between these fractions of the rollouts have finished."""


def plan_trials(seed: int, count: int, members: Sequence[str]) -> list[TrialPlan]:
    """Trials 1..count of the run seeded `seed` on a fleet of `members` (fleet-file names)."""
    return [plan_trial(seed, number, members) for number in range(1, count + 1)]


def plan_trial(seed: int, number: int, members: Sequence[str]) -> TrialPlan:
    """Trial `number` alone, exactly as `plan_trials` makes it (for `--only`)."""
    if number < 1:
        raise ValueError("trials are numbered from 1")
    if not members:
        raise ValueError("a fleet without members has nothing to certify")
    order = list(CELLS)
    random.Random(seed).shuffle(order)
    return _trial(seed, number, order[(number - 1) % len(order)], members)


def _trial(seed: int, number: int, cell: tuple[Fault, Phase], members: Sequence[str]) -> TrialPlan:
    fault, phase = cell
    draw = random.Random(f"{seed}:{number}")
    target = draw.choice(members) if fault in (Fault.KILL_MEMBER, Fault.STOP_MEMBER) else None
    trigger = draw.choice(members) if phase in RECOVERY_PHASES else None
    return TrialPlan(
        number=number,
        fault=fault,
        phase=phase,
        target=target,
        trigger=trigger,
        checkpoint=draw.choice((1, 2)),
        moment=round(draw.uniform(*MOMENTS), 3),
    )
