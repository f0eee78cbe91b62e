"""What `certify` tells the user: a terminal summary, `report.json` and `report.html`.

All three are drawn from one `CertifyReport` through `findings` (the matrix, the per-server
rows, the ordered findings), so they cannot disagree. `report.json` is what scripts and
tests read; `report.html` is what a person opens, and it must open anywhere: one file, its
CSS inline, no script, no font or image from the network, no URL at all. Every text in it
comes from the user's fleet (rollout ids, JSON keys, server names, a server's own error
line), so every text is escaped: a hostile rollout id must show as text, not become markup.
A cell of the matrix says its outcome in words as well as in colour, so the page reads the
same printed in black and white or by a screen reader.
"""

from __future__ import annotations

import html
import json
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rollout_checkpoint.client.certify.findings import (
    REPORT_FORMAT,
    Fault,
    Outcome,
    Phase,
    ServerFacts,
    TrialResult,
    Violation,
    all_violations,
    matrix,
    summaries,
)

JSON_NAME = "report.json"
HTML_NAME = "report.html"
FIRST_FINDINGS = 10
"""Findings the terminal summary lists (the files list them all)."""
NOT_RUN = "not run"
"""A matrix cell no trial chose."""
OUTCOME_STYLES = {"held": "green", "violated": "bold red", "not_reached": "yellow", NOT_RUN: "dim"}
VIOLATION_FIELDS = ("check", "server", "session", "step", "path", "trial", "detail")
"""A violation's fields, in the order the tables show them."""


class ReportFormatError(ValueError):
    """A file that is not a `report.json` of this format."""


@dataclass
class CertifyReport:
    """Everything one certify run found, as the report shows it."""

    command: str
    """The command line that reruns the run (a trial's adds `--only N`)."""
    seed: int
    fleet: str
    tasks: str
    servers: list[ServerFacts]
    baseline_rollouts: int
    concurrencies: tuple[int, int]
    """The two baseline passes' concurrencies."""
    baseline_findings: list[Violation]
    trials: list[TrialResult]
    seconds: float
    trials_per_minute: float
    exported_sessions: dict[str, int] = field(default_factory=dict)
    """Resources member -> the sessions whose state the baseline exported: what the
    exported-state check holds each trial's to. 0 for a server that keeps no state past a
    session's end (NeMo Gym's IPI drops it at `/verify`), where the check has nothing to
    compare."""

    @property
    def findings(self) -> list[Violation]:
        """Every violation, the baseline's first."""
        return all_violations(self.trials, self.baseline_findings)

    @property
    def verdict(self) -> Outcome:
        """`violated` when any check failed anywhere (a violated trial always carries its
        violation, but a trial's outcome is trusted even if it does not)."""
        violated = self.findings or any(t.outcome == Outcome.VIOLATED for t in self.trials)
        return Outcome.VIOLATED if violated else Outcome.HELD

    def to_json(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "command": self.command,
            "seed": self.seed,
            "fleet": self.fleet,
            "tasks": self.tasks,
            "verdict": str(self.verdict),
            "servers": [{"name": s.name, "kind": s.kind, "mode": s.mode} for s in self.servers],
            "baseline": {
                "rollouts": self.baseline_rollouts,
                "concurrencies": list(self.concurrencies),
                "findings": [v.to_json() for v in self.baseline_findings],
                "exported_sessions": dict(sorted(self.exported_sessions.items())),
            },
            "trials": [t.to_json(self.command) for t in self.trials],
            "matrix": {
                fault: {phase: str(outcome) for phase, outcome in row.items()}
                for fault, row in matrix(self.trials).items()
            },
            "summary": [
                {
                    "server": row.server,
                    "kind": row.kind,
                    "trials": row.trials,
                    "faults_survived": row.faults_survived,
                    "violations": row.violations,
                }
                for row in summaries(self.servers, self.trials, self.baseline_findings)
            ],
            "findings": [v.to_json() for v in self.findings],
            "seconds": round(self.seconds, 3),
            "trials_per_minute": round(self.trials_per_minute, 2),
        }


