"""Running a page's command blocks as a reader would, and checking what they print.

A section's commands run in one bash, in order, against the real servers its own
`rollout-checkpoint serve` lines start (on free ports in place of the page's). Each command's
output (stdout and stderr, in order) must match the `#` lines right under it: line for line,
`…` or `...` standing for any text, and a trailing `  <- note` ignored. A command with no
documented output must exit 0. Used by the pages whose commands show their output
(docs/grpcurl.md, docs/your-server.md's several workers).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from rollout_checkpoint.client.fleet.ports import restartable_ports

from .processes import REPO, run_shell_script

STEP = "@@step@@"
NOTE = re.compile(r"\s+<- .*$")
SERVE_WAIT_SECONDS = 60
# A page's checkpoint directories (`/tmp/ckpt-…`) go under the test's tmp_path.
CHECKPOINT_DIR = re.compile(r"/tmp/(ckpt-[\w-]+)")
# The ports pages listen on (the tour's, a two-member fleet's, examples/fleet.toml's): a run
# takes free ones instead.
PAGE_PORTS = (
    *("8001", "9001", "8002", "9002"),
    *(f"{plane}{member}" for plane in ("81", "91") for member in ("01", "02", "03", "04", "05")),
)
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(?P<word>\w+)\1")


def free_port() -> int:
    """A port below the ephemeral range: a page may restart a server on its port."""
    return restartable_ports(1)[0]


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


def steps(blocks: list[str]) -> list[Step]:
    """Every command of the page's `sh` blocks with the output lines documented under it. A
    command goes on over continuation lines (`\\`) and through a here-document's body, up to
    its delimiter line."""
    found: list[Step] = []
    for block in blocks:
        current: Step | None = None
        continuing = False
        until: str | None = None  # the delimiter of the here-document being read
        for line in block.splitlines():
            if until is not None and current is not None:
                current.command += "\n" + line
                until = None if line == until else until
            elif continuing and current is not None:
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
                heredoc = HEREDOC.search(line)
                until = heredoc["word"] if heredoc else None
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
    """`text` with each of the page's ports replaced by its free one, in one pass: a free port
    that happens to contain another page port is never rewritten again."""
    pattern = r"\b(" + "|".join(map(re.escape, ports)) + r")\b"
    return re.sub(pattern, lambda port: ports[port[0]], text)


def script(page_steps: list[Step], ports: dict[str, str], tmp_path: Path) -> str:
    """One bash script: each step's combined output framed by markers; a server's first line
    (its announce line) read from its own log once it listens."""
    lines = ["trap 'kill -9 $(jobs -p) 2>/dev/null' EXIT"]
    for index, step in enumerate(page_steps):
        command = CHECKPOINT_DIR.sub(
            lambda m: str(tmp_path / m[1]), substituted(step.command, ports)
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


def differences(page_steps: list[Step], tmp_path: Path, seconds: float) -> tuple[list[str], str]:
    """Run `page_steps` in `tmp_path` (where `protos`, `third_party`, `tests` and `examples` link to this
    repository's); each command whose output differs from the page's, and bash's stderr."""
    ports = {port: str(free_port()) for port in PAGE_PORTS}
    for link in ("protos", "third_party", "tests", "examples"):
        (tmp_path / link).symlink_to(REPO / link)
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        GRPC_VERBOSITY="ERROR",
    )
    ran = run_shell_script(script(page_steps, ports, tmp_path), tmp_path, env, seconds)
    wrong = []
    for step, (actual, code) in zip(page_steps, outputs(ran.stdout, len(page_steps)), strict=True):
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
    return wrong, ran.stderr
