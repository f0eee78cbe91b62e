"""deploy/grafana: the dashboard's every query reads what a real participant exports.

The metrics are derived, never listed by hand: a real participant (the double behind the
runtime, its metrics on a port of their own as in deploy/kubernetes) goes through a checkpoint
and refusals of both planes, and its `GET /metrics` exposition, parsed, is what the dashboard
may use. Every PromQL expression (and every template variable's query) is parsed
(`tests/promql.py`) and checked: each selector names an exported series; each label of a
matcher, a `by (...)` or an `on (...)` exists on the series it applies to (or is one of the
target labels Prometheus adds at scrape); each literal matcher value was seen in the
exposition; `rate`/`increase` read counters only; `histogram_quantile` reads `_bucket` series
aggregated by `le`. The structure is checked too: unique panel ids, a title and a description
on every panel, the `${datasource}` variable on every panel and target, panels that fit the
grid without overlapping. Every metric the participants export is on some panel. The checkers
are functions, and each is shown to catch a broken copy of the dashboard.

The ConfigMap kustomize generates from the JSON (deploy/grafana) validates strictly, carries the
sidecar's label and the file byte for byte, and docs/operations.md's command applies it. That
page's metrics table names every metric the same participant exports, every label, and every
value of a label with a closed set of values.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.server.core.rpc.handlers import snake_case
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from . import promql
from .conftest import REPO, refused, start_harness, stop_harness
from .doc_pages import commands
from .test_kubernetes import render, run_with_the_cluster_stubbed, validate_strictly

DOC_SECTIONS = [("docs/operations.md", "A Grafana dashboard")]
METRICS_TABLE = ("docs/operations.md", "Metrics, traces and logs")
BACKTICKED = re.compile(r"`([^`]+)`")
REASONS = frozenset(reason.value for reason in Reason)
RPC_NAMES = frozenset(
    snake_case(method.name)
    for method in pb.DESCRIPTOR.services_by_name["ParticipantService"].methods
)
OPEN_VALUES: Mapping[tuple[str, str], frozenset[str] | None] = {
    ("rollout_checkpoint_operation_duration_seconds", "operation"): RPC_NAMES,
    ("rollout_checkpoint_operation_duration_seconds", "outcome"): REASONS | {"ok", "cancelled"},
    ("rollout_checkpoint_readiness_count", "count"): None,  # each participant's own counts
}
"""Labels whose values the table names by where they come from, not one by one (None: any)."""

GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "rollout-checkpoint.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Prometheus attaches these to every sample it scrapes (the target's labels); they are not
# in the exposition, and they are what tells one participant from another.
TARGET_LABELS = frozenset({"job", "instance"})
# Grafana's own variables, substituted before Prometheus sees the query.
BUILTIN_VARIABLES = frozenset({"__rate_interval", "__range", "__interval"})
COUNTER_TYPES = frozenset({"counter", "histogram"})  # a histogram's series are counters
GRID_COLUMNS = 24
# `kubectl apply` (client-side) keeps the whole object in an annotation, and annotations are
# limited to 256 KiB in all: a larger dashboard would apply only with --server-side.
MOST_CONFIGMAP_BYTES = 256 * 1024 - 4096
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")


@dataclass(frozen=True)
class Series:
    """One exported series name: its family, the family's type, and label -> values seen."""

    family: str
    type: str
    labels: Mapping[str, frozenset[str]]


Exported = Mapping[str, Series]