def write_report(directory: Path, report: CertifyReport) -> tuple[Path, Path]:
    """Writes `report.json` and `report.html` into `directory` (made if missing); returns
    their paths. Blocking file I/O: an event loop calls it through `asyncio.to_thread`.

    Each file is written under a temporary name and renamed: a run stopped mid-write (Ctrl-C
    at the end of a long run) leaves the previous report whole, never half a JSON document
    that a script would read as a verdict."""
    directory.mkdir(parents=True, exist_ok=True)
    document = report.to_json()
    json_path = directory / JSON_NAME
    html_path = directory / HTML_NAME
    _write_atomically(json_path, json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    _write_atomically(html_path, render_html(document))
    return json_path, html_path


def load_report(path: Path) -> dict[str, Any]:
    """A `report.json` as written by `write_report`; `ReportFormatError` for anything else
    (another format's report read as this one would give a wrong verdict silently)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ReportFormatError(f"{path}: not a readable JSON document: {error}") from error
    if not isinstance(document, dict) or document.get("format") != REPORT_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ReportFormatError(f"{path}: format {found!r}, not {REPORT_FORMAT!r}")
    return document


def _write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it and a rename. Opened with `x`
    (not `mkstemp`, whose files are private): the report gets the user's usual mode."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with temporary.open("x", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


# -- the terminal ---------------------------------------------------------------------------


def print_summary(console: Console, report: CertifyReport) -> None:
    """The verdict, the per-server table, the capability matrix and the first findings.

    Every value goes in as `Text`, never as markup: a rollout id like `[red]x` must print
    as itself."""
    document = report.to_json()
    console.print(_verdict_text(document))
    console.print(_server_table(document))
    console.print(_matrix_table(document))
    findings = document["findings"]
    if findings:
        console.print(_findings_table(findings[:FIRST_FINDINGS], len(findings)))
    console.print(Text(f"report rerun: {document['command']}"))


def _verdict_text(document: dict[str, Any]) -> Text:
    held = document["verdict"] == str(Outcome.HELD)
    style = "bold green" if held else "bold red"
    said = "every check held" if held else f"{len(document['findings'])} violation(s) found"
    return Text.assemble(
        (f"certify: {said}", style),
        f" ({len(document['trials'])} trials, {document['trials_per_minute']} trials/min)",
    )


def _server_table(document: dict[str, Any]) -> Table:
    table = Table(title="per server")
    for column in ("server", "kind", "trials", "faults survived", "violations"):
        table.add_column(column)
    for row in document["summary"]:
        table.add_row(
            *(Text(str(row[k])) for k in ("server", "kind", "trials", "faults_survived")),
            Text(str(row["violations"]), style="red" if row["violations"] else ""),
        )
    return table


def _matrix_table(document: dict[str, Any]) -> Table:
    table = Table(title="capability matrix (fault x phase)")
    table.add_column("fault", no_wrap=True)
    for phase in Phase:  # a header wraps at its spaces rather than being cut on a narrow terminal
        table.add_column(str(phase).replace("_", " "), overflow="fold")
    for fault in Fault:
        cells = [matrix_cell(document, fault, phase) for phase in Phase]
        table.add_row(
            Text(str(fault)),
            *(Text(_label(cell), style=OUTCOME_STYLES[cell]) for cell in cells),
        )
    return table


def _findings_table(findings: Sequence[dict[str, Any]], total: int) -> Table:
    table = Table(title=f"findings ({len(findings)} of {total})")
    for column in ("check", "server", "session", "step", "path", "trial", "detail"):
        table.add_column(column)
    for finding in findings:
        table.add_row(*(Text(_shown(finding[k])) for k in VIOLATION_FIELDS))
    return table


def matrix_cell(document: dict[str, Any], fault: Fault, phase: Phase) -> str:
    """A matrix cell's outcome (`held`, `violated`, `not_reached`) or `not run`."""
    return str(document["matrix"].get(str(fault), {}).get(str(phase), NOT_RUN))


def _label(outcome: str) -> str:
    return outcome.replace("_", " ")


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if value is True or value is False:
        return str(value).lower()
    return str(value)


# -- the page -------------------------------------------------------------------------------


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #1b1b1b; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #eee; }
code { font: 12px/1.3 ui-monospace, monospace; word-break: break-all; }
.verdict { padding: 0.6em 1em; font-size: 1.2em; font-weight: bold; border: 2px solid; }
.verdict.held { background: #e3f5e1; border-color: #2e7d32; }
.verdict.violated { background: #fde4e1; border-color: #c62828; }
td.held, span.held { background: #c8e6c9; }
td.violated, span.violated { background: #ef9a9a; font-weight: bold; }
td.not_reached, span.not_reached { background: #fff3c4; }
td.not-run { color: #777; }
"""


def render_html(document: dict[str, Any]) -> str:
    """The self-contained page of a `report.json` document."""
    verdict = str(document["verdict"])
    said = "every check held" if verdict == "held" else "violations found"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>certify: {_e(said)}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>rollout-checkpoint certify</h1>",
        f'<p class="verdict {_e(verdict)}" id="verdict">Verdict: {_e(verdict)} ({_e(said)})</p>',
        _facts(document),
        "<h2>Per server</h2>",
        _html_table(
            ("server", "kind", "mode", "trials", "faults survived", "violations"),
            _server_rows(document),
            table_id="servers",
        ),
        "<h2>Capability matrix (fault &times; phase)</h2>",
        _html_matrix(document),
        f"<h2>Findings ({len(document['findings'])})</h2>",
        _html_findings(document["findings"]),
        f"<h2>Trials ({len(document['trials'])})</h2>",
        _html_trials(document["trials"]),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _facts(document: dict[str, Any]) -> str:
    baseline = document["baseline"]
    facts = [
        ("command", f"<code>{_e(document['command'])}</code>"),
        ("fleet", _e(document["fleet"])),
        ("tasks", _e(document["tasks"])),
        ("seed", _e(document["seed"])),
        (
            "baseline",
            _e(
                f"{baseline['rollouts']} rollouts, run twice at concurrency "
                f"{baseline['concurrencies'][0]} and {baseline['concurrencies'][1]}"
            ),
        ),
        ("time", _e(f"{document['seconds']} s, {document['trials_per_minute']} trials/min")),
    ]
    rows = "".join(f"<tr><th>{_e(name)}</th><td>{value}</td></tr>" for name, value in facts)
    return f'<table id="facts">{rows}</table>'


def _server_rows(document: dict[str, Any]) -> list[list[str]]:
    modes = {s["name"]: s["mode"] for s in document["servers"]}
    return [
        [
            _e(row["server"]),
            _e(row["kind"]),
            _e(_shown(modes.get(row["server"]))),
            _e(row["trials"]),
            _e(row["faults_survived"]),
            _e(row["violations"]),
        ]
        for row in document["summary"]
    ]


def _html_matrix(document: dict[str, Any]) -> str:
    header = "".join(f"<th>{_e(phase)}</th>" for phase in Phase)
    rows = []
    for fault in Fault:
        cells = []
        for phase in Phase:
            outcome = matrix_cell(document, fault, phase)
            css = "not-run" if outcome == NOT_RUN else outcome
            cells.append(
                f'<td class="{_e(css)}" data-fault="{_e(fault)}" data-phase="{_e(phase)}">'
                f"{_e(_label(outcome))}</td>"
            )
        rows.append(f"<tr><th>{_e(fault)}</th>{''.join(cells)}</tr>")
    return f'<table id="matrix"><tr><th>fault \\ phase</th>{header}</tr>{"".join(rows)}</table>'


def _html_findings(findings: Sequence[dict[str, Any]]) -> str:
    if not findings:
        return '<p id="findings">None: every check held.</p>'
    rows = [[_code_or_text(k, f[k]) for k in VIOLATION_FIELDS] for f in findings]
    return _html_table(VIOLATION_FIELDS, rows, table_id="findings")


def _html_trials(trials: Sequence[dict[str, Any]]) -> str:
    columns = ("trial", "fault", "phase", "target", "trigger", "outcome", "seconds", "note")
    rows = []
    for trial in trials:
        rows.append(
            [
                _e(trial["number"]),
                _e(trial["fault"]),
                _e(trial["phase"]),
                _e(_shown(trial["target"])),
                _e(_shown(trial["trigger"])),
                f'<span class="{_e(trial["outcome"])}">{_e(_label(trial["outcome"]))}</span>',
                _e(trial["seconds"]),
                _note(trial),
                f"<code>{_e(trial['command'])}</code>",
            ]
        )
    return _html_table((*columns, "rerun"), rows, table_id="trials")


def _note(trial: dict[str, Any]) -> str:
    """The trial's note, then the rollouts it restarted and the reason the product gave."""
    lines = [trial["note"]] if trial["note"] else []
    restarted: dict[str, str] = trial["restarted"]
    lines += [f"restarted {rollout_id}: {reason}" for rollout_id, reason in restarted.items()]
    return "<br>".join(_e(line) for line in lines)


def _code_or_text(key: str, value: Any) -> str:
    text = _e(_shown(value))
    return f"<code>{text}</code>" if key in ("session", "path") and value is not None else text


def _html_table(columns: Iterable[str], rows: Iterable[Sequence[str]], *, table_id: str) -> str:
    """A table of cells that are already escaped HTML."""
    header = "".join(f"<th>{_e(column)}</th>" for column in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table id="{_e(table_id)}"><tr>{header}</tr>{body}</table>'


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)
