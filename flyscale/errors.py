"""Errors a user acts on: bad config, bad data, a run that cannot go on as configured.

Each is a ValueError for Python callers and a click exception for the command line, so
`pyflyte run` ends with its message alone (one or two lines, the failing task named), not with
a screen of traceback: pyflyte hands click exceptions to click, which prints them. The traceback
stays available: `pyflyte -v run ...` or FLYSCALE_VERBOSE=1 prints it before the message.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import click

from flyscale import settings


def verbose() -> bool:
    """True when the user asked for tracebacks: FLYSCALE_VERBOSE=1, or pyflyte's own -v."""
    if settings.VERBOSE.get() == "1":
        return True
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.find_root().params.get("verbose"))


class UserError(click.ClickException, ValueError):
    """A problem with what the user gave, whose message says what is wrong and where."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.verbose = verbose()  # asked now, while pyflyte's command (and its -v) is still current

    def format_message(self) -> str:
        # str(self), not the message it was made with: where a local run's flytekit puts the
        # failing task's name in front of it, that stays. (pyflyte prints this with rich-click,
        # which never calls show(): asked for, the traceback comes with the message.)
        return self.with_traceback_if_asked(str(self))

    def with_traceback_if_asked(self, message: str) -> str:
        """`message`, preceded by the traceback when the user asked for tracebacks."""
        if not self.verbose:
            return message
        trace = "".join(traceback.format_exception(self)).rstrip()
        return trace if message == str(self) else f"{trace}\n\n{message}"


class RunInterrupted(click.ClickException):
    """The run was stopped by a signal (a Ctrl-C): its one line, where training stopped and what
    the same command does next, and the shell's exit code for the signal (128 + N: 130 for
    SIGINT), not a traceback."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it from the instance


class InvariantBroken(RuntimeError):
    """A promise flyscale makes about the data (every row accounted for, splits disjoint) did not
    hold: a bug in flyscale or a plugin, never the user's data. A real error, not an `assert`,
    so `python -O` cannot strip the check."""


def require(holds: bool, message: str) -> None:
    """Raise InvariantBroken with `message` unless `holds`."""
    if not holds:
        raise InvariantBroken(f"{message} (a bug in flyscale or a plugin: please report it with this message)")


class DataError(UserError):
    """The data cannot be used as it is: the message names the file, the column or the rows."""


@contextlib.contextmanager
def data_errors(where: str) -> Iterator[None]:
    """A dataset plugin's ValueError or OSError (a missing file, a bad value) as a DataError that
    names the plugin; anything else stays what it is (a bug is not the user's data)."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, OSError) as exc:
        raise DataError(f"{where}: {exc}") from exc
