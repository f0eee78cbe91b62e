"""Cross-language conformance: Node.js, Go, Rust and Java controllers drive a real participant.

Each test starts the counter example (`python -m rollout_checkpoint.examples.serve counter`)
as its own process group, a start-closed replacement of it (`--start-closed`) and a
`rollout-checkpoint coordinator` whose fleet is that counter, then runs one controller as a
subprocess with the addresses and the token in its environment (CONFORMANCE_GRPC_ADDRESS,
CONFORMANCE_HTTP_ADDRESS, CONFORMANCE_TOKEN, CONFORMANCE_COORDINATOR_ADDRESS,
CONFORMANCE_REPLACEMENT_GRPC_ADDRESS, CONFORMANCE_REPLACEMENT_HTTP_ADDRESS). The controllers
(tests/conformance/node/controller.js, tests/conformance/go/main.go,
tests/conformance/rust/src/main.rs, tests/conformance/java/controller/) check GetParticipant, a
seeded session, the Prepare stream, Commit (manifest and records on disk), Resume, refusals
decoded to typed reasons (STALE_CHECKPOINT, CHECKPOINT_DEADLINE_EXCEEDED with its `deadline`
metadata parsed, TOKEN_INVALID, PARTICIPANT_FAILED with `failedMembers`,
FRESH_PROCESS_REQUIRED), health Check without a token, CoordinatorService
Checkpoint (the Go one also ListParticipants), and a Restore into the start-closed replacement
watched through health Watch (readiness NOT_SERVING, then SERVING once resumed), ending with
the restored session read over HTTP as attempt 1.

They use only this repository's packages for the contract: the Go module gen/go (a `replace`
directive), the npm package gen/ts (a `file:` dependency, built by `npm ci` there), the
crate gen/rust (a `path` dependency) and the Maven package gen/java (a module of the
controller's reactor build), with no codegen and no helpers of their own.
scripts/test installs what they need (`npm ci`, `go mod download`, `cargo fetch` and a build
into the cache, scripts/cargo; a Maven build into the cache's repository, scripts/maven). A
test skips only when node, go, cargo or java and mvn are not installed at all; a missing
install step fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import processes
from .conftest import REPO, TOKEN, kill_group
from .processes import announcement, run

CONFORMANCE = REPO / "tests" / "conformance"
NODE_DIR = CONFORMANCE / "node"
GO_DIR = CONFORMANCE / "go"
RUST_DIR = CONFORMANCE / "rust"
JAVA_DIR = CONFORMANCE / "java"
SCRIPTS = REPO / "scripts"


def explain(proc: subprocess.CompletedProcess[str], *server_logs: Path) -> str:
    """The command, its output and the servers' stderr, for an assertion message."""
    parts = [f"$ {' '.join(map(str, proc.args))}  (exit {proc.returncode})"]
    parts += [f"--- stdout\n{proc.stdout}", f"--- stderr\n{proc.stderr}"]
    for log in server_logs:
        if log.exists():
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')}")
    return "\n".join(parts)


class Counter:
    """A running counter example: its addresses and the controllers' environment."""

    def __init__(self, announcement: dict[str, str], log: Path) -> None:
        self.grpc = announcement["grpc"]
        self.http = announcement["http"]
        self.log = log

    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            CONFORMANCE_GRPC_ADDRESS=self.grpc,
            CONFORMANCE_HTTP_ADDRESS=self.http,
            CONFORMANCE_TOKEN=TOKEN,
        )


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """Start a server in its own process group; its stderr goes to `log`."""
    return processes.start(command, env=dict(env, GRPC_VERBOSITY="ERROR"), log=log)


def serve_counter(log: Path, *flags: str) -> Iterator[Counter]:
    """A counter example (`serve counter` with `flags`) for the length of a fixture."""
    command = [sys.executable, "-m", "rollout_checkpoint.examples.serve", "counter"]
    process = start([*command, "--token", TOKEN, *flags], log, dict(os.environ))
    try:
        yield Counter(announcement(process, f"the counter {' '.join(flags)}", log=log), log)
    finally:
        kill_group(process)


@pytest.fixture
def counter(tmp_path: Path) -> Iterator[Counter]:
    yield from serve_counter(tmp_path / "participant.log")


