"""The public names of the Go module gen/go, the npm package gen/ts, the crate gen/rust and the
Maven package gen/java, and their release record.

A controller compiles against these names, so removing or renaming one breaks it even when
the wire (which `buf breaking` guards) is unchanged. gen/public-api.json keeps, per package,
the list of releases: each a version and the exact names it exports. The last release must
be the current one (same version, same names), and each release's version must follow from
the one before it by semver: a removed name needs a major bump, an added one at least a minor
bump. tests/test_packages.py checks that; after a deliberate change, bump the version (Go:
`Version` in checkpoint.go; npm: package.json; Rust: Cargo.toml; Java: pom.xml) and append the release with

    .venv/bin/python -m tests.public_api record

which refuses a version that does not fit the change.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORD = REPO / "gen" / "public-api.json"
GO_PACKAGE = REPO / "gen" / "go" / "rollout_checkpoint" / "v1"
TS_PACKAGE = REPO / "gen" / "ts"
RUST_CRATE = REPO / "gen" / "rust"
# The crate's generated modules are in its build's OUT_DIR: built in the conformance
# controller's workspace, whose compiled dependencies scripts/test caches (scripts/cargo).
RUST_WORKSPACE = REPO / "tests" / "conformance" / "rust"
JAVA_PACKAGE = REPO / "gen" / "java"
JAVA_JAR_DIR = JAVA_PACKAGE / "target"
JAVA_CLASSPATH = JAVA_JAR_DIR / "runtime-classpath.txt"
MAVEN = ("bash", REPO / "scripts" / "maven")

Version = tuple[int, int, int]

# gofmt'd Go: top-level declarations start a line; members of a const/var/type block and
# struct fields are indented by one tab.
GO_FUNC = re.compile(r"^func ([A-Z]\w*)", re.M)
GO_METHOD = re.compile(r"^func \(\w* ?\*?([A-Z]\w*)\) ([A-Z]\w*)", re.M)
GO_SINGLE = re.compile(r"^(?:type|const|var) ([A-Z]\w*)", re.M)
GO_BLOCK = re.compile(r"^(?:const|var|type) \($(.*?)^\)$", re.M | re.S)
GO_STRUCT = re.compile(r"^type ([A-Z]\w*) struct \{$(.*?)^\}$", re.M | re.S)
GO_MEMBER = re.compile(r"^\t([A-Z]\w*)\b", re.M)
GO_VERSION = re.compile(r'^const Version = "(\d+\.\d+\.\d+)"$', re.M)

# The TypeScript compiler resolves what the package's entry point exports, `export *` and
# namespace re-exports of its own files included (`rpc.ErrorInfo`), types as well as values.
# The re-exported @grpc/grpc-js (`grpc`) is one name: its members are grpc-js's own API,
# pinned by version in package.json.
TS_EXPORTS = """
const ts = require("typescript");
const program = ts.createProgram(["src/index.ts"], { strict: true, esModuleInterop: true });
const checker = program.getTypeChecker();
const names = [];
function walk(symbol, prefix, depth) {
  for (const exported of checker.getExportsOfModule(symbol)) {
    const name = prefix + exported.getName();
    names.push(name);
    const target = exported.flags & ts.SymbolFlags.Alias ? checker.getAliasedSymbol(exported) : exported;
    const declaration = target.valueDeclaration;
    if (depth === 0 && target.flags & ts.SymbolFlags.ValueModule && declaration
        && ts.isSourceFile(declaration) && !declaration.fileName.includes("/node_modules/")) {
      walk(target, name + ".", depth + 1);
    }
  }
}
walk(checker.getSymbolAtLocation(program.getSourceFile("src/index.ts")), "", 0);
process.stdout.write(JSON.stringify(names.sort()));
"""


def parse_version(text: str) -> Version:
    major, minor, patch = (int(part) for part in text.split("."))
    return major, minor, patch


def go_names() -> list[str]:
    """Every exported identifier of package checkpointv1 (methods and fields as Type.Name)."""
    names: set[str] = set()
    for path in sorted(GO_PACKAGE.glob("*.go")):
        if path.name.endswith("_test.go"):
            continue
        source = path.read_text()
        names.update(GO_FUNC.findall(source))
        names.update(f"{kind}.{name}" for kind, name in GO_METHOD.findall(source))
        names.update(GO_SINGLE.findall(source))
        for block in GO_BLOCK.findall(source):
            names.update(GO_MEMBER.findall(block))
        for kind, body in GO_STRUCT.findall(source):
            names.update(f"{kind}.{field}" for field in GO_MEMBER.findall(body))
    return sorted(names)


def go_version() -> str:
    match = GO_VERSION.search((GO_PACKAGE / "checkpoint.go").read_text())
    assert match, 'gen/go/rollout_checkpoint/v1/checkpoint.go has no `const Version = "X.Y.Z"`'
    return match.group(1)


def ts_names() -> list[str]:
    """Every name the npm package's entry point exports (needs `npm ci` in gen/ts)."""
    proc = subprocess.run(
        ["node", "-e", TS_EXPORTS], cwd=TS_PACKAGE, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"listing gen/ts's exports failed (npm ci in gen/ts?):\n{proc.stderr}")
    names: list[str] = json.loads(proc.stdout)
    return names


