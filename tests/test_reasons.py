"""One source of truth for error reasons: errors.proto.

The runtime's `Reason` enum and its table of default codes must name exactly the
`ErrorReason` values of errors.proto (without the `ERROR_REASON_` prefix); importing
`server.core.errors` fails when they drift apart, and these tests fail with it. The
controllers' own reason strings come from the same enum.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from google.rpc import code_pb2

from rollout_checkpoint.server.core import errors
from rollout_checkpoint.server.core.errors import DEFAULT_CODES, Reason
from rollout_checkpoint.v1 import errors_pb2

REPO = Path(__file__).resolve().parent.parent


def _proto_reasons() -> set[str]:
    """Read independently of the module under test: every ErrorReason but UNSPECIFIED."""
    return {
        value.name.removeprefix("ERROR_REASON_")
        for value in errors_pb2.ErrorReason.DESCRIPTOR.values
        if value.name != "ERROR_REASON_UNSPECIFIED"
    }


def test_every_reason_of_errors_proto_is_in_the_runtime_table_and_back() -> None:
    proto = _proto_reasons()
    assert {reason.value for reason in Reason} == proto
    assert {reason.value for reason in DEFAULT_CODES} == proto


def test_every_default_code_is_a_google_rpc_code() -> None:
    for reason, code in DEFAULT_CODES.items():
        assert code in {v.name for v in code_pb2.Code.DESCRIPTOR.values}, (reason, code)
        assert code != "OK", reason


@pytest.mark.parametrize("drift", ["extra-in-proto", "missing-in-proto"])
def test_the_import_check_fails_when_the_proto_and_the_table_differ(
    monkeypatch: pytest.MonkeyPatch, drift: str
) -> None:
    proto = errors.proto_reasons()
    changed = proto | {"A_NEW_REASON"} if drift == "extra-in-proto" else proto - {"TASK_MISMATCH"}
    monkeypatch.setattr(errors, "proto_reasons", lambda: changed)
    with pytest.raises(ImportError, match=r"out of step with errors\.proto"):
        errors._check_against_proto()


def test_controllers_spell_no_reason_as_a_string_literal() -> None:
    """Reasons in client/ come from `Reason` (or the wire), never from a retyped string."""
    reasons = _proto_reasons()
    found = []
    for path in sorted((REPO / "client").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in reasons:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert found == []
