"""Results as JSON (everything, with the samples) and as Markdown tables, and a short summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _spread(entry: dict[str, Any]) -> str:
    return f"{number(entry['min'])}-{number(entry['max'])}"


def _machine_line(payload: dict[str, Any]) -> str:
    info = payload["machine"]
    return (
        f"scale `{payload['scale']}`, {info['cores']} cores ({info['cpu_model']}), "
        f"Python {info['python']}, load average {info['load_average_at_start'][0]} at the start; "
        f"finished {payload['finished_at']} in {payload['seconds']:.0f} s. Every figure is the "
        f"median over its repeats with the {payload['spread']} over the same repeats (n); "
        "every ratio is the median of per-repeat ratios of runs interleaved in this invocation."
    ) + _earlier_run(payload)


def _earlier_run(payload: dict[str, Any]) -> str:
    """Which results a `--merge` kept from earlier runs, and when each of those finished."""
    runs = payload.get("earlier_runs") or (
        [payload["earlier_run"]] if payload.get("earlier_run") else []
    )
    if not runs:
        return ""
    kept = "; ".join(
        f"{', '.join(run['benchmarks'])} from the run finished {run['finished_at']}" for run in runs
    )
    return f" Kept from earlier runs (`--merge`): {kept}."


def markdown(payload: dict[str, Any]) -> str:
    lines = ["# rollout-checkpoint benchmarks", "", _machine_line(payload), ""]
    for result in payload["benchmarks"].values():
        lines += [f"## {result['title']}", "", result["measures"], ""]
        if result.get("skipped"):
            lines += [f"Skipped: {result['skipped']}", ""]
            continue
        lines += ["| case | metric | median | min-max | n |", "| --- | --- | ---: | ---: | ---: |"]
        for figure in result["figures"]:
            note = f" ({figure['note']})" if figure["note"] else ""
            lines.append(
                f"| {figure['case']}{note} | {figure['metric']} | "
                f"{number(figure['median'])} {figure['unit']} | {_spread(figure)} | {figure['n']} |"
            )
        if result["ratios"]:
            lines += ["", "| ratio | median | min-max | n |", "| --- | ---: | ---: | ---: |"]
            for ratio in result["ratios"]:
                note = f" ({ratio['note']})" if ratio["note"] else ""
                lines.append(
                    f"| {ratio['name']}{note} | {number(ratio['median'])}x | "
                    f"{_spread(ratio)} | {ratio['n']} |"
                )
        lines.append("")
    return "\n".join(lines)


def write(payload: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "latest.json"
    md_path = directory / "latest.md"
    json_path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    md_path.write_text(markdown(payload))
    return json_path, md_path


def summary(payload: dict[str, Any]) -> str:
    lines = [_machine_line(payload), ""]
    for result in payload["benchmarks"].values():
        lines.append(f"{result['title']}  ({result['seconds']:.0f} s)")
        if result.get("skipped"):
            lines.append(f"  skipped: {result['skipped']}")
        for figure in result["figures"]:
            lines.append(
                f"  {figure['case']:<56} {figure['metric']:<46} "
                f"{number(figure['median']):>8} {figure['unit']:<10} [{_spread(figure)}]"
            )
        for ratio in result["ratios"]:
            lines.append(
                f"  ratio {ratio['name']:<96} {number(ratio['median']):>7}x [{_spread(ratio)}]"
            )
        lines.append("")
    return "\n".join(lines)