def ts_version() -> str:
    version: str = json.loads((TS_PACKAGE / "package.json").read_text())["version"]
    return version


# rustfmt'd / prettyplease'd Rust: one item per line, four spaces per nesting level. An item
# line opens a scope at its indentation; a `}` (or the next item) at that indentation ends it.
RUST_ITEM = re.compile(
    r"^(?P<indent> *)(?:"
    r"pub mod (?P<mod>\w+)"
    r"|pub (?:struct|enum|trait) (?P<type>\w+)"
    r"|impl(?:<[^>]*>)? (?:[\w:<>]+ for )?(?P<impl>\w+)"
    r"|pub (?:const|type|static) (?P<const>\w+)"
    r"|pub use \{?(?P<use>[\w, ]+)\}?;"
    r"|pub (?:async )?fn (?P<fn>\w+)"
    r"|(?:async )?fn (?P<trait_fn>\w+)"
    r"|pub (?:r#)?(?P<field>\w+):"
    r"|(?P<variant>[A-Z]\w*)(?: = -?\d+|\(|,)"
    r")"
)
RUST_VERSION = re.compile(r'^version = "(\d+\.\d+\.\d+)"$', re.M)


def rust_names_of(source: str) -> set[str]:
    """The public names of one file of the crate: modules and types by path (`a::B`), their
    members after a dot (`a::B.method`, fields, enum variants, a pub trait's methods)."""
    names: set[str] = set()
    scopes: list[tuple[int, str, str]] = []  # (indentation, kind, name) of the open items
    for line in source.splitlines():
        stripped = line.strip()
        match = RUST_ITEM.match(line)
        if not (match or stripped.startswith("}")):
            continue
        indent = len(line) - len(line.lstrip(" "))
        while scopes and scopes[-1][0] >= indent:
            scopes.pop()
        if match is None:
            continue
        modules = "".join(f"{name}::" for _, kind, name in scopes if kind == "mod")
        owner = next((name for _, kind, name in reversed(scopes) if kind != "mod"), None)
        owner_kind = next((kind for _, kind, _ in reversed(scopes) if kind != "mod"), None)
        if match["mod"]:
            names.add(modules + match["mod"])
            scopes.append((indent, "mod", match["mod"]))
        elif match["type"]:
            names.add(modules + match["type"])
            scopes.append((indent, "type", match["type"]))
        elif match["impl"]:
            scopes.append((indent, "impl", match["impl"]))
        elif match["use"]:
            names.update(modules + name.strip() for name in match["use"].split(","))
        elif member := match["const"] or match["fn"] or match["field"]:
            names.add(f"{modules}{owner}.{member}" if owner else modules + member)
        elif (member := match["trait_fn"] or match["variant"]) and owner_kind == "type":
            names.add(f"{modules}{owner}.{member}")
    return names


def rust_out_dir() -> Path:
    """The crate's OUT_DIR (its generated modules), from a build in the cached workspace."""
    proc = subprocess.run(
        ["bash", "scripts/cargo", "build", "--locked", "--offline", "--message-format=json",
         "-p", "rollout-checkpoint", "--manifest-path", str(RUST_WORKSPACE / "Cargo.toml")],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"building gen/rust failed (scripts/test's cargo steps?):\n{proc.stderr}"
        )
    for line in proc.stdout.splitlines():
        message = json.loads(line)
        if message.get("reason") == "build-script-executed" and "gen/rust" in message["package_id"]:
            return Path(message["out_dir"])
    raise RuntimeError("cargo reported no build script run of gen/rust")


def rust_names() -> list[str]:
    """Every public name of the crate: src/lib.rs and the modules its build generates (their
    items are under `v1::`). Impl blocks of lib.rs extend v1's types: recorded under v1."""
    generated: set[str] = set()
    for path in sorted(rust_out_dir().glob("*.rs")):
        generated |= {f"v1::{name}" for name in rust_names_of(path.read_text())}
    own = rust_names_of((RUST_CRATE / "src" / "lib.rs").read_text()) - {"v1"}
    types = {name.split("::")[-1]: name for name in generated if "." not in name}
    for name in own:
        owner, dot, member = name.partition(".")
        generated.add(f"{types[owner]}.{member}" if dot and owner in types else name)
    return sorted(generated | {"v1"})


def rust_version() -> str:
    match = RUST_VERSION.search((RUST_CRATE / "Cargo.toml").read_text())
    assert match, 'gen/rust/Cargo.toml has no `version = "X.Y.Z"`'
    return match.group(1)