def exported_series(exposition: str) -> dict[str, Series]:
    """Every series name of a Prometheus text exposition (a histogram `x` gives `x_bucket`,
    `x_sum`, `x_count`; a counter `x` gives `x_total`), with the labels each carries."""
    labels: dict[str, dict[str, set[str]]] = {}
    families: dict[str, tuple[str, str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            families[sample.name] = (family.name, family.type)
            seen = labels.setdefault(sample.name, {})
            for label, value in sample.labels.items():
                seen.setdefault(label, set()).add(value)
    return {
        name: Series(family, kind, {k: frozenset(v) for k, v in labels[name].items()})
        for name, (family, kind) in families.items()
    }


# -- the checkers ---------------------------------------------------------------------------


def all_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, a collapsed row's panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable; a variable's
    `label_values(SELECTOR, LABEL)` reads as `group by (LABEL) (SELECTOR)`, the PromQL that
    asks the same labels of the same series."""
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} {target.get('refId')}", target.get("expr", "")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            match = LABEL_VALUES.fullmatch(query)
            if match is not None:
                query = f"group by ({match['label']}) ({match['selector']})"
            yield f"variable ${variable['name']}", query


def structure_problems(dashboard: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables.get("datasource", {})
    if (source.get("type"), source.get("query")) != ("datasource", "prometheus"):
        problems.append("no ${datasource} variable of Prometheus data sources")
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 39:
        problems.append(f"schemaVersion {dashboard.get('schemaVersion')} predates Grafana 11")
    panels = list(all_panels(dashboard))
    ids = [str(panel.get("id")) for panel in panels]
    problems += [
        f"panel id {i} is used twice" for i in sorted({i for i in ids if ids.count(i) > 1})
    ]
    for panel in panels:
        problems += panel_problems(panel)
    problems += overlaps(panels)
    for where, expr in targets(dashboard):
        for braced, plain in VARIABLE.findall(expr):
            name = braced or plain
            if name not in variables and name not in BUILTIN_VARIABLES:
                problems.append(f"{where}: ${name} is no variable of the dashboard")
    return problems


def panel_problems(panel: Mapping[str, Any]) -> list[str]:
    title = panel.get("title")
    if not title:
        return [f"panel {panel.get('id')} has no title"]
    if panel.get("type") == "row":
        return []
    problems = []
    if not panel.get("description"):
        problems.append(f"panel {title!r} has no description")
    if panel.get("datasource") != DATASOURCE:
        problems.append(
            f"panel {title!r}: datasource {panel.get('datasource')} is not ${{datasource}}"
        )
    found = panel.get("targets", [])
    if not found:
        problems.append(f"panel {title!r} has no target")
    refs = [t.get("refId") for t in found]
    if len(set(refs)) != len(refs):
        problems.append(f"panel {title!r}: refIds {refs} repeat")
    for target in found:
        if target.get("datasource", DATASOURCE) != DATASOURCE:
            problems.append(f"panel {title!r} {target.get('refId')}: not on ${{datasource}}")
        if not target.get("expr"):
            problems.append(f"panel {title!r} {target.get('refId')}: no expression")
    return problems


def overlaps(panels: list[dict[str, Any]]) -> list[str]:
    """Panels wider than the grid or covering each other (Grafana would move them about)."""
    problems = []
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        if grid["x"] + grid["w"] > GRID_COLUMNS:
            problems.append(f"panel {panel['title']!r} is wider than the grid")
        for row in range(grid["y"], grid["y"] + grid["h"]):
            for column in range(grid["x"], grid["x"] + grid["w"]):
                other = taken.setdefault((row, column), panel["title"])
                if other != panel["title"]:
                    problems.append(f"panels {other!r} and {panel['title']!r} overlap")
                    break
    return sorted(set(problems))


def query_problems(dashboard: Mapping[str, Any], exported: Exported) -> list[str]:
    return [
        f"{where}: {problem}"
        for where, expr in targets(dashboard)
        for problem in expression_problems(expr, exported)
    ]


def expression_problems(expr: str, exported: Exported) -> list[str]:
    try:
        tree = promql.parse(expr)
    except promql.PromQLError as error:
        return [str(error)]
    problems = []
    for selector in promql.selectors(tree):
        problems += selector_problems(selector, exported)
    for node in promql.walk(tree):
        if isinstance(node, promql.Aggregation):
            problems += label_problems(node.grouping, node.args, f"{node.operator} by", exported)
        elif isinstance(node, promql.Binary):
            sides = (node.left, node.right)
            problems += label_problems(node.matching, sides, f"{node.operator} on", exported)
        elif isinstance(node, promql.Call):
            problems += call_problems(node, exported)
    return problems


def selector_problems(selector: promql.Selector, exported: Exported) -> list[str]:
    series = exported.get(selector.metric)
    if series is None:
        return [f"{selector.metric} is no series a participant exports"]
    problems = []
    for matcher in selector.matchers:
        if matcher.label in TARGET_LABELS:
            continue
        if matcher.label not in series.labels:
            problems.append(f"{selector.metric} has no label {matcher.label!r}")
        elif "$" not in matcher.value and not matches_a_value(matcher, series):
            problems.append(
                f"{selector.metric}{{{matcher.label}{matcher.op}{matcher.value!r}}} matches no "
                f"value exported ({sorted(series.labels[matcher.label])})"
            )
    return problems


def matches_a_value(matcher: promql.Matcher, series: Series) -> bool:
    """A negative matcher that excludes nothing is as wrong as a positive one that keeps
    nothing: both mean the value is misspelt."""
    seen = series.labels[matcher.label]
    if matcher.op in ("=", "!="):
        return matcher.value in seen
    return any(re.fullmatch(matcher.value, value) for value in seen)


def label_problems(
    labels: tuple[str, ...], over: tuple[promql.Node, ...], what: str, exported: Exported
) -> list[str]:
    problems = []
    for node in over:
        for selector in promql.selectors(node):
            series = exported.get(selector.metric)
            for label in labels:
                if series is not None and label not in {*series.labels, *TARGET_LABELS}:
                    problems.append(
                        f"{what} ({label}) over {selector.metric}, which has no {label}"
                    )
    return problems


def call_problems(call: promql.Call, exported: Exported) -> list[str]:
    problems = []
    if call.function in ("rate", "increase", "irate", "resets"):
        for selector in promql.selectors(call):
            series = exported.get(selector.metric)
            if series is not None and series.type not in COUNTER_TYPES:
                problems.append(f"{call.function} over {selector.metric}, a {series.type}")
            if selector.range is None:
                problems.append(f"{call.function} over {selector.metric} without a range")
    if call.function == "histogram_quantile":
        buckets = call.args[1]
        for selector in promql.selectors(buckets):
            if not selector.metric.endswith("_bucket"):
                problems.append(f"histogram_quantile over {selector.metric}, not a _bucket series")
        for node in promql.walk(buckets):
            if isinstance(node, promql.Aggregation) and (("le" in node.grouping) == node.without):
                problems.append(f"histogram_quantile over a {node.operator} that drops le")
    return problems


# -- a real participant's metrics -----------------------------------------------------------


@pytest.fixture(scope="module")
async def exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """What a participant serves on its metrics port after a checkpoint (prepare, commit,
    resume), an asynchronous one (its snapshot and background write) and a rejoining restore
    (discard, read, install): every phase, operation, records and bytes histogram has
    samples; and a refusal of each plane (refusals carry both labels)."""
    work = tmp_path_factory.mktemp("grafana")
    directory = str(work / "ckpt")
    h = await start_harness(metrics_address="127.0.0.1:0")
    try:
        assert (await h.http.post("/ng-rollout/r1/seed", json={"state": {"n": 1}})).is_success
        final = await h.client.prepare_until_final("ckpt-g1", h.deadline())
        assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
        await h.client.commit("ckpt-g1", h.deadline(), directory)
        closed = await h.http.post("/ng-rollout/r2/seed", json={"state": {}})
        assert closed.status_code == 409 and closed.json()["error"]["code"] == "admission_closed"
        await h.client.resume("ckpt-g1", h.deadline())
        await refused(h.client.commit("ckpt-g1", h.deadline(), directory), "STALE_CHECKPOINT")
        await h.client.prepare_until_final("ckpt-g2", h.deadline())
        await h.client.commit("ckpt-g2", h.deadline(), str(work / "async"), asynchronous=True)
        await h.client.resume("ckpt-g2", h.deadline())
        part = await h.client.await_part("ckpt-g2", h.deadline())
        assert part.state == pb.PART_WRITE_STATE_DURABLE
        restored = EpisodeId("r1")
        await h.client.restore("restore-g3", h.deadline(), directory, [restored], rejoin=True)
        await h.client.resume("restore-g3", h.deadline())
        assert h.runtime.metrics_address is not None
        async with httpx.AsyncClient(base_url=f"http://{h.runtime.metrics_address}") as http:
            response = await http.get("/metrics")
    finally:
        await stop_harness(h)
    assert response.status_code == 200, response.text
    return response.text


@pytest.fixture(scope="module")
def exported(exposition: str) -> dict[str, Series]:
    return exported_series(exposition)


def load_dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_the_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()
    assert structure_problems(dashboard) == []
    assert dashboard["uid"] and dashboard["id"] is None  # imports anywhere, updates in place
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= names
    assert sum(1 for p in all_panels(dashboard) if p["type"] != "row") >= 20


async def test_every_query_reads_series_a_real_participant_exports(exported: Exported) -> None:
    # The exposition is the real one: the families the runtime registers, with samples.
    assert exported["rollout_checkpoint_phase_duration_seconds_bucket"].labels["phase"] >= {
        "wait_ready", "export", "write",
    }  # fmt: skip
    assert exported["rollout_checkpoint_refusals_total"].labels["plane"] == {"control", "data"}
    assert query_problems(load_dashboard(), exported) == []


async def test_every_metric_the_participants_export_is_on_the_dashboard(
    exported: Exported,
) -> None:
    used = {
        selector.metric
        for _, expr in targets(load_dashboard())
        for selector in promql.selectors(promql.parse(expr))
    }
    # `x_created` (prometheus_client's creation timestamp of `x`) reads as a family of its
    # own; a timestamp is nothing to chart.
    families = {s.family for s in exported.values() if not s.family.endswith("_created")}
    shown = {exported[name].family for name in used if name in exported}
    assert families - shown == set()


# -- the checkers catch what they are for ---------------------------------------------------


def with_expression(dashboard: dict[str, Any], title: str, expr: str) -> dict[str, Any]:
    broken = copy.deepcopy(dashboard)
    (panel,) = [p for p in all_panels(broken) if p["title"] == title]
    panel["targets"][0]["expr"] = expr
    return broken


SELECTOR = 'job=~"$job", instance=~"$instance"'
BROKEN_QUERIES = [
    (
        f"sum(rollout_checkpoint_blocker{{{SELECTOR}}})",
        "rollout_checkpoint_blocker is no series a participant exports",
    ),
    (  # a histogram's family name is no series: its series are _bucket, _sum, _count
        f"sum(rate(rollout_checkpoint_bytes{{{SELECTOR}}}[$__rate_interval]))",
        "rollout_checkpoint_bytes is no series a participant exports",
    ),
    (
        f"sum by (kind) (rollout_checkpoint_blockers{{{SELECTOR}}})",
        "sum by (kind) over rollout_checkpoint_blockers, which has no kind",
    ),
    (
        f'sum(rollout_checkpoint_state{{{SELECTOR}, phase="IDLE"}})',
        "rollout_checkpoint_state has no label 'phase'",
    ),
    (
        f'sum(rollout_checkpoint_state{{{SELECTOR}, state="idle"}})',
        "rollout_checkpoint_state{state='idle'} matches no value exported",
    ),
    (
        f"sum(rate(rollout_checkpoint_blockers{{{SELECTOR}}}[$__rate_interval]))",
        "rate over rollout_checkpoint_blockers, a gauge",
    ),
    (
        "histogram_quantile(0.95, sum by (phase) (rate("
        f"rollout_checkpoint_phase_duration_seconds_bucket{{{SELECTOR}}}[$__rate_interval])))",
        "histogram_quantile over a sum that drops le",
    ),
    (
        f"histogram_quantil(0.95, rollout_checkpoint_blockers{{{SELECTOR}}})",
        "unknown function 'histogram_quantil'",
    ),
    (
        f"sum(rollout_checkpoint_blockers{{{SELECTOR}, instance=~$instance}})",
        "unquoted",
    ),
]


@pytest.mark.parametrize(("expr", "reported"), BROKEN_QUERIES)
async def test_the_query_checker_reports_a_broken_copy(
    exported: Exported, expr: str, reported: str
) -> None:
    broken = with_expression(load_dashboard(), "Blockers of a safe cut", expr)
    problems = query_problems(broken, exported)
    assert any(reported in problem for problem in problems), problems
    assert all(problem.startswith("panel 'Blockers of a safe cut' A: ") for problem in problems)


def test_the_structure_checker_reports_a_broken_copy() -> None:
    broken = load_dashboard()
    panels = [p for p in broken["panels"] if p["type"] != "row"]
    panels[1]["id"] = panels[0]["id"]
    del panels[2]["description"]
    panels[3]["datasource"] = {"type": "prometheus", "uid": "prometheus"}
    panels[4]["targets"] = []
    panels[5]["gridPos"] = dict(panels[6]["gridPos"])
    panels[7]["targets"][0]["expr"] += " * $scale"
    problems = structure_problems(broken)
    expected = [
        f"panel id {panels[0]['id']} is used twice",
        f"panel {panels[2]['title']!r} has no description",
        f"panel {panels[3]['title']!r}: datasource",
        f"panel {panels[4]['title']!r} has no target",
        f"panels {panels[5]['title']!r} and {panels[6]['title']!r} overlap",
        "$scale is no variable of the dashboard",
    ]
    for problem in expected:
        assert any(problem in found for found in problems), (problem, problems)


# -- the ConfigMap and the page -------------------------------------------------------------


def test_the_page_applies_the_dashboard_configmap(tmp_path: Path) -> None:
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    calls = run_with_the_cluster_stubbed(tmp_path, "\n".join(commands(*DOC_SECTIONS[0])))
    ((tool, *args),) = calls
    assert tool == "kubectl" and args[:2] == ["-n", "monitoring"], calls
    assert args[2:4] == ["apply", "-k"] and (tmp_path / args[4]).resolve() == GRAFANA.resolve()
    rendered = render(GRAFANA)
    validate_strictly(rendered, "kustomize build deploy/grafana")
    (configmap,) = rendered
    assert configmap["kind"] == "ConfigMap"
    assert configmap["metadata"]["name"] == "rollout-checkpoint-dashboard"  # no hash suffix
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {DASHBOARD.name: DASHBOARD.read_text()}
    assert len(json.dumps(configmap).encode()) < MOST_CONFIGMAP_BYTES


# -- docs/operations.md's metrics table -----------------------------------------------------


def metrics_table(markdown: str) -> dict[str, str]:
    """Each metric the table names -> its row's labels cell."""
    heading = f"## {METRICS_TABLE[1]}\n"
    section = markdown.split(heading, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 2:
            rows.update((name, cells[1]) for name in BACKTICKED.findall(cells[0]))
    return rows


def table_problems(table: Mapping[str, str], exposition: str) -> list[str]:
    """What the table leaves out of (or adds to) a participant's exposition: a metric not
    named or not exported, a label not named in its row, a label value not named there
    (unless `OPEN_VALUES` or a control refusal's reason, each checked against its source)."""
    families = {f.name: f for f in text_string_to_metric_families(exposition) if f.samples}
    problems = []
    rows = {}
    for name, cell in table.items():
        # A counter's family is its name without `_total`, the series the table names.
        family = name.removesuffix("_total") if name.removesuffix("_total") in families else name
        rows[family] = cell
        if family not in families:
            problems.append(f"the table names {name}, which is not exported")
    for name, family in families.items():
        if name.endswith("_created"):  # prometheus_client's creation timestamps
            continue
        cell = rows.get(name)
        if cell is None:
            problems.append(f"{name} is exported and not in the table")
            continue
        for sample in family.samples:
            problems += [
                f"{name}{{{label}={value!r}}}: {problem}"
                for label, value in sample.labels.items()
                if label != "le" and (problem := value_problem(name, sample.labels, label, cell))
            ]
    return sorted(set(problems))


def value_problem(family: str, labels: Mapping[str, str], label: str, cell: str) -> str:
    value = labels[label]
    if f"`{label}`" not in cell:
        return f"its row does not name the label `{label}`"
    if (family, label) in OPEN_VALUES:
        allowed = OPEN_VALUES[family, label]
        return "" if allowed is None or value in allowed else "not a value of its source"
    if (family, label, labels.get("plane")) == ("rollout_checkpoint_refusals", "reason", "control"):
        return "" if value in REASONS else "a control refusal's reason that is no ErrorInfo reason"
    return "" if value in BACKTICKED.findall(cell) else "its row does not name the value"


def test_the_metrics_table_names_every_metric_label_and_value_exported(exposition: str) -> None:
    table = metrics_table((REPO / METRICS_TABLE[0]).read_text())
    problems = table_problems(table, exposition)
    assert problems == [], "\n".join(problems)


def test_the_table_checker_reports_what_a_table_leaves_out(exposition: str) -> None:
    table = metrics_table((REPO / METRICS_TABLE[0]).read_text())
    broken = {name: cell.replace("`discard`", "discard") for name, cell in table.items()}
    del broken["rollout_checkpoint_blockers"]
    broken["rollout_checkpoint_pauses"] = "—"
    broken["rollout_checkpoint_state"] = "`state`: `IDLE`"
    problems = table_problems(broken, exposition)
    for expected in [
        "rollout_checkpoint_blockers is exported and not in the table",
        "the table names rollout_checkpoint_pauses, which is not exported",
        "rollout_checkpoint_phase_duration_seconds{phase='discard'}: its row does not name "
        "the value",
        "rollout_checkpoint_state{state='COMMITTED'}: its row does not name the value",
    ]:
        assert expected in problems, problems
    assert len(problems) == 4 + 3, problems  # and PREPARING, PREPARED, RESTORED