@pytest.fixture
def replacement(counter: Counter, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A start-closed counter of the same instance: the controllers restore their commit there.
    Its addresses, as the controllers' environment adds them."""
    for started in serve_counter(tmp_path / "replacement.log", "--start-closed"):
        yield {
            "CONFORMANCE_REPLACEMENT_GRPC_ADDRESS": started.grpc,
            "CONFORMANCE_REPLACEMENT_HTTP_ADDRESS": started.http,
        }


@pytest.fixture
def coordinator(counter: Counter, tmp_path: Path) -> Iterator[str]:
    """`rollout-checkpoint coordinator` over a fleet of that one counter; its gRPC address."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        'token_env = "CONFORMANCE_TOKEN"\n'
        f'checkpoint_root = "{tmp_path / "fleet-root"}"\n'
        f'[[participants]]\nname = "counter"\naddress = "{counter.grpc}"\n'
    )
    log = tmp_path / "coordinator.log"
    command = [sys.executable, "-m", "rollout_checkpoint.client.cli.main", "coordinator"]
    command += ["--fleet", str(fleet), "--grpc-address", "127.0.0.1:0"]
    process = start(command, log, counter.env())
    try:
        yield announcement(process, "the coordinator", log=log)["grpc"]
    finally:
        kill_group(process)


def server_logs(tmp_path: Path) -> tuple[Path, ...]:
    """The stderr of the counter, the coordinator and the replacement, for a failure."""
    return tuple(tmp_path / f"{name}.log" for name in ("participant", "coordinator", "replacement"))


def test_node_controller(
    counter: Counter, coordinator: str, replacement: dict[str, str], tmp_path: Path
) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the Node.js conformance controller needs Node 20+")
    package = NODE_DIR / "node_modules" / "@rollout-checkpoint" / "client"
    if not (package / "dist" / "index.js").is_file():
        pytest.fail(
            f"{package} is not installed and built: run scripts/test (`npm ci` in gen/ts, "
            "which builds the package, then in tests/conformance/node)"
        )
    env = dict(counter.env(), CONFORMANCE_COORDINATOR_ADDRESS=coordinator, **replacement)
    proc = run(node, "controller.js", cwd=NODE_DIR, env=env)
    print(proc.stdout)  # the controller's progress, shown with -rP or -s
    logs = server_logs(tmp_path)
    assert proc.returncode == 0, explain(proc, *logs)
    assert "node controller: all" in proc.stdout, explain(proc, *logs)


def test_go_controller(
    counter: Counter, coordinator: str, replacement: dict[str, str], tmp_path: Path
) -> None:
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed: the Go conformance controller needs Go 1.26+")
    # Built in place (its go.mod replaces the gen/go module with ../../../gen/go, the package
    # as committed), into the temporary directory: never a write into the checkout.
    binary = tmp_path / "conformance"
    built = run(go, "build", "-buildvcs=false", "-o", binary, ".", cwd=GO_DIR)
    assert built.returncode == 0, explain(built)
    env = dict(counter.env(), CONFORMANCE_COORDINATOR_ADDRESS=coordinator, **replacement)
    proc = run(binary, cwd=tmp_path, env=env)
    print(proc.stdout)  # the controller's progress, shown with -rP or -s
    logs = server_logs(tmp_path)
    assert proc.returncode == 0, explain(proc, *logs)
    assert "go controller: all" in proc.stdout, explain(proc, *logs)


def test_rust_controller(
    counter: Counter, coordinator: str, replacement: dict[str, str], tmp_path: Path
) -> None:
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed: the Rust conformance controller needs Rust 1.85+")
    # Built from its committed Cargo.lock with what scripts/test fetched and built (the
    # cache's cargo home and target directory, scripts/cargo): offline, so a missing install
    # step fails here instead of downloading.
    cargo = ["bash", SCRIPTS / "cargo"]
    built = run(*cargo, "build", "--locked", "--offline", cwd=RUST_DIR)
    assert built.returncode == 0, explain(built)
    printed = run(*cargo, "env").stdout.splitlines()
    target = Path(dict(line.split("=", 1) for line in printed)["CARGO_TARGET_DIR"])
    env = dict(counter.env(), CONFORMANCE_COORDINATOR_ADDRESS=coordinator, **replacement)
    proc = run(target / "debug" / "conformance", cwd=tmp_path, env=env)
    print(proc.stdout)  # the controller's progress, shown with -rP or -s
    logs = server_logs(tmp_path)
    assert proc.returncode == 0, explain(proc, *logs)
    assert "rust controller: all" in proc.stdout, explain(proc, *logs)


def test_java_controller(
    counter: Counter, coordinator: str, replacement: dict[str, str], tmp_path: Path
) -> None:
    java = shutil.which("java")
    if java is None or shutil.which("mvn") is None:
        pytest.skip("java or mvn is not installed: the Java conformance controller needs JDK 17+")
    # The package and the controller in one reactor, from what scripts/test fetched into the
    # cache's repository (scripts/maven): offline, so a missing install step fails here instead
    # of downloading, and a no-op (a few seconds) when scripts/test built them. Unit tests are
    # scripts/test's and test_packages'.
    maven = ["bash", SCRIPTS / "maven", "-q", "-o", "-f", JAVA_DIR / "pom.xml"]
    built = run(*maven, "package", "-DskipTests")
    assert built.returncode == 0, explain(built)
    target = JAVA_DIR / "controller" / "target"
    classpath = [target / "classes", (target / "classpath.txt").read_text().strip()]
    env = dict(counter.env(), CONFORMANCE_COORDINATOR_ADDRESS=coordinator, **replacement)
    main = "dev.rolloutcheckpoint.conformance.Controller"
    proc = run(java, "-cp", os.pathsep.join(map(str, classpath)), main, cwd=tmp_path, env=env)
    print(proc.stdout)  # the controller's progress, shown with -rP or -s
    logs = server_logs(tmp_path)
    assert proc.returncode == 0, explain(proc, *logs)
    assert "java controller: all" in proc.stdout, explain(proc, *logs)
