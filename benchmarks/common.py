"""What every benchmark shares: statistics, figures, ratios, and the server processes.

Every server runs as a child process of the benchmark in its own process group (killed as a
group when the benchmark ends, whatever happens), logs to a file in the work directory and
announces its addresses with one JSON line on stdout (`examples/serve/`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVE = ("-m", "rollout_checkpoint.examples.serve")
START_TIMEOUT_SECONDS = 60.0
SPREAD = "min-max"
"""Every figure is the median over its repeats, with the min-max over the same repeats."""


# -- statistics -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = math.ceil(position)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Figure:
    """One reported number: the median of `samples` (one per repeat) and its spread."""

    case: str
    metric: str
    unit: str
    samples: list[float]
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        values = [v for v in self.samples if not math.isnan(v)]
        return {
            "case": self.case,
            "metric": self.metric,
            "unit": self.unit,
            "median": statistics.median(values) if values else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
            "n": len(values),
            "samples": [round(v, 6) for v in values],
            "note": self.note,
        }


@dataclass
class Ratio:
    """`numerator / denominator`, measured side by side: the median of the per-repeat ratios."""

    name: str
    numerator: str
    denominator: str
    samples: list[float]
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        values = [v for v in self.samples if not math.isnan(v) and not math.isinf(v)]
        return {
            "name": self.name,
            "numerator": self.numerator,
            "denominator": self.denominator,
            "median": statistics.median(values) if values else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
            "n": len(values),
            "note": self.note,
        }


def spread(samples: Sequence[float]) -> dict[str, Any]:
    """The median of `samples`, their min and max, and the samples (a script's JSON line)."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
        "samples": [round(s, 4) for s in samples],
    }


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-repeat ratios a[i] / b[i] (the repeats of a and b ran interleaved)."""
    return [x / y if y else math.nan for x, y in zip(a, b, strict=True)]


@dataclass
class BenchResult:
    name: str
    title: str
    measures: str
    figures: list[Figure] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: str = ""
    """Why it measured nothing (what it needs is absent here); empty when it ran."""

    def figure(
        self, case: str, metric: str, unit: str, samples: Iterable[float], note: str = ""
    ) -> None:
        self.figures.append(Figure(case, metric, unit, list(samples), note))

    def ratio(
        self,
        name: str,
        numerator: str,
        denominator: str,
        samples: Iterable[float],
        note: str = "",
    ) -> None:
        self.ratios.append(Ratio(name, numerator, denominator, list(samples), note))

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "measures": self.measures,
            "params": self.params,
            "seconds": round(self.seconds, 2),
            "skipped": self.skipped,
            "figures": [f.to_json() for f in self.figures],
            "ratios": [r.to_json() for r in self.ratios],
        }


# -- processes ------------------------------------------------------------------------------


@dataclass
class Server:
    """One server process: its announced addresses and its log."""

    name: str
    process: subprocess.Popen[str]
    http: str
    grpc: str | None
    log: Path
    announced: dict[str, Any]

    @property
    def url(self) -> str:
        return f"http://{self.http}"


def rss_bytes(server: Server) -> int:
    """The process's resident set (VmRSS) from /proc."""
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {server.name}")


class Processes:
    """Every process a benchmark run starts; all are killed (as groups) on `close()`."""

    def __init__(self, workdir: Path, token: str) -> None:
        self.workdir = workdir
        self.token = token
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._started: list[subprocess.Popen[str]] = []
        self._count = 0

    def launch(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        python: Path | None = None,
        cwd: Path = REPO,
    ) -> Server:
        """Start `python <argv>` in its own process group; wait for its announcement line.

        `python`: another interpreter than this one (the env beside nemo-gym); it then gets
        this environment minus what would point it at our venv."""
        self._count += 1
        log = self.logs / f"{self._count:03d}-{name}.log"
        inherited = dict(os.environ)
        if python is not None:
            for variable in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
                inherited.pop(variable, None)
        with log.open("w") as stderr:
            process = subprocess.Popen(
                [str(python or sys.executable), *argv],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,
                env=dict(inherited, GRPC_VERBOSITY="ERROR", **(env or {})),
                cwd=cwd,
            )
        self._started.append(process)
        assert process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            ready = selector.select(START_TIMEOUT_SECONDS)
        line = process.stdout.readline() if ready else ""
        if not line:
            self.stop(process, kill=True)
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} did not start; its log ({log}):\n{tail}")
        announced = json.loads(line)
        return Server(
            name, process, announced.get("http", ""), announced.get("grpc"), log, announced
        )

    def serve(self, name: str, kind: str, *args: str, env: dict[str, str] | None = None) -> Server:
        """An example server (`examples/serve/`) with its sidecar and the run's token."""
        return self.launch(
            name, [*SERVE, kind, f"--token={self.token}", "--instance", name, *args], env=env
        )

    async def serve_many(self, specs: Sequence[tuple[str, str, Sequence[str]]]) -> list[Server]:
        """Start several example servers at once: (name, kind, extra args) each."""
        return list(
            await asyncio.gather(
                *(asyncio.to_thread(self.serve, name, kind, *args) for name, kind, args in specs)
            )
        )

    def stop(self, process: subprocess.Popen[str], *, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL) the process group and reap it; SIGKILL after 10 s."""
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
        with contextlib.suppress(ValueError):
            self._started.remove(process)

    def stop_servers(self, servers: Iterable[Server], *, kill: bool = True) -> None:
        servers = list(servers)
        for server in servers:
            if server.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        for server in servers:
            self.stop(server.process, kill=True)

    def close(self) -> None:
        for process in list(self._started):
            self.stop(process, kill=True)


# -- timing ---------------------------------------------------------------------------------


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], *, interval: float = 0.005, within: float = 120.0
) -> None:
    """Poll another process (a status RPC) until `predicate()` holds; TimeoutError after `within`."""
    async with asyncio.timeout(within):
        while not await predicate():  # noqa: ASYNC110 - the state lives in another process
            await asyncio.sleep(interval)


def now() -> float:
    return time.perf_counter()


def ms(seconds: float) -> float:
    return seconds * 1000.0


def deadline_in(seconds: float) -> float:
    """An absolute wall-clock deadline, as the control RPCs take it."""
    return time.time() + seconds
