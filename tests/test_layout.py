"""The import mapping: server/, client/, examples/ and gen/ all live under `rollout_checkpoint`.

setuptools' package-dir maps the top-level folders under one import root. These tests
prove that mapping holds in the editable install (what the tests import), in a built
wheel installed on its own (what users get), and for import-linter's layering contracts.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

from .processes import REPO, explain, run

BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# {"rollout_checkpoint": "gen/rollout_checkpoint", "rollout_checkpoint.server": "server", ...}
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
CONSOLE_SCRIPT = "rollout-checkpoint"

# One module per source folder; the generated ones are what the other folders build on.
PROBES = {
    "rollout_checkpoint": "gen/rollout_checkpoint",
    "rollout_checkpoint.v1.participant_service_pb2": "gen/rollout_checkpoint/v1",
    "rollout_checkpoint.v1.participant_service_pb2_grpc": "gen/rollout_checkpoint/v1",
    "rollout_checkpoint.server": "server",
    "rollout_checkpoint.client": "client",
    "rollout_checkpoint.examples": "examples",
}


def test_editable_imports_resolve_to_the_source_folders() -> None:
    for name, folder in PROBES.items():
        module = importlib.import_module(name)
        assert module.__file__ is not None, name
        path = Path(module.__file__).resolve()
        assert path.parent == REPO / folder, f"{name} was imported from {path}"


DATA_FOLDERS = ("client/coordinator/dashboard",)
"""Folders whose every file the wheel must carry (the dashboard's page and vendored library)."""


def _source_modules() -> set[str]:
    """Every module file the wheel must carry, and every file of `DATA_FOLDERS`, as a path
    inside the wheel."""
    expected = set()
    for package, folder in PACKAGE_DIR.items():
        root = REPO / folder
        prefix = package.replace(".", "/")
        for path in root.rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            data = any(path.is_relative_to(REPO / data) for data in DATA_FOLDERS)
            if data or path.suffix in {".py", ".pyi"}:
                expected.add(f"{prefix}/{path.relative_to(root).as_posix()}")
    return expected


def test_wheel_alone_provides_the_packages(tmp_path: Path) -> None:
    # Build from a copy of exactly the packaged inputs: the build never writes into the
    # checkout (no build/ or egg-info races with a concurrent run) and a stale build/lib
    # cannot leak files that no longer exist into the wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ["pyproject.toml", "README.md", *{d.split("/")[0] for d in PACKAGE_DIR.values()}]:
        if (REPO / name).is_dir():
            # gen/ also holds the Go and npm packages; their installed tools are no input.
            ignore = shutil.ignore_patterns("__pycache__", "node_modules", "dist")
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        elif (REPO / name).is_file():
            (src / name).write_bytes((REPO / name).read_bytes())
    dist = tmp_path / "dist"
    proc = run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src)
    assert proc.returncode == 0, explain(proc)
    (wheel,) = dist.glob("*.whl")

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points_txt = zf.read(entry_points).decode()
    # Every source module and type stub made it in (a subpackage missing from
    # pyproject's `packages` list would silently drop out), plus the PEP 561 marker.
    missing = _source_modules() - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    assert "rollout_checkpoint/py.typed" in names
    assert any(n.startswith("rollout_checkpoint/v1/") and n.endswith("_pb2.pyi") for n in names)
    # gen/go, gen/ts and gen/java sit beside the generated Python package: none of theirs is
    # Python's (the dashboard's own scripts are the wheel's only JavaScript, and belong there).
    dashboard = "rollout_checkpoint/client/coordinator/dashboard/"
    foreign = [
        n
        for n in names
        if n.endswith((".go", ".ts", "go.mod", "package.json", ".java", "pom.xml"))
        or (n.endswith(".js") and not n.startswith(dashboard))
    ]
    assert not foreign, foreign
    assert f"{CONSOLE_SCRIPT} = rollout_checkpoint.client.cli.main:main" in entry_points_txt, (
        entry_points_txt
    )

    # A venv of a venv inherits the *base* interpreter, not the dev venv's site-packages,
    # so this one starts empty. Our package comes only from the wheel (--no-deps); the
    # third-party dependencies come from the dev venv's site-packages through a plain
    # path line in a .pth file. Plain path lines do not run that directory's own .pth
    # files, so the dev venv's editable finder is never installed here.
    venv = tmp_path / "venv"
    proc = run(sys.executable, "-m", "venv", "--without-pip", venv)
    assert proc.returncode == 0, explain(proc)
    vpy = venv / "bin" / "python"
    # The dev venv's pip installs into the new one (--python): no ensurepip, much faster.
    pip = [sys.executable, "-m", "pip", "--python", str(vpy)]
    proc = run(*pip, "install", "-q", "--no-deps", "--no-index", wheel)
    assert proc.returncode == 0, explain(proc)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run(vpy, "-c", purelib, cwd=tmp_path).stdout.strip())
    dev_site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_dev_deps.pth").write_text("".join(f"{p}\n" for p in sorted(dev_site)))

    probe = (
        "import importlib, json, sys\n"
        f"names = {list(PROBES)!r}\n"
        "files = {n: importlib.import_module(n).__file__ for n in names}\n"
        "editable = [repr(f) for f in sys.meta_path if 'editable' in repr(f).lower()]\n"
        "print(json.dumps({'files': files, 'editable': editable}))\n"
    )
    # -I: no PYTHONPATH, no user site, no cwd on sys.path, so nothing of the checkout
    # can be imported by accident; run from tmp_path for the same reason.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = run(vpy, "-I", "-c", probe, cwd=tmp_path, env=env)
    assert proc.returncode == 0, explain(proc)
    seen = json.loads(proc.stdout)
    assert seen["editable"] == [], seen
    for name, file in seen["files"].items():
        assert Path(file).resolve().is_relative_to(site.resolve()), f"{name} from {file}"

    script = venv / "bin" / CONSOLE_SCRIPT
    assert script.is_file(), f"{CONSOLE_SCRIPT} not installed into {venv / 'bin'}"
    if "rollout_checkpoint/client/cli/main.py" in names:
        proc = run(script, "--help", cwd=tmp_path, env=env)
        assert proc.returncode == 0, explain(proc)


