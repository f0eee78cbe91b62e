"""The proto contract and its generated code: buf lint/format/breaking and gen/ freshness.

These run as tests (not only as steps of scripts/test) so a contract problem shows up in
the test report next to everything else. The tools are taken from the interpreter's own
bin/ (the venv scripts/test installs), never from PATH, so a stray system buf cannot
answer in their place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
BUF = BIN / "buf"
# The last released contract; rewritten only on purpose by scripts/refresh-baseline.
BASELINE = "protos/baseline/v1.binpb"


def run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_buf_lint() -> None:
    # STANDARD + COMMENTS (buf.yaml): COMMENTS is what requires a leading comment on
    # every service, RPC, message, field, oneof, enum and enum value.
    proc = run(BUF, "lint")
    assert proc.returncode == 0, explain(proc)


def test_buf_lint_requires_leading_comments() -> None:
    # Guard for the test above: the "everything is documented" rule lives only in
    # buf.yaml, so make sure it is still switched on for our module.
    proc = run(
        BUF,
        "config",
        "ls-lint-rules",
        "--configured-only",
        "--module-path",
        "protos",
        "--format",
        "json",
    )
    assert proc.returncode == 0, explain(proc)
    rules = {json.loads(line)["id"] for line in proc.stdout.splitlines() if line.strip()}
    required = {
        "COMMENT_SERVICE",
        "COMMENT_RPC",
        "COMMENT_MESSAGE",
        "COMMENT_FIELD",
        "COMMENT_ONEOF",
        "COMMENT_ENUM",
        "COMMENT_ENUM_VALUE",
    }
    assert required <= rules, f"buf.yaml no longer enforces {sorted(required - rules)}"


def test_buf_format() -> None:
    proc = run(BUF, "format", "-d", "--exit-code")
    assert proc.returncode == 0, "protos are not buf-formatted (run `buf format -w`)\n" + explain(
        proc
    )


def test_buf_breaking_against_baseline() -> None:
    assert (REPO / BASELINE).is_file(), f"{BASELINE} is missing: run scripts/refresh-baseline"
    # `protos` alone: the vendored googleapis module is never breaking-checked.
    proc = run(BUF, "breaking", "protos", "--against", BASELINE)
    assert proc.returncode == 0, (
        "the contract breaks the released baseline; if that is intended, run "
        "scripts/refresh-baseline and commit it with the reason\n" + explain(proc)
    )


def tree(root: Path) -> dict[str, bytes]:
    # __pycache__ appears in gen/ as soon as anything imports the generated modules.
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_gen_is_fresh(tmp_path: Path) -> None:
    # PYTHON pins the generator to this interpreter, so the same grpcio-tools and
    # mypy-protobuf that the tests import are the ones that write the code.
    env = {**os.environ, "PYTHON": sys.executable}
    proc = run("bash", "scripts/generate", tmp_path, env=env)
    assert proc.returncode == 0, explain(proc)
    fresh = tree(tmp_path)
    committed = tree(REPO / "gen")
    assert fresh, "the generator wrote nothing"
    stale = sorted(
        set(fresh) ^ set(committed)
        | {name for name in fresh.keys() & committed.keys() if fresh[name] != committed[name]}
    )
    assert not stale, "gen/ is stale: run scripts/generate and commit. Differs: " + ", ".join(stale)
