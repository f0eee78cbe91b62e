"""The Go module gen/go, the npm package gen/ts, the crate gen/rust and the Maven package
gen/java: versioned public names, and what they are.

The conformance controllers (tests/test_conformance.py) use the packages against real
servers; these tests guard what a controller compiles against: the exported names change only
with a version bump that fits the change (tests/public_api.py, gen/public-api.json), the
helper layers pass their own unit tests, and each README's example compiles against its package.
(tests/test_layout.py checks that neither package ends up in the Python wheel.)
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import pytest

from . import public_api
from .processes import run

PACKAGES = ("go", "ts", "rust", "java")
GO_MODULE = public_api.REPO / "gen" / "go"
CARGO = ("bash", public_api.REPO / "scripts" / "cargo")
# Offline: what scripts/test fetched into the cache's repository (scripts/maven).
MAVEN = (*public_api.MAVEN, "-q", "-o", "-f", public_api.JAVA_PACKAGE / "pom.xml")


def require_java() -> None:
    if shutil.which("java") is None or shutil.which("mvn") is None:
        pytest.skip("java or mvn is not installed: gen/java needs JDK 11+ and Maven 3.8+")


def releases() -> dict[str, list[dict[str, object]]]:
    assert public_api.RECORD.is_file(), (
        "gen/public-api.json is missing: python -m tests.public_api record"
    )
    recorded: dict[str, list[dict[str, object]]] = json.loads(public_api.RECORD.read_text())
    return recorded


@pytest.fixture(scope="module")
def now() -> dict[str, dict[str, object]]:
    if shutil.which("node") is None:
        pytest.skip("node is not installed: listing gen/ts's exports needs Node 20+")
    if not (public_api.TS_PACKAGE / "node_modules" / "typescript").is_dir():
        pytest.fail("gen/ts/node_modules is missing: run scripts/test (`npm ci` in gen/ts)")
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed: listing gen/rust's names needs Rust 1.85+")
    require_java()
    return public_api.current()


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_change_only_with_a_version_bump(
    package: str, now: dict[str, dict[str, object]]
) -> None:
    last = releases()[package][-1]
    if last == now[package]:
        return
    old, new = set(last["names"]), set(now[package]["names"])  # type: ignore[call-overload]
    problem = public_api.bump_problem(last, now[package])
    assert problem is None, (
        f"gen/{package}'s public names changed without a fitting version bump: {problem}. "
        f"Removed: {sorted(old - new)}; added: {sorted(new - old)}"
    )
    pytest.fail(
        f"gen/{package} is {now[package]['version']} but gen/public-api.json's last release is "
        f"{last['version']}: record it (python -m tests.public_api record) and commit"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_each_recorded_release_follows_the_one_before(package: str) -> None:
    history = releases()[package]
    assert history, f"no release of gen/{package} recorded"
    for before, after in itertools.pairwise(history):
        assert public_api.bump_problem(before, after) is None


@pytest.mark.parametrize(
    ("before", "after", "fits"),
    [
        (("1.0.0", ["A", "B"]), ("1.0.0", ["A", "B"]), False),  # the same release twice
        (("1.0.0", ["A", "B"]), ("1.0.1", ["A", "B"]), True),
        (("1.0.0", ["A", "B"]), ("1.0.1", ["A", "B", "C"]), False),
        (("1.0.0", ["A", "B"]), ("1.1.0", ["A", "B", "C"]), True),
        (("1.0.0", ["A", "B"]), ("1.1.0", ["A"]), False),
        (("1.0.0", ["A", "B"]), ("1.1.0", ["A", "C"]), False),  # a rename removes a name
        (("1.0.0", ["A", "B"]), ("2.0.0", ["A", "C"]), True),
    ],
)
def test_a_version_bump_must_fit_the_change(
    before: tuple[str, list[str]], after: tuple[str, list[str]], fits: bool
) -> None:
    problem = public_api.bump_problem(
        {"version": before[0], "names": before[1]}, {"version": after[0], "names": after[1]}
    )
    assert (problem is None) == fits, problem


def test_the_helper_layers_are_in_the_recorded_names() -> None:
    """The helpers each package promises (README, docs/controllers.md) are public names."""
    recorded = {package: set(history[-1]["names"]) for package, history in releases().items()}  # type: ignore[call-overload]
    assert {
        "Version",
        "APIVersion",
        "APIPackage",
        "Domain",
        "ReasonOf",
        "ParseReason",
        "ErrorReason.Reason",
        "HealthServiceName.WireValue",
        "MetadataKey.WireValue",
        "ParseDeadline",
        "BearerToken",
    } <= recorded["go"]
    assert {
        "VERSION",
        "API_VERSION",
        "API_PACKAGE",
        "ERROR_DOMAIN",
        "reasonOf",
        "parseReason",
        "reasonString",
        "healthServiceName",
        "metadataKey",
        "parseDeadline",
        "bearerToken",
    } <= recorded["ts"]
    assert {
        "VERSION",
        "api_version",
        "v1::API_PACKAGE",
        "domain",
        "reason_of",
        "Refusal.metadata",
        "v1::ErrorReason.from_reason",
        "v1::ErrorReason.reason",
        "v1::HealthServiceName.wire_value",
        "v1::MetadataKey.wire_value",
        "parse_deadline",
        "format_deadline",
        "bearer_token",
    } <= recorded["rust"]
    assert {
        "RolloutCheckpoint.VERSION",
        "RolloutCheckpoint.API_VERSION",
        "RolloutCheckpoint.API_PACKAGE",
        "RolloutCheckpoint.DOMAIN",
        "RolloutCheckpoint.reasonOf",
        "RolloutCheckpoint.Refusal.metadata",
        "RolloutCheckpoint.reason",
        "RolloutCheckpoint.parseReason",
        "RolloutCheckpoint.wireValue",
        "RolloutCheckpoint.parseDeadline",
        "RolloutCheckpoint.formatDeadline",
        "RolloutCheckpoint.bearerToken",
        "v1.ErrorReason.ERROR_REASON_STALE_CHECKPOINT",
        "v1.HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS",
        "v1.MetadataKey.METADATA_KEY_DEADLINE",
    } <= recorded["java"]


def test_the_go_helpers_pass_their_unit_tests() -> None:
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed")
    tested = run(go, "test", "./...", cwd=GO_MODULE)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_typescript_helpers_pass_their_unit_tests(now: dict[str, dict[str, object]]) -> None:
    package = public_api.TS_PACKAGE
    if not (package / "dist" / "index.js").is_file():
        pytest.fail("gen/ts/dist is missing: run scripts/test (`npm ci` in gen/ts builds it)")
    tested = run("node", "--test", "test/", cwd=package)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_rust_helpers_pass_their_unit_tests() -> None:
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed")
    # In the conformance controller's workspace: the dependencies scripts/test built there.
    workspace = public_api.RUST_WORKSPACE
    tested = run(*CARGO, "test", "--locked", "--offline", "-p", "rollout-checkpoint", cwd=workspace)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_java_helpers_pass_their_unit_tests() -> None:
    require_java()
    tested = run(*MAVEN, "test")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def readme_example(package: str, language: str) -> str:
    """The one fenced `language` block of gen/<package>/README.md: what a user copies."""
    readme = (public_api.REPO / "gen" / package / "README.md").read_text()
    (example,) = re.findall(rf"^```{language}\n(.*?)^```$", readme, re.M | re.S)
    return example


def test_the_go_readme_example_compiles(tmp_path: Path) -> None:
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed")
    (tmp_path / "main.go").write_text(readme_example("go", "go"))
    # The conformance controller's module pins the same dependencies; only the path differs.
    conformance = public_api.REPO / "tests" / "conformance" / "go"
    module = (conformance / "go.mod").read_text().replace("../../../gen/go", str(GO_MODULE))
    (tmp_path / "go.mod").write_text(module)
    shutil.copy2(conformance / "go.sum", tmp_path / "go.sum")
    # vet type-checks it (and more) without linking a binary nobody runs.
    vetted = run(go, "vet", ".", cwd=tmp_path)
    assert vetted.returncode == 0, vetted.stderr


def test_the_typescript_readme_example_type_checks(
    tmp_path: Path, now: dict[str, dict[str, object]]
) -> None:
    package = public_api.TS_PACKAGE
    if not (package / "dist" / "index.d.ts").is_file():
        pytest.fail("gen/ts/dist is missing: run scripts/test (`npm ci` in gen/ts builds it)")
    (tmp_path / "example.ts").write_text(readme_example("ts", "ts"))
    scope = tmp_path / "node_modules" / "@rollout-checkpoint"
    scope.mkdir(parents=True)
    (scope / "client").symlink_to(package)  # what `npm install file:<repo>/gen/ts` makes
    tsc = package / "node_modules" / ".bin" / "tsc"
    checked = run(
        tsc, "--noEmit", "--strict", "--target", "ES2022", "--module", "commonjs",
        "--moduleResolution", "node", "--types", "node", "--typeRoots",
        package / "node_modules" / "@types", "example.ts", cwd=tmp_path,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_rust_readme_example_compiles(tmp_path: Path) -> None:
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed")
    # The conformance controller's manifest and lock (the same dependencies, so the cached
    # build serves), with the crate's path made absolute and the example as its main, under
    # another package name: the target directory is shared, and a binary named `conformance`
    # would replace the controller's, which test_conformance then runs.
    conformance = public_api.RUST_WORKSPACE
    renamed = ('name = "conformance"', 'name = "readme-example"')
    manifest = (conformance / "Cargo.toml").read_text().replace(*renamed)
    (tmp_path / "Cargo.toml").write_text(
        manifest.replace("../../../gen/rust", str(public_api.RUST_CRATE))
    )
    lock = (conformance / "Cargo.lock").read_text()
    assert lock.count(renamed[0]) == 1, "the lock names the controller's package once"
    (tmp_path / "Cargo.lock").write_text(lock.replace(*renamed))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.rs").write_text(readme_example("rust", "rust"))
    built = run(*CARGO, "build", "--locked", "--offline", "-q", cwd=tmp_path)
    assert built.returncode == 0, built.stderr


def test_the_java_readme_example_compiles(
    tmp_path: Path, now: dict[str, dict[str, object]]
) -> None:
    # Against the jar that listing the names built (`now`) and its runtime dependencies (what a
    # user's build gets from the one <dependency>), at the package's Java release.
    jar = public_api.JAVA_JAR_DIR / f"rollout-checkpoint-{now['java']['version']}.jar"
    source = tmp_path / "PrepareExample.java"
    source.write_text(readme_example("java", "java"))
    compiled = run(
        "javac", "--release", "11", "-Werror", "-d", tmp_path / "classes",
        "-cp", f"{jar}:{public_api.JAVA_CLASSPATH.read_text().strip()}", source,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
