"""How a run ended, and the two stops and one failure a run is told apart by."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..progress import RunStats


class Status(str, Enum):
    """How a run ended."""

    DONE = "done"                      # every item of the run was captioned (or there was nothing to do)
    SOME_FAILED = "some_failed"        # some items failed (their rows carry an error), or some inputs gave none
    NO_MEDIA = "no_media"              # the inputs hold no media
    INTERRUPTED = "interrupted"        # KeyboardInterrupt (Ctrl-C): finished rows are saved
    TERMINATED = "terminated"          # `Terminated` (SIGTERM): finished rows are saved
    STDOUT_CLOSED = "stdout_closed"    # the stream's reader went away ('-o - | head')
    CRASHED = "crashed"                # a bug, a failed device, a full disk: finished rows are saved


@dataclass
class RunOutcome:
    """How a run ended, what it wrote and how to go on."""

    status: Status
    message: str                                    # one line: the summary, or why and where rows are
    stats: RunStats | None = None
    summary: list[tuple[str, str]] = field(default_factory=list)   # the closing summary (a finished run)
    error: BaseException | None = None              # what crashed the run, for a traceback
    output: str | None = None                       # where a finished run's rows are (None: stdout)

    @property
    def ok(self) -> bool:
        return self.status in (Status.DONE, Status.NO_MEDIA)


class Terminated(BaseException):
    """SIGTERM arrived (a timeout, a scheduler, `docker stop`): the CLI raises it to stop a run like Ctrl-C."""


class LoadingCrashed(Exception):
    """Loading the model failed on a bug of this tool, not on the model given (its cause has the traceback)."""


def stopped_by(stop: BaseException) -> tuple[Status, str]:
    """The status and the word for a stop (Ctrl-C or `Terminated`)."""
    return (Status.INTERRUPTED, "interrupted") if isinstance(stop, KeyboardInterrupt) \
        else (Status.TERMINATED, "terminated")
