"""The `rollout-checkpoint` command line: the top-level parser and `main`.

The verbs live beside it in `rollout_checkpoint.client.cli` (fleet verbs, `status`, `health`,
`inspect`, `coordinator`, `participant`), in `rollout_checkpoint.client.collect` (`collect`) and
in `rollout_checkpoint.client.certify` (`certify`);
`serve` and `demo` exec the examples. Every verb ends through one handler (`console.run_verb`):
errors are one line and an exit code of the one table in `console.ExitCode`, never a
traceback.

This module imports only the standard library and `stop_signals` at its top: until `main`
takes SIGINT and SIGTERM for a server verb, a signal meets Python's defaults (a
KeyboardInterrupt traceback, or a death by SIGTERM), so everything else is imported after, in
the function that needs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rollout_checkpoint.server.core import stop_signals

SERVED_KINDS = (
    ("weather", "resources, stateless"),
    ("counter", "resources, exported"),
    ("prompt_injection", "resources, exported, verify wait"),
    ("policy_model", "model"),
    ("agent", "agent"),
    ("environment", "environment"),
    ("nemo-gym:indirect_prompt_injection", "NeMo Gym's own, resources, exported, verify wait"),
    ("nemo-gym:example_session_state_mgmt", "NeMo Gym's own, resources, exported"),
)
"""What `serve` runs (examples/serve/kinds.py KINDS; a test keeps the two equal). Listed here
because the CLI never imports the participant runtime. The `nemo-gym:` ones need nemo-gym
installed in the same environment. Beside them `serve` runs a user's own server, named
`MODULE:ATTRIBUTE` (examples/serve/user_app.py)."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("rollout-checkpoint")
    except PackageNotFoundError:  # pragma: no cover - run from a tree that was not installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    from rollout_checkpoint.client.certify.cli import add_certify_verb
    from rollout_checkpoint.client.cli.console import HelpFormatter, exit_code_table
    from rollout_checkpoint.client.cli.parsers import add_fleet_verbs
    from rollout_checkpoint.client.cli.participant import add_participant_verbs
    from rollout_checkpoint.client.collect import add_collect_verb

    kinds = ", ".join(f"{name} ({what})" for name, what in SERVED_KINDS)
    parser = argparse.ArgumentParser(
        prog="rollout-checkpoint",
        description="A gRPC control plane that checkpoints a fleet of RL rollout servers. "
        "`VERB --help` describes each verb.",
        epilog=f"serve runs: {kinds}; or your own server as MODULE:ATTRIBUTE (serve --help)."
        f"\n\n{exit_code_table()}",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    verbs = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    verbs.add_parser(
        "demo",
        help="checkpoint a live fleet mid-flight, SIGKILL it, restore, continue; demo --help",
    )
    verbs.add_parser(
        "serve",
        help="run a fleet server with its sidecar: an example, one of NeMo Gym's "
        f"({', '.join(n for n, _ in SERVED_KINDS)}) or your own as MODULE:ATTRIBUTE; "
        "serve --help",
    )
    add_fleet_verbs(verbs)
    add_collect_verb(verbs)
    add_certify_verb(verbs)
    add_participant_verbs(verbs)
    return parser


def _exec_module(module: str, args: list[str]) -> int:
    """Replace this process with `python -P -m module args`.

    The CLI never imports the participant runtime; exec keeps signals going straight to the
    server, so SIGTERM shuts it down gracefully. `-P`: `-m` would put the working directory
    first on `sys.path`, where any folder named like an installed package shadows it
    (run from our own checkout, our `benchmarks/` hides the `benchmarks` package nemo-gym
    installs); the module and everything it imports come from the environment alone."""
    os.execv(sys.executable, [sys.executable, "-P", "-m", module, *args])
    return 0  # pragma: no cover - execv does not return


def _exec_server(args: list[str]) -> int:
    """`serve`: exec the server with SIGINT and SIGTERM blocked (`stop_signals.hold`), so a
    signal from now on waits, across the exec and the server's imports, for the server's own
    handler; one that came before (while this was starting) ends here, with the server's code."""
    stop_signals.hold()
    stop_signals.PROCESS.exit_if_received()
    return _exec_module("rollout_checkpoint.examples.serve", args)


SERVER_VERBS = ("serve", "coordinator")
"""Verbs that run a server: a signal stops them quietly at any moment (`stop_signals`), where
the other verbs abort what they started and say so (`console.run_async`)."""


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] and arguments[0] in SERVER_VERBS:
        stop_signals.PROCESS.take()  # before any import (stop_signals)
    if arguments[:1] == ["serve"]:
        return _exec_server(arguments[1:])
    if arguments[:1] == ["demo"]:
        return _exec_module("rollout_checkpoint.examples.demo", arguments[1:])
    return _run_verb(_parser().parse_args(arguments), arguments)


def _run_verb(args: argparse.Namespace, arguments: list[str]) -> int:
    from rollout_checkpoint.client.cli.console import run_async, run_verb
    from rollout_checkpoint.client.cli.dispatch import is_fleet_command
    from rollout_checkpoint.client.cli.dispatch import run as run_fleet_command
    from rollout_checkpoint.client.cli.errors import classify
    from rollout_checkpoint.client.cli.participant import participant_verb
    from rollout_checkpoint.client.collect import run_collect

    if args.command == "collect":
        return run_collect(args, ["rollout-checkpoint", *arguments])
    if args.command == "certify":
        from rollout_checkpoint.client.certify.cli import run_certify

        return run_certify(args)

    def verb() -> int:
        if is_fleet_command(args.command):
            return run_fleet_command(args)
        return run_async(lambda signals: participant_verb(args))

    return run_verb(verb, classify, as_json=bool(getattr(args, "json", False)))


if __name__ == "__main__":
    sys.exit(main())
