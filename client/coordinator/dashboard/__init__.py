"""The coordinator's dashboard: one page and its assets, shipped in the package and served by
the coordinator's HTTP port at `/` and `/static/<name>`.

The page holds no data: it reads the JSON API (`/checkpoints`, `/checkpoints/{id}`, and
`/fleet/status`, added here: `fleet_status`) with the bearer token the operator gives it, so
the page and its files are served without one (`dashboard_app` routes them before the API's
token middleware) and everything it shows stays behind the token.

Why each rule:

* **Only the files of `ASSETS`**, by exact name: a path parameter is never joined to a
  directory, so no request can read anything else of the package or the disk.
* **Nothing from the network** (no CDN, no web font): a coordinator runs where the internet
  may not be, and a page that loaded a script from elsewhere would hand that host the token.
  The chart is uPlot, vendored beside the page (`vendored.json` holds its version and
  digests; tests/test_dashboard_assets.py fails when a vendored file is edited by hand).
* **`SECURITY_HEADERS`**: `default-src 'self'` lets the page load only this origin's files and
  run no inline script, so a checkpoint id or failure message that made it into the markup
  as markup still could not run; `form-action 'none'` stops the token form from ever being
  submitted as a GET (which would put the token in a query string and so in access logs)
  if its script did not load.
* **Read once, on a thread**: the assets (about 70 KB) are read from the package on the
  first request, through `asyncio.to_thread`, never on the event loop that also serves the
  coordinator's RPCs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import resources

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from rollout_checkpoint.client.coordinator.dashboard.fleet_status import FleetStatus, HeldFleet
from rollout_checkpoint.client.fleet import FleetSpec

PAGE = "index.html"
STATIC_PREFIX = "/static/"
ASSETS: dict[str, str] = {
    PAGE: "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
"""Every file the dashboard serves, with its media type."""
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'; object-src 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def dashboard_app(
    api: Starlette, spec: FleetSpec, held: HeldFleet, operating: Callable[[], bool]
) -> Starlette:
    """The coordinator's HTTP app with the dashboard: the page and its files first (no
    token: they hold no data), then `api` (`http_api.coordinator_app`, behind the token) for
    every other path, with `/fleet/status` added to it (asked through the coordinator's
    `held` fleet, and not while `operating()`: see `fleet_status`)."""
    status = FleetStatus(spec, held, operating)

    async def fleet_status(request: Request) -> Response:
        return JSONResponse(await status.read())

    api.add_route("/fleet/status", fleet_status, methods=["GET"])
    return Starlette(routes=[*dashboard_routes(), Mount("", app=api)])


class DashboardAssets:
    """The dashboard's files, read from the package once."""

    def __init__(self) -> None:
        self._files: dict[str, bytes] | None = None
        self._loading = asyncio.Lock()

    async def read(self, name: str) -> bytes:
        """The bytes of `name` (one of `ASSETS`)."""
        async with self._loading:
            if self._files is None:
                self._files = await asyncio.to_thread(_read_package_files)
        return self._files[name]


def _read_package_files() -> dict[str, bytes]:
    folder = resources.files(__name__)
    return {name: folder.joinpath(name).read_bytes() for name in ASSETS}


def dashboard_routes(assets: DashboardAssets | None = None) -> list[Route]:
    """The page at `/` and its files at `/static/<name>` (404 for any other name)."""
    files = assets or DashboardAssets()

    async def page(request: Request) -> Response:
        return await _served(files, PAGE)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS or name == PAGE:
            return Response("not found\n", status_code=404, media_type="text/plain")
        return await _served(files, name)

    return [
        Route("/", page, methods=["GET"]),
        Route(STATIC_PREFIX + "{name}", static, methods=["GET"]),
    ]


async def _served(files: DashboardAssets, name: str) -> Response:
    return Response(await files.read(name), media_type=ASSETS[name], headers=dict(SECURITY_HEADERS))
