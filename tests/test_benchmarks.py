"""The benchmarks still run: `python -m benchmarks --scale tiny` end to end, in a subprocess.

This proves every benchmark starts its servers, drives them and reports numbers. It never
asserts on speed: the figures are reported, not gates. The NeMo Gym one needs the cached
nemo-gym env (`scripts/nemo-gym-env`, which `scripts/test` builds): where it is built it must
report numbers, where it is not it must say so and report none. The object-store one needs the
cached SeaweedFS binary (`scripts/seaweedfs`, which `scripts/test` builds), likewise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.object_store import built_weed

from .nemo_gym.beside import BesideError, ready_env

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = (
    "prepare",
    "throughput",
    "dataplane",
    "control",
    "fleet",
    "light",
    "bounded",
    "nemo_gym",
    "object_store",
    "workers",
    "async_commit",
    "incremental",
)


def nemo_gym_env_is_built() -> bool:
    try:
        ready_env()
    except BesideError:
        return False
    return True


def run_benchmark(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` from the repository root; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=dict(os.environ, GRPC_VERBOSITY="ERROR"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def test_every_benchmark_runs_at_the_tiny_size_and_reports_numbers(tmp_path: Path) -> None:
    output = tmp_path / "results"
    run_benchmark("benchmarks", "--scale", "tiny", "--quiet", "--output", str(output))
    payload = json.loads((output / "latest.json").read_text())
    assert payload["scale"] == "tiny"
    assert set(payload["benchmarks"]) == set(BENCHMARKS)
    skipped = payload["benchmarks"]["nemo_gym"]["skipped"]
    if nemo_gym_env_is_built():
        assert skipped == "", skipped
    else:
        assert skipped.startswith("no nemo-gym env here (nemo-gym-env: "), skipped
        assert not payload["benchmarks"].pop("nemo_gym")["figures"]
    skipped = payload["benchmarks"]["object_store"]["skipped"]
    if built_weed() is not None:
        assert skipped == "", skipped
    else:
        assert skipped.startswith("no SeaweedFS weed binary built here"), skipped
        assert not payload["benchmarks"].pop("object_store")["figures"]
    for name, result in payload["benchmarks"].items():
        assert result["figures"], name
        assert not result["skipped"], (name, result["skipped"])
        for figure in result["figures"]:
            assert figure["n"] >= 1, (name, figure)
            for key in ("median", "min", "max"):
                value = figure[key]
                assert isinstance(value, int | float) and math.isfinite(value), (name, figure)
        for ratio in result["ratios"]:
            assert isinstance(ratio["median"], int | float) and ratio["median"] > 0, (name, ratio)
    markdown = (output / "latest.md").read_text()
    for result in payload["benchmarks"].values():
        assert result["title"] in markdown


def test_merging_twice_credits_each_kept_result_to_the_run_it_came_from(tmp_path: Path) -> None:
    """`--merge` of one benchmark onto results that were themselves merged: the results kept
    from the oldest run still name that run, not the newer one they passed through."""
    from benchmarks.__main__ import merged
    from benchmarks.report import markdown

    def run(finished_at: str, *names: str, **extra: object) -> dict[str, object]:
        machine = {"cores": 2, "cpu_model": "x", "python": "3.11", "load_average_at_start": [0]}
        results = {
            name: {"title": name, "measures": "", "figures": [], "ratios": []} for name in names
        }
        return {
            "scale": "default",
            "params": {},
            "spread": "min-max",
            "machine": machine,
            "seconds": 1.0,
            "finished_at": finished_at,
            "benchmarks": results,
            **extra,
        }

    oldest = run("2026-01-01", "prepare", "light")
    previous = tmp_path / "latest.json"
    previous.write_text(json.dumps(oldest))
    middle = merged(run("2026-02-01", "light"), previous)
    previous.write_text(json.dumps(middle))
    newest = merged(run("2026-03-01", "nemo_gym"), previous)

    assert set(newest["benchmarks"]) == {"prepare", "light", "nemo_gym"}
    assert [(r["benchmarks"], r["finished_at"]) for r in newest["earlier_runs"]] == [
        (["prepare"], "2026-01-01"),
        (["light"], "2026-02-01"),
    ]
    assert "prepare from the run finished 2026-01-01; light from the run finished 2026-02-01" in (
        markdown(newest)
    )
    # The single `earlier_run` of results merged before this form is read the same way.
    legacy = run(
        "2026-02-01", "prepare", "light", earlier_run={**oldest, "benchmarks": ["prepare"]}
    )
    previous.write_text(json.dumps(legacy))
    again = merged(run("2026-03-01", "nemo_gym"), previous)
    assert [(r["benchmarks"], r["finished_at"]) for r in again["earlier_runs"]] == [
        (["prepare"], "2026-01-01"),
        (["light"], "2026-02-01"),
    ]


def test_the_history_cost_benchmark_runs_and_reports_both_sides() -> None:
    """`benchmarks.history_cost` (issue 32's ratio) on a tiny fleet: one JSON line with both
    sides of every figure, and only the side with history spending time on a record."""
    proc = run_benchmark("benchmarks.history_cost", "--members", "8", "--rounds", "2")
    figures = json.loads(proc.stdout)["figures"]
    for figure in ("pause", "total", "cpu"):
        ratio = figures[figure]["ratio_with_over_without"]
        assert ratio["n"] == 2 and all(r > 0 for r in ratio["samples"]), figures
    record = figures["record"]
    assert record["with_history_seconds"]["median"] > record["without_seconds"]["median"]
