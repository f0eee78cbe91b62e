"""The coordinator's dashboard in a real browser: Debian's headless Chromium driven by Selenium.

A real fleet (two example servers) takes checkpoints with the CLI and through a coordinator
(one of them asynchronous, one the counter refuses), a restore, and a hostile attempt in the
history (markup as its id, message and member, as a hand-edited index or another writer could
leave it); then the coordinator is restarted on the same root and the page of the new one must
show all of it: the rows and statuses the API returns, the failure's reason and members, the
restore, the chart drawn, a checkpoint's members on click, every member's health, a new
checkpoint without a reload, a member that goes down; and nothing loaded from anywhere else
(every host name but 127.0.0.1 resolves to nothing), no console error, no script run from the
history. Without the token the page asks for it and reads nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver

from rollout_checkpoint.client.checkpointing.publication import format_time
from rollout_checkpoint.client.checkpointing.publication.history import (
    HistoryEntry,
    StageTiming,
    open_history,
)
from rollout_checkpoint.client.coordinator.dashboard import SECURITY_HEADERS

from .conftest import TOKEN
from .dashboard_fleet import (
    ASYNC,
    CHECKPOINTS,
    REFUSED,
    RESTORE,
    browser,
    coordinator,
    history_made,
    history_row,
    open_detail,
    table,
    take_checkpoints,
    wait,
)
from .processes import REPO, kill_group, run
from .test_fleet_cli import Process, RealFleet

HOSTILE_ID = '<img src=x onerror="window.pwned=1">'
HOSTILE_MESSAGE = "<script>window.pwned=2</script><b>bold</b>"
HOSTILE_MEMBER = "<i>m</i>"


@dataclass
class Dashboard:
    fleet: RealFleet
    served: Process
    driver: WebDriver

    @property
    def url(self) -> str:
        return f"http://{self.served.announced['http']}"

    def api(self, path: str, token: str | None = TOKEN) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.get(self.url + path, headers=headers, timeout=60)


def hostile_attempt() -> HistoryEntry:
    now = format_time(datetime.now(UTC))
    return HistoryEntry(
        id=HOSTILE_ID,
        operation="checkpoint",
        trigger="manual",
        mode="sync",
        status="failed",
        started_at=now,
        ended_at=now,
        duration_seconds=0.1,
        reason="PARTICIPANT_FAILED",
        message=HOSTILE_MESSAGE,
        failed_members=(HOSTILE_MEMBER,),
        stages=(StageTiming("prepare", 0.1),),
        members=2,
    )


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    """The page of a coordinator started after the history was made (a restart on the same
    root: the first coordinator took `ASYNC` and stopped)."""
    folder = tmp_path_factory.mktemp("dashboard")
    with history_made(folder) as fleet:
        open_history(fleet.root).append(hostile_attempt(), [])
        with coordinator(fleet) as served, browser(folder / "profile") as driver:
            yield Dashboard(fleet, served, driver)


def texts(driver: WebDriver, selector: str) -> list[str]:
    """The text (not the rendering: CSS may upper-case it) of every element `selector` finds."""
    found: list[str] = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)", selector
    )
    return found


def fleet_cells(driver: WebDriver) -> dict[str, list[str]]:
    return {cells[0]: cells for cells in table(driver, "#fleet") if len(cells) > 1}


def console_errors(driver: WebDriver) -> list[dict[str, Any]]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_without_a_token_the_page_asks_for_one_and_reads_nothing(dashboard: Dashboard) -> None:
    driver = dashboard.driver
    driver.switch_to.new_window("tab")  # a tab of its own: sessionStorage is per tab
    try:
        driver.get(dashboard.url + "/")
        wait(driver).until(
            lambda d: d.find_element(By.ID, "token-form").is_displayed(), "no token prompt"
        )
        assert not driver.find_element(By.ID, "dashboard").is_displayed()
        assert texts(driver, "#history tbody tr") == []
        loaded = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert not [name for name in loaded if "/checkpoints" in name or "/fleet" in name]

        field = driver.find_element(By.ID, "token-input")
        field.send_keys("not-the-token", Keys.ENTER)
        wait(driver).until(
            lambda d: (
                d.find_element(By.ID, "token-problem").text == "The coordinator refused this token."
            )
        )
        assert driver.find_element(By.ID, "token-form").is_displayed()
        assert not driver.find_element(By.ID, "dashboard").is_displayed()

        driver.find_element(By.ID, "token-input").send_keys(TOKEN, Keys.ENTER)
        assert history_row(driver, REFUSED)[4] == "failed"
        assert "?" not in driver.current_url and TOKEN not in driver.current_url
    finally:
        driver.close()
        driver.switch_to.window(driver.window_handles[0])
        driver.get_log("browser")  # the refused token's 401 is this tab's, expected


def test_the_restarted_coordinators_page_shows_the_whole_history(dashboard: Dashboard) -> None:
    driver = dashboard.driver
    driver.get(f"{dashboard.url}/#token={TOKEN}")
    history_row(driver, RESTORE)
    # The token left the address bar (it stays in this tab's sessionStorage only).
    assert driver.current_url == dashboard.url + "/"

    listed = dashboard.api("/checkpoints?page_size=100").json()["checkpoints"]
    assert [a["id"] for a in listed] == [
        HOSTILE_ID,
        RESTORE,
        REFUSED,
        ASYNC,
        *reversed(CHECKPOINTS),
    ]
    shown = [row[:5] for row in table(driver, "#history")]
    expected = [
        [
            a["id"],
            a["operation"].removeprefix("ATTEMPT_OPERATION_").lower(),
            a["trigger"],
            a["mode"],
            a["status"].removeprefix("ATTEMPT_STATUS_").lower(),
        ]
        for a in listed
    ]
    assert shown == expected
    statuses = {row[0]: row[4] for row in shown}
    assert statuses[REFUSED] == "failed" and statuses[RESTORE] == "completed"
    assert all(statuses[i] == "completed" for i in (*CHECKPOINTS, ASYNC))

    refused = history_row(driver, REFUSED)
    assert refused[10] == "PARTICIPANT_FAILED (counter)"
    counts = dict(zip(texts(driver, "#counts dt"), texts(driver, "#counts dd"), strict=True))
    assert counts["completed"] == "3" and counts["failed"] == "2" and counts["restores"] == "1"

    (restore,) = table(driver, "#restores")
    assert restore[:5] == [RESTORE, ASYNC, "rejoin", "manual", "completed"]
    assert restore[7] == "1"  # the counter's episode, continued


def test_the_chart_is_drawn(dashboard: Dashboard) -> None:
    driver = dashboard.driver
    wait(driver).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chart canvas"))
    size = driver.execute_script(
        "const c = document.querySelector('#chart canvas'); return [c.width, c.height]"
    )
    assert size[0] > 300 and size[1] > 100, size
    legend = texts(driver, "#chart .u-legend .u-series th")
    assert {"prepare", "commit", "snapshot", "durable", "bytes"} <= {t.strip() for t in legend}


def test_a_checkpoints_detail_lists_its_members_and_the_failure(dashboard: Dashboard) -> None:
    driver = dashboard.driver
    open_detail(driver, REFUSED)
    summary = dict(
        zip(texts(driver, "#detail-summary dt"), texts(driver, "#detail-summary dd"), strict=True)
    )
    assert summary["status"] == "failed"
    assert summary["reason"] == "PARTICIPANT_FAILED"
    assert summary["failed members"] == "counter"
    assert "participant subdirectory 'counter' is not a directory" in summary["message"]
    members = {row[0]: row for row in table(driver, "#detail-members")}
    assert sorted(members) == ["counter", "weather"]
    assert members["counter"][10] == "INVALID_REQUEST" and members["weather"][10] == ""
    assert members["counter"][2].endswith(" s")  # it prepared: a time, not "never"
    assert [row[0] for row in table(driver, "#detail-stages")] == ["prepare", "commit"]

    open_detail(driver, ASYNC)
    members = {row[0]: row for row in table(driver, "#detail-members")}
    assert members["counter"][8] == "1" and members["counter"][11].endswith("/counter")


def test_members_health_is_shown(dashboard: Dashboard) -> None:
    driver = dashboard.driver
    wait(driver).until(lambda d: set(fleet_cells(d)) == {"counter", "weather"})
    rows = fleet_cells(driver)
    for name, cells in rows.items():
        assert cells[2] == dashboard.fleet.servers[name].announced["grpc"]
        assert cells[3] == "serving" and cells[4] == "ready", cells
        assert cells[5] == "IDLE, admission open", cells


def test_a_hostile_attempt_renders_as_text(dashboard: Dashboard) -> None:
    driver = dashboard.driver
    row = history_row(driver, HOSTILE_ID)
    assert row[10] == f"PARTICIPANT_FAILED ({HOSTILE_MEMBER})"
    markup = driver.execute_script(
        "return document.querySelectorAll('main img, main script, main b, main i').length"
    )
    assert markup == 0
    assert driver.execute_script("return window.pwned === undefined")


def test_the_page_loads_nothing_from_elsewhere_and_sends_its_policy(dashboard: Dashboard) -> None:
    driver = dashboard.driver
    history_row(driver, REFUSED)
    origin = driver.execute_script("return location.origin")
    loaded = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert loaded and all(name.startswith(origin + "/") for name in loaded), loaded
    assert console_errors(driver) == []

    for path in ("/", "/static/app.js", "/static/uPlot.iife.min.js"):
        served = dashboard.api(path, token=None)
        assert served.status_code == 200, path
        for name, value in SECURITY_HEADERS.items():
            assert served.headers[name] == value, (path, name)
    # Not one of the page's files: never served (a `/` inside the name is no static route).
    assert dashboard.api("/static/..%2F__init__.py", token=None).status_code != 200
    assert dashboard.api("/static/vendored.json", token=None).status_code == 404
    for path in ("/checkpoints", "/fleet/status", f"/checkpoints/{REFUSED}"):
        assert dashboard.api(path, token=None).status_code == 401, path
        assert dashboard.api(path, token="wrong").status_code == 401, path


def test_a_new_checkpoint_and_a_member_down_show_without_a_reload(dashboard: Dashboard) -> None:
    driver = dashboard.driver
    history_row(driver, REFUSED)
    driver.execute_script("window.stillTheSamePage = true")
    take_checkpoints(dashboard.fleet, ("ckpt-live",))
    assert history_row(driver, "ckpt-live")[4] == "completed"

    kill_group(dashboard.fleet.servers["weather"].popen)
    started = time.monotonic()
    wait(driver).until(lambda d: fleet_cells(d)["weather"][3] == "unreachable")
    assert time.monotonic() - started < 60
    assert fleet_cells(driver)["counter"][3] == "serving"
    assert driver.execute_script("return window.stillTheSamePage === true")
    assert driver.execute_script("return performance.getEntriesByType('navigation').length") == 1
    assert console_errors(driver) == []


def test_the_screenshot_script_says_how_to_call_it() -> None:
    done = run("bash", REPO / "scripts" / "dashboard-screenshot")
    assert (done.returncode, done.stderr.strip()) == (
        2,
        "usage: scripts/dashboard-screenshot OUT.png",
    )
