"""The suite's own safety nets.

* A hung test fails alone: pytest-timeout (pyproject: timeout, signal method) interrupts it,
  conftest cancels a timed-out async test so its clean-ups run, and the run goes on.
* A server process that never announces its addresses fails its test within a bound, and is
  killed, instead of hanging the run (tests/processes.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .processes import REPO, announcement, start


def test_a_hung_test_fails_alone_and_the_run_goes_on(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=2",
            f"--junitxml={report}",
            "tests/timeout_probe.py",
        ],
        cwd=REPO,
        env=dict(os.environ, TIMEOUT_PROBE_FLAG=str(tmp_path / "flag")),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert report.exists(), run.stdout + run.stderr
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        outcomes[case.get("name")] = "passed" if failure is None else failure.get("message")
    timed_out = "Failed: Timeout (>2.0s) from pytest-timeout."
    assert outcomes == {
        "test_an_async_test_that_hangs": timed_out,
        "test_the_next_test_runs_after_its_clean_up": "passed",
        "test_a_blocking_read_that_hangs": timed_out,
        "test_the_run_goes_on": "passed",
    }, run.stdout


def test_a_server_that_never_announces_fails_within_the_bound_and_is_killed() -> None:
    silent = start([sys.executable, "-c", "import time; time.sleep(600)"])
    with pytest.raises(AssertionError, match=r"the silent one .* announced nothing within 1 s"):
        announcement(silent, "the silent one", timeout=1)
    assert silent.returncode == -signal.SIGKILL


def test_a_server_that_exits_or_prints_something_else_is_named_with_its_log(
    tmp_path: Path,
) -> None:
    log = tmp_path / "stderr.log"
    failing = start([sys.executable, "-c", "import sys; sys.exit('no port today')"], log=log)
    with pytest.raises(AssertionError, match=r"(?s)the failing one exited with 1 .*no port today"):
        announcement(failing, "the failing one", log=log)
    chatty = start([sys.executable, "-c", "import time; print('hello'); time.sleep(600)"])
    with pytest.raises(AssertionError, match=r"the chatty one announced .hello\\n."):
        announcement(chatty, "the chatty one")
    assert chatty.returncode == -signal.SIGKILL
