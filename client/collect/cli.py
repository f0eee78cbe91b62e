"""The `rollout-checkpoint collect` verb: its arguments, and running a `Collector` to an
exit code.

Exit codes (`errors`): 0 every rollout collected; 1 done, some rollouts recorded as failed;
2 usage, configuration or input error; 4 a participant refused; 5 a participant was
unreachable; 6 a corrupt output, dispatch log or checkpoint; 7 the output or dispatch log
cannot be written; 143 stopped by SIGTERM/SIGINT (after a checkpoint when one could be taken).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from rollout_checkpoint.client.collect.checkpoints import CheckpointStepHook
from rollout_checkpoint.client.collect.collector import CollectOptions, Collector
from rollout_checkpoint.client.collect.errors import (
    EXIT_CORRUPT,
    EXIT_IO,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CorruptFile,
    OutputFailed,
    UsageError,
)
from rollout_checkpoint.client.coordination import FleetError
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError, FleetConfigError
from rollout_checkpoint.client.publication import CheckpointCorrupt, PublicationError
from rollout_checkpoint.server.core.errors import Reason


def add_collect_verb(verbs: Any) -> None:
    """Register `collect` on the CLI's subparsers (`verbs`, what `add_subparsers` returned)."""
    sub: argparse.ArgumentParser = verbs.add_parser(
        "collect",
        help="collect K rollouts of every task through a fleet, with crash-safe checkpoints",
        description="Collect K rollouts of every task through a fleet, with checkpoints that "
        "survive a crash of the collector, a server, or everything (see the README).",
    )
    sub.add_argument("--fleet", type=Path, required=True, help="fleet file (TOML or YAML)")
    sub.add_argument(
        "--entry-url",
        required=True,
        help="the entry point's base URL (the environment server's or the agent's HTTP address)",
    )
    sub.add_argument("--input", type=Path, required=True, help="tasks, one JSON object a line")
    sub.add_argument("--output", type=Path, required=True, help="rollouts, one JSON line each")
    sub.add_argument("--num-repeats", type=_positive_int, default=1, help="rollouts per task (K)")
    sub.add_argument("--concurrency", type=_positive_int, default=32, help="rollouts in flight")
    sub.add_argument(
        "--checkpoint-dir",
        type=Path,
        required=True,
        help="checkpoints, LATEST and the dispatch log (a directory of its own)",
    )
    sub.add_argument(
        "--checkpoint-every", type=_positive_float, default=None, help="seconds between checkpoints"
    )
    sub.add_argument(
        "--resume", action="store_true", help="continue the collection in --output/--checkpoint-dir"
    )
    sub.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=3,
        help="failures of one rollout before it is recorded as failed (default 3)",
    )
    sub.add_argument(
        "--checkpoint-timeout",
        type=_positive_float,
        default=300.0,
        help="seconds for one checkpoint (default 300)",
    )
    sub.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=3600.0,
        help="seconds for one /run (default 3600)",
    )
    sub.add_argument(
        "--keep", type=_positive_int, default=None, help="published checkpoints kept (default 2)"
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def run_collect(
    args: argparse.Namespace,
    command: Sequence[str] = (),
    *,
    step_hook: CheckpointStepHook | None = None,
) -> int:
    """Run the collection `args` (parsed by `add_collect_verb`'s parser) to its exit code.

    `command` is the command line, repeated with `--resume` in the message of a stopped run.
    Every expected failure is printed as one line on stderr and becomes its exit code (see
    the module doc); nothing else is caught. `step_hook` is for fault tests only (see
    `CheckpointStepHook`)."""
    options = CollectOptions(
        fleet=args.fleet,
        entry_url=args.entry_url,
        input=args.input,
        output=args.output,
        checkpoint_dir=args.checkpoint_dir,
        num_repeats=args.num_repeats,
        concurrency=args.concurrency,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        max_attempts=args.max_attempts,
        checkpoint_timeout=args.checkpoint_timeout,
        request_timeout=args.request_timeout,
        keep=args.keep,
        command=command,
    )
    console = Console(stderr=True, soft_wrap=True)  # plain lines stay whole in logs

    def fail(code: int, message: str) -> int:
        console.print(f"rollout-checkpoint collect: {message}", markup=False, highlight=False)
        return code

    async def main() -> int:
        return await Collector(options, console, step_hook=step_hook).run()

    try:
        return asyncio.run(main())
    except (UsageError, FleetConfigError) as error:
        return fail(EXIT_USAGE, str(error))
    except (CorruptFile, CheckpointCorrupt) as error:
        return fail(EXIT_CORRUPT, str(error))
    except OutputFailed as error:
        return fail(EXIT_IO, str(error))
    except DiscoveryError as error:
        return fail(EXIT_UNREACHABLE, str(error))
    except FleetError as error:
        code = EXIT_UNREACHABLE if error.reason == Reason.PARTICIPANT_UNREACHABLE else EXIT_REFUSED
        return fail(code, str(error))
    except ControlError as error:
        return fail(EXIT_REFUSED if error.decided_by_server else EXIT_UNREACHABLE, str(error))
    except PublicationError as error:
        return fail(EXIT_CORRUPT, str(error))
