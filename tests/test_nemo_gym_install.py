"""We install beside nemo-gym 0.4.0: resolvable, `pip check` clean, and we run there (issue 17).

nemo-gym 0.4.0 pins `mcp>=1.27,<2`; our core install no longer needs mcp (an extra now), so
`pip install rollout-checkpoint` into nemo-gym's environment must change none of its packages.

The cached environment (`scripts/nemo-gym-env`) is shared by other tests and must not be
modified, so this installs into a throwaway venv of the same interpreter that *sees* the cached
env's site-packages through a `.pth` file (after its own, so anything it installs would shadow
the env's copy; `tests/nemo_gym/beside.py`). pip resolves our dependencies against everything
visible: what the env already satisfies stays, what is missing lands in the throwaway venv.
Then:

- nothing installed in the throwaway venv is also a distribution of the env (no dependency of
  ours replaced one of nemo-gym's: the `mcp 2` conflict would show here first);
- `pip check` over both is clean (and it does see the env: a fake `mcp 2.3.0` makes it fail,
  the negative control);
- our runtime imports beside mcp 1.30, a server without MCP builds, and one with MCP fails
  with the one line naming the extra and the mcp it found.

The wheel is built from a copy of the tree (setuptools writes `build/` next to the sources).
About 10 s once the env exists; needs PyPI for our few missing dependencies.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from .nemo_gym.beside import BesideError, install_beside, purelib, run
from .test_nemo_gym_smoke import NemoGymEnv
from .test_nemo_gym_smoke import nemo_env as nemo_env  # the shared fixture


def distributions(site_packages: Path) -> set[str]:
    """Normalized names of the distributions installed directly in `site_packages`."""
    return {
        path.name.split("-", 1)[0].lower().replace("_", "-").replace(".", "-")
        for path in site_packages.glob("*.dist-info")
    }


@pytest.fixture(scope="module")
def beside_nemo_gym(nemo_env: NemoGymEnv, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a throwaway venv seeing nemo-gym's env, with `pip install <our tree>`
    (its `bin/` also holds our `rollout-checkpoint` console script). Fails loudly when pip
    fails, would replace one of nemo-gym's packages, or changed the shared env."""
    try:
        return install_beside(nemo_env.python, tmp_path_factory.mktemp("beside-nemo-gym"))
    except BesideError as error:
        pytest.fail(str(error), pytrace=False)


def pip(nemo_env: NemoGymEnv, python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run(nemo_env.python, "-m", "pip", "--python", python, *args)


def test_the_core_install_changes_none_of_nemo_gyms_packages(
    nemo_env: NemoGymEnv, beside_nemo_gym: Path
) -> None:
    ours = distributions(purelib(beside_nemo_gym))
    assert "rollout-checkpoint" in ours
    assert "mcp" not in ours and "grpcio-reflection" not in ours, ours
    shadowed = ours & distributions(nemo_env.site_packages)
    assert not shadowed, f"our install replaced nemo-gym env packages: {sorted(shadowed)}"


def test_pip_check_is_clean_and_sees_the_nemo_gym_env(
    nemo_env: NemoGymEnv, beside_nemo_gym: Path
) -> None:
    listed = pip(nemo_env, beside_nemo_gym, "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    versions = {item["name"].lower(): item["version"] for item in json.loads(listed.stdout)}
    assert versions["nemo-gym"] == "0.4.0" and versions["mcp"].startswith("1."), versions
    assert "rollout-checkpoint" in versions

    checked = pip(nemo_env, beside_nemo_gym, "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # Negative control: pip check over this layout does catch the old conflict.
    fake = purelib(beside_nemo_gym) / "mcp-2.3.0.dist-info"
    fake.mkdir()
    try:
        (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: mcp\nVersion: 2.3.0\n")
        conflicted = pip(nemo_env, beside_nemo_gym, "check")
        assert conflicted.returncode != 0
        assert "nemo-gym 0.4.0 has requirement mcp" in conflicted.stdout, conflicted.stdout
    finally:
        shutil.rmtree(fake)


def test_we_run_beside_mcp_1(beside_nemo_gym: Path) -> None:
    """Our runtime, sidecar and coordinator import beside mcp 1.30; a server without MCP
    builds; one with MCP fails while building, in one line naming the extra."""
    result = run(
        beside_nemo_gym,
        "-c",
        """
import importlib.metadata
import rollout_checkpoint.client.coordinator.service
import rollout_checkpoint.server.runtime.sidecar
from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.core.extras import MissingExtra
from rollout_checkpoint.server.resources import ResourcesServerConfig

assert importlib.metadata.version("mcp").startswith("1.")
CounterServer(ResourcesServerConfig(instance="counter")).build_app()
try:
    CounterServer(ResourcesServerConfig(instance="counter", expose_tools_over_mcp=True)).build_app()
except MissingExtra as error:
    print(error)
""",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "expose_tools_over_mcp needs mcp>=2.3,<3 (mcp 1.30.0 is installed): "
        "install rollout-checkpoint[mcp]"
    )
