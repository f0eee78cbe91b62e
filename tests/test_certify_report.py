"""certify's report (client/certify/report.py): `report.json`'s schema, the self-contained
and escaped `report.html`, the terminal summary, and the reader that refuses other formats."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console

from rollout_checkpoint.client.certify.findings import (
    REPORT_FORMAT,
    Check,
    Fault,
    Outcome,
    Phase,
    ServerFacts,
    TrialPlan,
    TrialResult,
    Violation,
    summaries,
)
from rollout_checkpoint.client.certify.report import (
    ReportFormatError,
    load_report,
    print_summary,
    render_html,
    write_report,
)

from .certify_reports import COMMAND, HOSTILE_ID, HOSTILE_PATH, sample_report

TOP_LEVEL = {
    "format", "command", "seed", "fleet", "tasks", "verdict", "servers", "baseline", "trials",
    "matrix", "summary", "findings", "seconds", "trials_per_minute",
}  # fmt: skip
VIOLATION_KEYS = {"check", "detail", "server", "session", "step", "path", "trial"}


def test_report_json_has_the_documented_schema() -> None:
    document = sample_report().to_json()
    assert set(document) == TOP_LEVEL
    assert (document["format"], document["verdict"], document["seed"]) == (
        REPORT_FORMAT,
        "violated",
        5,
    )
    assert document["servers"][3] == {"name": "counter", "kind": "resources", "mode": "exported"}
    assert document["baseline"]["rollouts"] == 3
    assert document["baseline"]["concurrencies"] == [4, 1]
    assert [set(v) for v in document["baseline"]["findings"]] == [VIOLATION_KEYS]
    assert document["baseline"]["exported_sessions"] == {"counter": 3, "prompt_injection": 0}
    assert [t["command"] for t in document["trials"]] == [
        f"{COMMAND} --only {n}" for n in (1, 2, 3)
    ]
    assert document["matrix"] == {
        "kill_member": {"prepare": "held"},
        "kill_fleet": {"after_snapshot": "violated"},
        "stop_member": {"restore": "not_reached"},
    }
    counter = next(row for row in document["summary"] if row["server"] == "counter")
    # Struck by trial 1 (target), 2 (the whole fleet) and 3 (the trigger); 1 held; 1 finding.
    assert counter == {
        "server": "counter",
        "kind": "resources",
        "trials": 3,
        "faults_survived": 1,
        "violations": 1,
    }
    assert [f["check"] for f in document["findings"]] == [
        "baseline_is_deterministic",
        "no_tool_call_applied_twice",
    ]
    assert document["findings"][1]["session"] == HOSTILE_ID
    assert (document["seconds"], document["trials_per_minute"]) == (6.5, 27.7)


def test_a_run_without_findings_holds() -> None:
    document = sample_report(violated=False).to_json()
    assert (document["verdict"], document["findings"]) == ("held", [])


def test_write_report_writes_both_files_whole_and_replaces_an_older_report(tmp_path: Path) -> None:
    directory = tmp_path / "report"
    json_path, html_path = write_report(directory, sample_report(violated=False))
    json_path, html_path = write_report(directory, sample_report())
    assert (json_path, html_path) == (directory / "report.json", directory / "report.html")
    assert sorted(p.name for p in directory.iterdir()) == ["report.html", "report.json"]
    assert load_report(json_path) == json.loads(json.dumps(sample_report().to_json()))
    assert html_path.read_text(encoding="utf-8") == render_html(sample_report().to_json())


def test_load_report_refuses_another_format(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"format": "rollout-checkpoint-certify/0", "verdict": "held"}))
    with pytest.raises(ReportFormatError, match="rollout-checkpoint-certify/0"):
        load_report(path)
    path.write_text("[1, 2]")
    with pytest.raises(ReportFormatError, match="list"):
        load_report(path)
    path.write_text('{"format": ')
    with pytest.raises(ReportFormatError, match="not a readable JSON document"):
        load_report(path)
    with pytest.raises(ReportFormatError, match="not a readable JSON document"):
        load_report(tmp_path / "missing.json")


class Page(HTMLParser):
    """The tags, attributes and text of a page, and the matrix cells by (fault, phase)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str | None]] = []
        self.text: list[str] = []
        self.cells: dict[tuple[str, str], tuple[str, str]] = {}
        self._cell: tuple[str, str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes += attrs
        found = dict(attrs)
        if tag == "td" and "data-fault" in found:
            self._cell = (str(found["data-fault"]), str(found["data-phase"]), str(found["class"]))

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            fault, phase, css = self._cell
            self.cells[(fault, phase)] = (css, data)
            self._cell = None


def parsed(page: str) -> Page:
    parser = Page()
    parser.feed(page)
    parser.close()
    return parser


def test_the_page_is_self_contained_and_shows_hostile_text_as_text() -> None:
    page = render_html(sample_report().to_json())
    seen = parsed(page)
    assert set(seen.tags) <= {
        "html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "table", "tr", "th",
        "td", "code", "span", "br",
    }  # fmt: skip
    assert not [value for _, value in seen.attributes if value and "://" in value]
    assert "://" not in page.split("<style>")[1].split("</style>")[0]  # no url() in the CSS
    assert "<img" not in page and "<script" not in page
    text = "".join(seen.text)
    assert HOSTILE_ID in text and HOSTILE_PATH in text  # shown as written, escaped once
    assert COMMAND + " --only 2" in text
    assert "restarted t2.0: its session was not in the checkpoint" in text


def test_every_matrix_cell_is_coloured_and_labelled() -> None:
    seen = parsed(render_html(sample_report().to_json()))
    assert len(seen.cells) == len(Fault) * len(Phase)
    assert seen.cells[("kill_member", "prepare")] == ("held", "held")
    assert seen.cells[("kill_fleet", "after_snapshot")] == ("violated", "violated")
    assert seen.cells[("stop_member", "restore")] == ("not_reached", "not reached")
    assert seen.cells[("storage", "publication")] == ("not-run", "not run")


def test_the_terminal_summary_prints_hostile_text_as_itself() -> None:
    console = Console(record=True, width=400, color_system=None)
    print_summary(console, sample_report())
    out = console.export_text()
    assert "2 violation(s) found" in out
    assert HOSTILE_ID in out  # rich markup in an id is printed, not interpreted
    assert "counter" in out and "not reached" in out and "no_tool_call_applied_twice" in out
    assert f"report rerun: {COMMAND}" in out
    console = Console(record=True, width=400, color_system=None)
    print_summary(console, sample_report(violated=False))
    out = console.export_text()
    assert "every check held" in out and "findings" not in out


def test_a_member_survives_a_trial_that_struck_it_when_no_finding_points_at_it() -> None:
    """A trial that struck one member and found another server's bug: the struck member
    survived its fault (the bug is the other server's), the other did not survive anything."""
    plan = TrialPlan(1, Fault.KILL_MEMBER, Phase.PREPARE, target="agent")
    bug = Violation(Check.EXPORTED_STATE_EQUALS_BASELINE, "differs", server="counter", trial=1)
    trials = [
        TrialResult(plan, Outcome.VIOLATED, [bug]),
        TrialResult(
            TrialPlan(2, Fault.KILL_MEMBER, Phase.RESTORE, target="agent"), Outcome.NOT_REACHED
        ),
    ]
    servers = [ServerFacts("agent", "agent"), ServerFacts("counter", "resources", "exported")]
    rows = {row.server: row for row in summaries(servers, trials, [])}
    assert (rows["agent"].trials, rows["agent"].faults_survived, rows["agent"].violations) == (
        2,
        1,
        0,
    )
    assert (
        rows["counter"].trials,
        rows["counter"].faults_survived,
        rows["counter"].violations,
    ) == (0, 0, 1)