# javap -public: one block per class, `[modifiers] class|interface NAME ... {`, then one member
# per line (`  [modifiers] TYPE NAME(ARGS)...;` or `  [modifiers] TYPE NAME;`), then `}`.
JAVA_CLASS = re.compile(r"^(?P<modifiers>(?:\w+ )*)(?:class|interface) (?P<name>[\w.$]+)")
JAVA_MEMBER = re.compile(r"^  .*?(?P<name>[\w$]+)(?:\(.*\))?(?: throws [\w.$, ]+)?;$")
JAVA_ROOT = "dev.rolloutcheckpoint."
JAVA_VERSION = re.compile(r"^  <version>(\d+\.\d+\.\d+)</version>$", re.M)


def java_jar() -> Path:
    """The package's jar, built offline first (a no-op when scripts/test built it), so the
    names are those of the sources as they are. The same Maven run writes the jar's runtime
    dependencies beside it (JAVA_CLASSPATH), what a user's build gets from the one dependency."""
    built = subprocess.run(
        [*map(str, MAVEN), "-q", "-o", "-f", str(JAVA_PACKAGE / "pom.xml"), "package",
         "-Dmaven.test.skip", "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:build-classpath",
         "-Dmdep.includeScope=runtime", f"-Dmdep.outputFile={JAVA_CLASSPATH}"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if built.returncode != 0:
        raise RuntimeError(
            f"building gen/java failed (scripts/test's maven step?):\n{built.stdout}{built.stderr}"
        )
    return JAVA_JAR_DIR / f"rollout-checkpoint-{java_version()}.jar"


def java_names_of(javap: str) -> set[str]:
    """The public names in javap's listing: each public class by its name under
    dev.rolloutcheckpoint (`v1.PrepareRequest`, nested ones with a dot: `v1.ParticipantServiceGrpc
    .ParticipantServiceBlockingStub`), and its public members after a dot. A builder's members
    mirror its message's (getX/setX/clearX of the same fields), so only the builder is named."""
    names: set[str] = set()
    owner: str | None = None
    for line in javap.splitlines():
        header = JAVA_CLASS.match(line)
        if header:
            public = "public" in header["modifiers"].split()
            owner = header["name"].removeprefix(JAVA_ROOT).replace("$", ".") if public else None
            if owner:
                names.add(owner)
            continue
        member = JAVA_MEMBER.match(line)
        if owner and member and not owner.endswith(("Builder", "OrBuilder")):
            names.add(f"{owner}.{member['name'].rsplit('$', 1)[-1]}")
    return names


def java_names() -> list[str]:
    """Every public name of the jar: the helper layer and the generated classes."""
    jar = java_jar()
    with zipfile.ZipFile(jar) as archive:
        classes = [
            name.removesuffix(".class").replace("/", ".")
            for name in archive.namelist()
            if name.endswith(".class")
        ]
    listed = subprocess.run(
        ["javap", "-public", "-cp", str(jar), *sorted(classes)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if listed.returncode != 0:
        raise RuntimeError(f"javap of {jar} failed:\n{listed.stderr}")
    return sorted(java_names_of(listed.stdout))


def java_version() -> str:
    match = JAVA_VERSION.search((JAVA_PACKAGE / "pom.xml").read_text())
    assert match, "gen/java/pom.xml has no project `<version>X.Y.Z</version>`"
    return match.group(1)


def current() -> dict[str, dict[str, object]]:
    return {
        "go": {"version": go_version(), "names": go_names()},
        "ts": {"version": ts_version(), "names": ts_names()},
        "rust": {"version": rust_version(), "names": rust_names()},
        "java": {"version": java_version(), "names": java_names()},
    }


def bump_problem(before: dict[str, object], after: dict[str, object]) -> str | None:
    """Why `after` may not follow `before` as a release, or None when its version fits."""
    old, new = parse_version(str(before["version"])), parse_version(str(after["version"]))
    old_names, new_names = set(before["names"]), set(after["names"])  # type: ignore[call-overload]
    removed, added = sorted(old_names - new_names), sorted(new_names - old_names)
    if removed and new[0] <= old[0]:
        return f"{before['version']} -> {after['version']} removes {removed}: needs a major bump"
    if added and new[:2] <= old[:2]:
        return f"{before['version']} -> {after['version']} adds {added}: needs a minor bump"
    if new <= old:
        return f"{before['version']} -> {after['version']}: a release needs a higher version"
    return None


def record() -> None:
    """Append the current names as a release of each package whose names or version changed."""
    releases = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for package, now in current().items():
        history = releases.setdefault(package, [])
        if history and history[-1] == now:
            continue
        if history and (problem := bump_problem(history[-1], now)):
            sys.exit(f"{package}: {problem}")
        history.append(now)
    RECORD.write_text(json.dumps(releases, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit("usage: python -m tests.public_api record")
    record()
