"""The benchmarks still run: `python -m benchmarks --scale tiny` end to end, in a subprocess.

This proves every benchmark starts its servers, drives them and reports numbers. It never
asserts on speed: the figures are reported, not gates. The NeMo Gym one needs the cached
nemo-gym env (`scripts/nemo-gym-env`, which `scripts/test` builds): where it is built it must
report numbers, where it is not it must say so and report none.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from .nemo_gym.beside import BesideError, ready_env

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = ("prepare", "throughput", "dataplane", "control", "fleet", "light", "nemo_gym")


def nemo_gym_env_is_built() -> bool:
    try:
        ready_env()
    except BesideError:
        return False
    return True


def test_every_benchmark_runs_at_the_tiny_size_and_reports_numbers(tmp_path: Path) -> None:
    output = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--scale", "tiny", "--quiet", "--output", str(output)],
        cwd=REPO,
        env=dict(os.environ, GRPC_VERBOSITY="ERROR"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    payload = json.loads((output / "latest.json").read_text())
    assert payload["scale"] == "tiny"
    assert set(payload["benchmarks"]) == set(BENCHMARKS)
    skipped = payload["benchmarks"]["nemo_gym"]["skipped"]
    if nemo_gym_env_is_built():
        assert skipped == "", skipped
    else:
        assert skipped.startswith("no nemo-gym env here (nemo-gym-env: "), skipped
        assert not payload["benchmarks"].pop("nemo_gym")["figures"]
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
