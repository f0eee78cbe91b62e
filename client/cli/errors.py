"""How the client library's exceptions end a fleet verb: the exit code and the one line.

`classify` is what `console.run_verb` calls for an exception no verb turned into a `CliError`;
a conflict's refusal names the active checkpoint, so the operator knows what to resume."""

from __future__ import annotations

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointCorrupt,
    PublicationError,
    reason_of,
)
from rollout_checkpoint.client.cli.console import CliError, ExitCode
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError, FleetConfigError
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.server.core.extras import MissingExtra


def classify(error: BaseException) -> CliError | None:
    """The exit code and one line for an exception of the client library (None: a bug)."""
    if isinstance(error, MissingExtra):  # e.g. --reflection without grpcio-reflection
        return CliError(ExitCode.USAGE, str(error))
    if isinstance(error, FleetConfigError):
        return CliError(ExitCode.USAGE, str(error))
    if isinstance(error, DiscoveryError):
        refused = error.refused  # e.g. a wrong token: waiting will not help
        return CliError(
            ExitCode.REFUSED if refused else ExitCode.UNREACHABLE,
            str(error),
            Reason.PARTICIPANT_FAILED if refused else Reason.PARTICIPANT_UNREACHABLE,
            {"failures": error.failures},
        )
    if isinstance(error, FleetError):
        return CliError(
            ExitCode.UNREACHABLE
            if error.reason == Reason.PARTICIPANT_UNREACHABLE
            else ExitCode.REFUSED,
            fleet_error_line(error),
            error.reason,
            {"failures": fanout.describe_failures(error)},
        )
    if isinstance(error, ControlError):
        return control_error(error)
    if isinstance(error, CheckpointCorrupt):
        return CliError(ExitCode.CORRUPT, str(error), Reason.INVALID_CHECKPOINT_STATE)
    if isinstance(error, PublicationError):
        # A store that failed or did not answer by the deadline is STORAGE_FAILED (retry),
        # never a malformed checkpoint.
        return CliError(ExitCode.REFUSED, str(error), reason_of(error))
    if isinstance(error, OSError) and error.filename is not None:
        # A fleet file, a token file or a checkpoint root that cannot be read or made.
        return CliError(ExitCode.USAGE, f"{error.filename}: {error.strerror or error}")
    if isinstance(error, ValueError):
        return CliError(ExitCode.USAGE, str(error))
    return None


CONFLICT_METADATA = "activeCheckpointId"


def control_error(error: ControlError) -> CliError:
    """One participant's refusal (exit 4, or 6 for a checkpoint that does not verify) or a
    transport failure (exit 5), naming the active checkpoint of a conflict."""
    if not error.decided_by_server:
        return CliError(
            ExitCode.UNREACHABLE,
            f"{error.code.name}: {error.message}",
            Reason.PARTICIPANT_UNREACHABLE,
        )
    code = ExitCode.CORRUPT if error.reason == Reason.INVALID_CHECKPOINT_STATE else ExitCode.REFUSED
    return CliError(
        code,
        error.message + active_suffix(error),
        error.reason,
        {"code": error.code.name, "metadata": error.metadata},
    )


def active_suffix(error: ControlError) -> str:
    """` (active checkpoint: ID)` for a conflict refusal whose message does not name it."""
    active = error.metadata.get(CONFLICT_METADATA)
    if active and active not in error.message:
        return f" (active checkpoint: {active})"
    return ""


def fleet_error_line(error: FleetError) -> str:
    """One line naming every member that failed and why."""
    details = "; ".join(
        f"{name}: {failure.reason or failure.code.name}: {failure.message}{active_suffix(failure)}"
        for name, failure in error.failures.items()
    )
    return f"{error.operation} failed on {len(error.failures)} member(s): {details}"
