"""A real run for the dashboard, shared by its browser test and `scripts/dashboard-screenshot`:
two example servers (counter, weather), checkpoints taken with the CLI (one a member refuses),
a restore, and a coordinator serving the HTTP port; and headless Chromium driven by Selenium.

The failure is made, not waited for: the counter's part directory of `REFUSED` is a file
before that checkpoint starts, so the counter refuses its commit (INVALID_REQUEST) and the
checkpoint fails naming it, every time. A deadline too short would fail or not depending on
the machine's load.

    python -m tests.dashboard_fleet OUT.png      (what scripts/dashboard-screenshot runs)
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from rollout_checkpoint.server.core.rpc.wire import timestamp
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .conftest import TOKEN
from .test_fleet_cli import CLI, Process, RealFleet, cli, real_fleet, start, stop

CHECKPOINTS = ("ckpt-one", "ckpt-two")
ASYNC = "ckpt-async"
REFUSED = "ckpt-refused"
RESTORE = "restore-one"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
BROWSER_SECONDS = 120.0
"""Bound of every wait on the page (it polls every 2 s; the machine may be loaded)."""
WINDOW = (1280, 800)


def checked(*args: str) -> None:
    done = cli(*args)
    assert done.returncode == 0, f"{args}: {done.stderr}"


def take_checkpoints(fleet: RealFleet, ids: tuple[str, ...] = CHECKPOINTS) -> None:
    for checkpoint_id in ids:
        checked("checkpoint", "--fleet", str(fleet.fleet_file), checkpoint_id)


def take_refused(fleet: RealFleet) -> None:
    """`REFUSED`, which the counter refuses at its commit (see the module)."""
    blocked = fleet.root / REFUSED / "participants" / "resources" / "counter"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a directory\n")
    done = cli("checkpoint", "--fleet", str(fleet.fleet_file), REFUSED)
    assert done.returncode != 0 and "not a directory" in done.stderr, done.stderr


def take_async_through(served: Process) -> None:
    """`ASYNC`, asynchronous, through the coordinator's Checkpoint RPC."""
    request = cpb.CheckpointRequest(
        checkpoint_id=ASYNC, deadline=timestamp(time.time() + 60), asynchronous=True
    )
    with grpc.insecure_channel(served.announced["grpc"]) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        replies = list(
            stub.Checkpoint(request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=60)
        )
    assert replies[-1].result.published, replies[-1]


def restore_in_place(fleet: RealFleet) -> None:
    """`RESTORE`: the same processes restore the latest checkpoint (--rejoin) and resume."""
    checked("restore", "--fleet", str(fleet.fleet_file), "--rejoin", RESTORE)
    checked("resume", "--fleet", str(fleet.fleet_file), RESTORE)


@contextlib.contextmanager
def history_made(
    directory: Path, checkpoints: tuple[str, ...] = CHECKPOINTS
) -> Iterator[RealFleet]:
    """The fleet (an episode in flight on the counter), after `checkpoints` with the CLI,
    `ASYNC` through a coordinator that is then stopped, `REFUSED` and `RESTORE`."""
    with real_fleet(directory) as fleet:
        seeded = httpx.post(
            fleet.http("counter") + "/ng-rollout/r1/seed_session",
            json={"initial_count": 4},
            timeout=30,
        )
        assert seeded.status_code == 200, seeded.text
        take_checkpoints(fleet, checkpoints)
        with coordinator(fleet) as first:
            take_async_through(first)
        take_refused(fleet)
        restore_in_place(fleet)
        yield fleet


@contextlib.contextmanager
def coordinator(fleet: RealFleet) -> Iterator[Process]:
    """`rollout-checkpoint coordinator` with its HTTP port; announced `http` is its address."""
    process = start(
        [*CLI, "coordinator", "--fleet", str(fleet.fleet_file), "--http-address", "127.0.0.1:0"]
    )
    try:
        yield process
    finally:
        stop(process)


@contextlib.contextmanager
def browser(profile: Path) -> Iterator[WebDriver]:
    """Headless Chromium (Debian's) through its chromedriver, every host name but 127.0.0.1
    mapped to nothing, so a page that needed the network could not hide it behind a cache;
    the console kept (`get_log("browser")`)."""
    for tool in (CHROMIUM, CHROMEDRIVER):
        assert Path(tool).is_file(), f"{tool}: apt-get install chromium chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",  # it refuses to start as root otherwise (CI runs as root)
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit chromedriver: Selenium Manager (which would download one) never runs.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    # The page's own size, exactly (--window-size counts the window's frame too).
    width, height = WINDOW
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    driver.set_page_load_timeout(BROWSER_SECONDS)
    driver.set_script_timeout(BROWSER_SECONDS)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: WebDriver) -> WebDriverWait:  # type: ignore[type-arg]
    """A wait on `driver` that tries again when an element it found was redrawn meanwhile
    (the page replaces its tables at every poll)."""
    return WebDriverWait(
        driver,
        BROWSER_SECONDS,
        poll_frequency=0.2,
        ignored_exceptions=[StaleElementReferenceException],
    )


def table(driver: WebDriver, selector: str) -> list[list[str]]:
    """The text of every cell of the table `selector`'s body, row by row, read in one call
    (the page redraws its tables every poll: elements found one by one could go stale)."""
    rows: list[list[str]] = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0] + ' tbody tr')]"
        ".map(r => [...r.cells].map(c => c.textContent))",
        selector,
    )
    return rows


def history_row(driver: WebDriver, attempt_id: str) -> list[str]:
    """The texts of the history table's row of `attempt_id` (waited for)."""
    wait(driver).until(lambda d: _row(d, attempt_id) is not None, f"no row {attempt_id!r}")
    row = _row(driver, attempt_id)
    assert row is not None
    return row


def _row(driver: WebDriver, attempt_id: str) -> list[str] | None:
    return next((cells for cells in table(driver, "#history") if cells[0] == attempt_id), None)


def open_detail(driver: WebDriver, attempt_id: str) -> None:
    """Click `attempt_id`'s row and wait until the detail shows its members."""
    history_row(driver, attempt_id)
    wait(driver).until(lambda d: _click_row(d, attempt_id), f"no row {attempt_id!r} to click")
    wait(driver).until(
        lambda d: (
            d.find_element(By.ID, "detail-id").get_attribute("textContent") == attempt_id
            and any(len(row) > 1 for row in table(d, "#detail-members"))
        ),
        f"the detail of {attempt_id!r} did not show its members",
    )


def _click_row(driver: WebDriver, attempt_id: str) -> bool:
    for cell in driver.find_elements(By.CSS_SELECTOR, "#history tbody td.id"):
        if cell.get_attribute("textContent") == attempt_id:
            cell.click()
            return True
    return False


def screenshot(out: Path) -> None:
    """A PNG of the dashboard of a real run, `WINDOW` large (what fits in it: the counts, the
    fleet, the chart and the newest rows of the history)."""
    with tempfile.TemporaryDirectory(prefix="dashboard-") as scratch:
        folder = Path(scratch)
        ids = tuple(f"ckpt-{n}" for n in range(1, 7))
        with history_made(folder, ids) as fleet, coordinator(fleet) as served:
            take_checkpoints(fleet, ("ckpt-7",))
            with browser(folder / "profile") as driver:
                driver.get(f"http://{served.announced['http']}/#token={TOKEN}")
                history_row(driver, "ckpt-7")
                wait(driver).until(lambda d: "updated" in d.find_element(By.ID, "state").text)
                driver.save_screenshot(str(out))


if __name__ == "__main__":
    screenshot(Path(sys.argv[1]).resolve())
