"""The README's five-minute tour runs as written: its shell blocks, in one shell, twice.

The tour is one text: README.md holds it, and docs/getting-started.md includes it.

Only what a parallel run needs is changed: the ports (free ones instead of 8001 and 9001) and
the checkpoint directory (under the test's tmp_path instead of /tmp/ckpt-1). The second run
shows that rerunning the tour does not trip over what the first one left behind.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .doc_pages import commands
from .doc_steps import free_port
from .processes import run_shell_script

DOC_SECTIONS = [("README.md", "A five-minute tour")]
TOUR_SECONDS = 180


def tour_script() -> str:
    blocks = commands(*DOC_SECTIONS[0])
    assert len(blocks) >= 4, "the tour lost its shell blocks"
    return "\n".join(blocks)


def test_the_five_minute_tour_runs_as_written_and_reruns(tmp_path: Path) -> None:
    script = tour_script()
    http, grpc = free_port(), free_port()
    checkpoint_dir = tmp_path / "ckpt-1"
    script = (
        script.replace("8001", str(http))
        .replace("9001", str(grpc))
        .replace("/tmp/ckpt-1", str(checkpoint_dir))
    )
    # Whatever happens, no server of the tour outlives it.
    script = "trap 'kill -9 $(jobs -p) 2>/dev/null' EXIT\n" + script
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        GRPC_VERBOSITY="ERROR",
    )
    for run in (1, 2):
        process = run_shell_script(script, tmp_path, env, TOUR_SECONDS)
        stdout, stderr = process.stdout, process.stderr
        context = f"run {run}\nstdout:\n{stdout}\nstderr:\n{stderr}"
        assert "Traceback" not in stderr, context
        assert "x-ng-checkpoint-verify: wait" in stdout.lower(), context
        assert '"state":{"count":5}' in stdout, context
        assert "participant-readiness: NOT_SERVING" in stdout, context
        assert stdout.rstrip().endswith('{"count":5}participant-readiness: SERVING') or (
            '{"count":5}' in stdout and stdout.rstrip().endswith("participant-readiness: SERVING")
        ), context
        assert process.returncode == 0, context
