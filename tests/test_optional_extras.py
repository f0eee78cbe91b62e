"""The `mcp` and `reflection` extras: absent, nothing else notices; configured, one clear line.

Issue 17: both packages became optional extras so that we install beside nemo-gym 0.4.0
(which pins mcp<2). Here they are made unimportable in-process (`sys.modules[name] = None`
makes `import name` raise) or in a child interpreter (for what happens at import time, which an
in-process test cannot see once the modules are cached), and:

- every module of the runtime and the controllers except the MCP module itself imports;
- a counter server with checkpointing (and its sidecar) serves an episode;
- configuring MCP (`expose_tools_over_mcp`, `serve --mcp`) or reflection (`reflection: true`,
  `coordinator --reflection`) fails while the app or server is built, with a `MissingExtra`
  whose one line names the extra to install; mcp 1.x (no `mcp_types`) says which mcp it found.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import httpx
import pytest

from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.core.extras import MCP, REFLECTION, MissingExtra, require
from rollout_checkpoint.server.resources import ResourcesServerConfig
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .conftest import TOKEN, serve_app

MISSING_MCP = "install rollout-checkpoint[mcp]"
MISSING_REFLECTION = "install rollout-checkpoint[reflection]"


@pytest.fixture
def without_mcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)
    monkeypatch.setitem(sys.modules, "mcp_types", None)


@pytest.fixture
def without_reflection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grpc_reflection", None)


def counter(*, mcp: bool, reflection: bool = False) -> CounterServer:
    settings = CheckpointSettings(enabled=True, token=TOKEN, reflection=reflection)
    return CounterServer(
        ResourcesServerConfig(instance="counter", checkpoint=settings, expose_tools_over_mcp=mcp)
    )


def test_require_names_the_extra_when_the_package_is_missing(without_mcp: None) -> None:
    with pytest.raises(MissingExtra) as raised:
        require(MCP, "expose_tools_over_mcp")
    assert raised.value.extra is MCP
    assert isinstance(raised.value.__cause__, ImportError)
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith("expose_tools_over_mcp needs mcp>=2.3,<3 (")
    assert line.endswith(MISSING_MCP)


def test_mcp_1x_is_reported_with_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """mcp 1.x (nemo-gym's) imports as `mcp` but has no `mcp_types`: the line says which
    mcp is installed, so "but mcp is installed" needs no debugging."""
    monkeypatch.setitem(sys.modules, "mcp_types", None)
    monkeypatch.setattr(
        "rollout_checkpoint.server.core.extras._installed_version", lambda name: "1.30.0"
    )
    with pytest.raises(MissingExtra, match=r"\(mcp 1\.30\.0 is installed\): install"):
        require(MCP, "expose_tools_over_mcp")


def test_require_passes_when_installed() -> None:
    require(MCP, "expose_tools_over_mcp")
    require(REFLECTION, "reflection")


def test_mcp_configured_without_mcp_fails_while_the_app_is_built(without_mcp: None) -> None:
    with pytest.raises(MissingExtra, match=r"^expose_tools_over_mcp needs .*\[mcp\]$"):
        counter(mcp=True).build_app()


def test_reflection_configured_without_the_package_fails_while_the_app_is_built(
    without_reflection: None,
) -> None:
    with pytest.raises(MissingExtra, match=r"^reflection: true .*\[reflection\]$"):
        counter(mcp=False, reflection=True).build_app()


def test_coordinator_reflection_without_the_package_fails_at_construction(
    without_reflection: None,
) -> None:
    from rollout_checkpoint.client.cli.errors import classify
    from rollout_checkpoint.client.coordinator.service import Coordinator

    spec = FleetSpec(members=(MemberSpec("counter", "127.0.0.1:9"),), token=TOKEN)
    with pytest.raises(MissingExtra) as raised:
        Coordinator(spec, "127.0.0.1:0", reflection_enabled=True)
    classified = classify(raised.value)  # the CLI's one line, exit 2
    assert classified is not None and MISSING_REFLECTION in str(classified)
    Coordinator(spec, "127.0.0.1:0")  # without reflection: builds


async def test_without_either_package_an_unconfigured_server_serves(
    without_mcp: None, without_reflection: None
) -> None:
    """Checkpointing on, sidecar started, an episode served: neither package is touched."""
    server = counter(mcp=False)
    app = server.build_app()
    uvicorn_server, serving, port = await serve_app(app)
    try:
        assert server.runtime is not None and server.runtime.port
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.post("/seed_session", json={})).status_code == 200
            reply = await http.post("/increment_counter", json={"count": 2})
            assert reply.status_code == 200, reply.text
            assert (await http.post("/get_counter_value", json={})).json()["count"] == 2
    finally:
        uvicorn_server.should_exit = True
        await serving


def _run_blocked(code: str, *blocked: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter where the `blocked` top-level modules cannot import."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_module_but_the_mcp_one_imports_without_either_package() -> None:
    result = _run_blocked(
        """
        import importlib, pkgutil
        import rollout_checkpoint.client, rollout_checkpoint.server
        names = []
        for package in (rollout_checkpoint.server, rollout_checkpoint.client):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                if info.name != "rollout_checkpoint.server.resources.mcp":
                    importlib.import_module(info.name)
                    names.append(info.name)
        assert "rollout_checkpoint.server.runtime.sidecar" in names, names
        assert "rollout_checkpoint.client.coordinator.service" in names, names
        for name in ("mcp", "mcp_types", "grpc_reflection"):
            assert sys.modules[name] is None, name
        print(len(names))
        """,
        "mcp",
        "mcp_types",
        "grpc_reflection",
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 50


def test_serve_with_mcp_but_without_it_exits_2_with_one_line() -> None:
    result = _run_blocked(
        """
        from rollout_checkpoint.examples.serve import main
        main(["counter", "--mcp", "--no-checkpoint", "--http-address", "127.0.0.1:0"])
        """,
        "mcp",
        "mcp_types",
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "rollout-checkpoint serve: expose_tools_over_mcp needs mcp>=2.3,<3 "
        f"(mcp {_mcp_version()} is installed): {MISSING_MCP}"
    ]


def _mcp_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("mcp")
