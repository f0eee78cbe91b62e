"""The `rollout-checkpoint certify` verb: its arguments, a live progress line, the verdict.

It ends through the CLI's one handler (`console.run_verb` around `console.run_async`), so its
errors are one line and its exit codes are rows of the one table (`console.ExitCode`): 0
every check held on every trial; 9 a check did not hold (`report.json` names the server, the
check and the first counter-example); 2 usage or configuration (no `command` for a member,
no policy model, an unreadable tasks file, a `--resume` of another run or of none), or a
baseline that fails without any fault; 5 a member that cannot be started or reached; 6 a
journal file certify did not write; 130/143 stopped by SIGINT/SIGTERM (the fleet's processes
are stopped first; what was decided stays journaled, and the line says how many trials and
prints the command that resumes the run; the report is written by the run that finishes).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollout_checkpoint.client.certify.findings import all_violations
from rollout_checkpoint.client.certify.fleet_processes import MemberNotStarted
from rollout_checkpoint.client.certify.report import CertifyReport, print_summary, write_report
from rollout_checkpoint.client.certify.run import (
    BaselineFailed,
    Certification,
    CertifyOptions,
    certifiable,
    restart_port_notes,
)
from rollout_checkpoint.client.certify.runs import RunFailed
from rollout_checkpoint.client.cli.console import (
    CliError,
    ExitCode,
    HelpFormatter,
    Interrupted,
    Output,
    add_output_flags,
    epilog,
    run_async,
    run_verb,
)
from rollout_checkpoint.client.cli.errors import classify as classify_fleet_error
from rollout_checkpoint.client.cli.parsers import positive_int
from rollout_checkpoint.client.collect.errors import CorruptFile, UsageError
from rollout_checkpoint.client.fleet import FleetConfigError
from rollout_checkpoint.client.fleet.launch import LaunchError

EXAMPLE = (
    "rollout-checkpoint certify --fleet fleet.toml --tasks tasks.jsonl --trials 50 --seed 1 "
    "--report certify-report"
)


def add_certify_verb(verbs: Any) -> None:
    """Register `certify` on the CLI's subparsers (`verbs`, what `add_subparsers` returned)."""
    sub: argparse.ArgumentParser = verbs.add_parser(
        "certify",
        help="prove your own fleet's checkpointing under fault injection (trials, matrix, report)",
        description="Run your fleet (every member started from its fleet-file `command`) "
        "uninterrupted twice as a baseline, then N trials, each a fault (SIGKILL of a member, "
        "of the fleet or of the collector, SIGSTOP past the lease, a storage failure) at a "
        "phase drawn from the seed, recovered through the product's own paths; every trial is "
        "checked against the baseline by named invariants. Writes report.json and a "
        "self-contained report.html (the docs' certify page).",
        epilog=epilog(
            EXAMPLE,
            "rerun one trial exactly: the same command with --only N",
            "go on after an interruption (Ctrl-C, a reboot): the same command with --resume",
        ),
        formatter_class=HelpFormatter,
    )
    sub.add_argument(
        "--fleet", type=Path, required=True, help="fleet file with a command per member"
    )
    sub.add_argument("--tasks", type=Path, required=True, help="tasks, one JSON object a line")
    sub.add_argument("--trials", type=positive_int, default=50, help="trials (default 50)")
    sub.add_argument("--seed", type=int, default=1, help="the seed of the trial plan (default 1)")
    sub.add_argument(
        "--report",
        type=Path,
        default=Path("certify-report"),
        help="directory for report.json, report.html and the runs' logs (default certify-report)",
    )
    sub.add_argument(
        "--only",
        type=positive_int,
        default=None,
        metavar="N",
        help="run trial N of the plan alone",
    )
    sub.add_argument(
        "--entry-url",
        default=None,
        help="the environment's (or agent's) base URL (default: from the fleet file)",
    )
    sub.add_argument(
        "--concurrency",
        type=positive_int,
        default=4,
        help="rollouts in flight (the baseline's second pass runs at another one; default 4)",
    )
    sub.add_argument("--num-repeats", type=positive_int, default=1, help="rollouts per task")
    sub.add_argument(
        "--resume",
        action="store_true",
        help="go on with the interrupted run journaled in --report DIR (the same flags, fleet "
        "and tasks): its baseline and decided trials are kept, only the rest run",
    )
    add_output_flags(sub, verbose=False)


def run_certify(args: argparse.Namespace) -> int:
    """Run the certification `args` (parsed by `add_certify_verb`'s parser) to its exit code."""
    options = CertifyOptions(
        fleet=args.fleet,
        tasks=args.tasks,
        report=args.report,
        trials=args.trials,
        seed=args.seed,
        only=args.only,
        entry_url=args.entry_url,
        concurrency=args.concurrency,
        num_repeats=args.num_repeats,
        resume=args.resume,
    )
    as_json = bool(getattr(args, "json", False))
    console = Console(stderr=True, soft_wrap=True)

    def certify() -> int:
        spec = certifiable(options)
        for note in restart_port_notes(spec):
            console.print(f"[yellow]note:[/] {note}", highlight=False)
        with _progress(console) as progress:
            task = progress.add_task("starting", total=None)

            def show(what: str, done: int, planned: int) -> None:
                progress.update(task, description=what, completed=done, total=planned or None)

            certification = Certification(options, spec, show)
            try:
                report = run_async(lambda signals: certification.run())
            except Interrupted as interrupted:
                raise Interrupted(
                    interrupted.signum, f"{interrupted.message}: {certification.stopped()}"
                ) from None
        json_path, html_path = write_report(options.report, report)
        print_summary(console, report)
        console.print(f"report: {json_path} and {html_path}")
        code = ExitCode.VIOLATIONS_FOUND if _violated(report) else ExitCode.OK
        if as_json:
            Output(as_json=True).json_line(
                {"report": str(json_path), "html": str(html_path), "exit_code": int(code)}
            )
        return code

    return run_verb(certify, classify, as_json=as_json)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,  # the live line goes; the verdict and tables stay (an error is one line)
    )


def _violated(report: CertifyReport) -> bool:
    return bool(all_violations(report.trials, report.baseline_findings))


def classify(error: BaseException) -> CliError | None:
    """The exit code and one line for an exception that ends a certification (None: a bug)."""
    if isinstance(error, UsageError | FleetConfigError | BaselineFailed | RunFailed):
        return CliError(ExitCode.USAGE, str(error))
    if isinstance(error, CorruptFile):
        return CliError(ExitCode.CORRUPT, str(error))
    if isinstance(error, LaunchError | MemberNotStarted):
        return CliError(ExitCode.UNREACHABLE, _first_line(str(error)))
    return classify_fleet_error(error)


def _first_line(message: str) -> str:
    """A launch error's first line (its stderr tail follows on the next lines): the CLI's
    errors are one line, the member's log keeps the rest."""
    return message.splitlines()[0] if message else message
