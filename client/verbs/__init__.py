"""The verbs of `rollout-checkpoint` other than `serve`, `demo` and `collect`, one concept a
module:

* `names`: the wire's values as the CLI shows and parses them (states, health names, times,
  `--episode`);
* `parsers`: the fleet verbs' argument parsers and help (`health`, `inspect`, `coordinator`
  too);
* `errors`: how the client library's exceptions end a verb (exit code, one line);
* `fleet_verbs`: prepare, commit, checkpoint, restore, resume, retire, forget, renew, and the
  abort after a signal;
* `status`: `status` and `health`;
* `progress`: a prepare's live progress;
* `inspection`: `inspect`;
* `coordinator_verb`: `coordinator`;
* `participant`: `participant RPC`.

`run` dispatches a parsed fleet verb; every verb ends through `console.run_verb` with
`errors.classify`.
"""

from __future__ import annotations

import argparse
import asyncio

from rollout_checkpoint.client.cli.console import run_async
from rollout_checkpoint.client.cli.coordinator_verb import coordinator_verb
from rollout_checkpoint.client.cli.fleet_verbs import fleet_command
from rollout_checkpoint.client.cli.inspection import inspect_verb
from rollout_checkpoint.client.cli.parsers import FLEET_VERBS
from rollout_checkpoint.client.cli.status import health_verb
from rollout_checkpoint.server.core.stop_signals import PROCESS


def is_fleet_command(name: str) -> bool:
    """Whether `name` is a verb `run` handles (a fleet verb, `inspect`, `coordinator`,
    `health`)."""
    return name in FLEET_VERBS or name in ("inspect", "coordinator", "health")


def run(args: argparse.Namespace) -> int:
    """Run one fleet verb (or `health`, `inspect`, `coordinator`); returns the exit code.

    Raises what the verb raises (for `console.run_verb` and `errors.classify`)."""
    if args.command == "inspect":
        return inspect_verb(args)
    if args.command == "coordinator":  # a server: its signals are `stop_signals`
        PROCESS.exit_if_received()
        code = asyncio.run(coordinator_verb(args))
        PROCESS.exit_if_received()
        return code
    if args.command == "health":
        return run_async(lambda signals: health_verb(args))
    return run_async(lambda signals: fleet_command(args, signals))