def test_import_linter_contracts(tmp_path: Path) -> None:
    # import-linter (grimp) finds the root package's folder and walks it on disk, so it
    # only sees gen/rollout_checkpoint, never server/ or client/. Give it the installed
    # shape instead: a tree of symlinks built from pyproject's package-dir (grimp follows
    # directory links), first on PYTHONPATH so it wins over the editable finder.
    tree = tmp_path / "tree"
    for package, folder in sorted(PACKAGE_DIR.items()):
        target = tree / package.replace(".", "/")
        if package == "rollout_checkpoint":
            # The root package's folder also holds v1/; link its entries one by one so
            # the mapped subpackages can sit next to them.
            target.mkdir(parents=True)
            for entry in (REPO / folder).iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(REPO / folder)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = run(BIN / "lint-imports", "--no-cache", env=env)
    assert proc.returncode == 0, explain(proc)
    assert "0 broken" in proc.stdout, explain(proc)


def test_importing_the_light_packages_loads_no_grpc_and_no_runtime() -> None:
    """`rollout_checkpoint.client` resolves its names lazily and the core's value modules are
    stdlib + protobuf: a controller script or a storage tool does not pay for grpc, and
    nothing of the participant runtime comes along with the core."""
    probe = (
        "import sys\n"
        "import rollout_checkpoint.client\n"
        "import rollout_checkpoint.server.core.part_storage\n"
        "import rollout_checkpoint.server.core.clock\n"
        "import rollout_checkpoint.server.runtime.control_plane\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'starlette', 'prometheus_client', 'fastapi', 'uvicorn'))\n"
        "print(heavy)\n"
    )
    proc = run(sys.executable, "-c", probe)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.strip() == "[]", explain(proc)
