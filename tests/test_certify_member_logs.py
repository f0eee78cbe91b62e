"""Which lines of a member's log are untyped failures (`every_refusal_is_typed`).

The logs are written the way `rollout-checkpoint serve` writes them (`configure_logging`, text
and JSON lines), by the loggers that write them in a fleet: an application's own logger for an
error it handled (NeMo Gym's IPI server logs every tool call its handler rejects, then answers
200 with the error as the tool's output), uvicorn for an exception that escaped a route, and a
process dying of one (a bare traceback). The finding names the member whose log it was.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_checkpoint.client.certify.findings import Check
from rollout_checkpoint.client.certify.member_logs import untyped_in_log, untyped_lines
from rollout_checkpoint.server.runtime.logs import configure_logging

from .certify_runs import baseline, like
from .test_certify_invariants import checks, only

NEMO_GYM_IPI = "resources_servers.indirect_prompt_injection.app"
HANDLED_TOOL_ERROR = """\
2026-12-06 05:53:21,245 ERROR resources_servers.indirect_prompt_injection.app [checkpoint_id=]: \
Tool 'prescribe_medication' raised TypeError
Traceback (most recent call last):
  File "/env/site-packages/resources_servers/indirect_prompt_injection/app.py", line 141, \
in route_tool_call
    result = handler(env, **args)
             ^^^^^^^^^^^^^^^^^^^^
TypeError: prescribe_medication() missing 1 required positional argument: 'instructions'
"""
"""Verbatim (but the path) from NeMo Gym 0.4.0's IPI server under `serve nemo-gym:...`."""
BARE = """\
INFO:     Started server process [4242]
Traceback (most recent call last):
  File "/app/server.py", line 9, in <module>
    main()
RuntimeError: the export hook's table is gone
"""


@dataclass
class ServedLog:
    """A log handler as `serve` configures it, writing into `stream`."""

    handler: logging.Handler
    stream: io.StringIO

    def exception(self, logger: str, message: str, error: Exception) -> None:
        """What `logging.getLogger(logger).exception(message)` writes while `error` is
        handled: the record goes to the handler directly, whatever level or propagation
        another test left that logger with (uvicorn's own config stops its loggers from
        propagating)."""
        try:
            raise error
        except type(error):
            record = logging.getLogger(logger).makeRecord(
                logger, logging.ERROR, __file__, 0, message, None, sys.exc_info()
            )
        self.handler.handle(record)


@pytest.fixture(params=[False, True], ids=["text", "json"])
def served_log(request: pytest.FixtureRequest) -> Iterator[ServedLog]:
    """`configure_logging` as `serve` calls it (text, then JSON lines), into a buffer; the
    root logger's handlers and level as they were afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    handler = configure_logging("INFO", json_lines=request.param, stream=stream)
    try:
        yield ServedLog(handler, stream)
    finally:
        for added in list(root.handlers):
            root.removeHandler(added)
        for kept in handlers:
            root.addHandler(kept)
        root.setLevel(level)


def test_a_traceback_the_application_logged_for_an_error_it_handled_is_not_untyped(
    served_log: ServedLog,
) -> None:
    served_log.exception(NEMO_GYM_IPI, "Tool 'x' raised TypeError", TypeError("x() got 'note'"))
    served_log.exception("my_server.tools", "lookup failed", KeyError("P1"))
    assert untyped_lines(served_log.stream.getvalue()) == []
    assert untyped_lines(HANDLED_TOOL_ERROR) == []


def test_a_traceback_that_escaped_the_servers_code_is_untyped(served_log: ServedLog) -> None:
    served_log.exception("uvicorn.error", "Exception in ASGI application", ValueError("boom"))
    served_log.exception("asyncio", "Task exception was never retrieved", OSError("disk"))
    served_log.exception(
        "rollout_checkpoint.server.runtime.sidecar", "export failed", RuntimeError("hook")
    )
    found = untyped_lines(served_log.stream.getvalue())
    assert [line.rsplit(": ", 2)[-2:] for line in found] == [
        ["ValueError", "boom"],
        ["OSError", "disk"],
        ["RuntimeError", "hook"],
    ], found
    assert all(line.startswith("Traceback (most recent call last):") for line in found)


def test_a_bare_traceback_and_an_internal_status_are_untyped() -> None:
    assert untyped_lines(BARE) == [
        "Traceback (most recent call last): RuntimeError: the export hook's table is gone"
    ]
    internal = "2026-12-06 05:53:21,245 ERROR my_server [checkpoint_id=]: StatusCode.INTERNAL x"
    assert untyped_lines(internal) == [internal]


def test_the_finding_names_the_member_whose_log_it_was(tmp_path: Path) -> None:
    log = tmp_path / "counter.2.err"
    log.write_text(HANDLED_TOOL_ERROR + BARE)
    (line,) = untyped_in_log("counter", log)
    assert line == (
        "counter: counter.2.err: Traceback (most recent call last): "
        "RuntimeError: the export hook's table is gone"
    )
    base = baseline()
    run = like(base)
    run.untyped = [line]
    assert only(checks(run, base), Check.REFUSALS_TYPED).server == "counter"
    assert untyped_in_log("counter", tmp_path / "none.err") == []
