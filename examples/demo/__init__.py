"""`rollout-checkpoint demo`: checkpoint a live fleet mid-flight, SIGKILL it, restore, continue.

Starts a local fleet as separate processes (scripted policy model, agent, environment, the
prompt-injection and counter resources servers), each with its gRPC sidecar on a free loopback
port, and then:

1. runs an uninterrupted baseline of N rollouts and records every trajectory and reward;
2. runs the same rollouts on a fresh fleet and, once a good share is mid-episode, checkpoints
   it (prepare with streaming progress, commit, publish);
3. SIGKILLs every fleet process, starts fresh ones (started closed), restores the published
   checkpoint (all or nothing), takes a second checkpoint of the restored state before any
   replacement starts and checks it exports everything byte for byte as the first did,
   resumes, and continues every unfinished rollout as attempt N+1;
4. reports the numbers and the comparisons with the baseline, and exits non-zero on any
   mismatch.

One concept a module: `options` (the command line), `fleet` (the processes), `rollouts`,
`checkpoints` (the controller's steps against a live fleet), `tour` (the steps in order),
`comparison` (the verdict against the baseline), `report` and `cli`. This package is the
demo's public face: what it re-exports is what `self_heal` and the tests use.
"""

from __future__ import annotations

from .cli import main
from .comparison import check_trajectories
from .fleet import (
    FleetProcesses,
    Server,
    launch_server,
    serve_options,
    signal_group,
    start_announcing,
    start_fleet,
)
from .options import Options, parse_args
from .report import DemoFailed, Report
from .rollouts import Rollout, make_rollouts, run_all, run_one
from .tour import Demo

__all__ = [
    "Demo",
    "DemoFailed",
    "FleetProcesses",
    "Options",
    "Report",
    "Rollout",
    "Server",
    "check_trajectories",
    "launch_server",
    "main",
    "make_rollouts",
    "parse_args",
    "run_all",
    "run_one",
    "serve_options",
    "signal_group",
    "start_announcing",
    "start_fleet",
]
