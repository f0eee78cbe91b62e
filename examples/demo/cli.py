"""`rollout-checkpoint demo`: run the tour, write `report.json`, print the verdict, exit 0 or 1."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from .options import parse_args
from .report import DemoFailed
from .tour import Demo


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    keep = options.output_dir is not None
    work = options.output_dir or Path(tempfile.mkdtemp(prefix="rollout-checkpoint-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    demo = Demo(options)
    started = time.monotonic()
    try:
        report = asyncio.run(demo.run(work))
    except DemoFailed as failure:
        report = demo.report
        report.check("demo_completed", False, str(failure))
    report.numbers["total_seconds"] = round(time.monotonic() - started, 2)
    payload = {
        "passed": report.passed,
        "numbers": report.numbers,
        "checks": report.checks,
        "problems": report.problems,
    }
    (work / "report.json").write_text(json.dumps(payload, indent=2) + "\n")
    if options.json:
        print(json.dumps(payload, sort_keys=True))
    else:
        _print_report(
            demo.console if not options.json else Console(), payload, work if keep else None
        )
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report.passed else 1


def _print_report(console: Console, payload: dict[str, Any], kept: Path | None) -> None:
    console.print()
    for name, value in payload["numbers"].items():
        console.print(f"  {name:32} {value}")
    console.print()
    for name, ok in payload["checks"].items():
        console.print(f"  {'[green]ok[/]' if ok else '[red]FAIL[/]'}  {name}")
    for problem in payload["problems"]:
        console.print(f"  [red]{problem}[/]")
    console.print(
        f"\n{'[green]PASSED[/]' if payload['passed'] else '[red]FAILED[/]'}"
        + (f" (kept in {kept})" if kept else "")
    )
