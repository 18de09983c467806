"""How every mt command ends on an error: one line naming what is at fault, and one rule for
the exit status.

- 2, bad input: what the user can mend and rerun: a wrong flag, file, config, checkpoint or
  dataset (``ValueError`` and the kinds the command names), or the operating system refusing
  a path or address it was given (``OSError``: missing, no permission, a folder where a file
  goes, a port in use);
- 1, a failed run: a rank died or raised what no one expected (:class:`LaunchFailed`), the
  machine ran out of room (``OSError`` of a full disk, a file size limit, no memory, a device
  error: the input was fine), or the run failed on its own terms (the kinds the command names,
  e.g. a diverged loss);
- 130, interrupted: a second SIGINT / SIGTERM (:class:`Interrupted`) or Ctrl-C.

Anything else is a bug and keeps its traceback. No torch here: `mt data` and `mt plan` start
without it.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["BAD_INPUT", "FAILED", "INTERRUPTED", "Interrupted", "LaunchFailed", "exit_code",
           "one_line_errors"]

BAD_INPUT, FAILED, INTERRUPTED = 2, 1, 130
#: The operating system's errors that say the machine, not the input, failed the run.
_OUT_OF_ROOM = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOMEM, errno.EIO})


class LaunchFailed(RuntimeError):
    """A rank of a local multi-process run failed; the message holds its traceback, ``cause``
    says in a few words which rank failed how (``rank 2 of 4 killed by SIGKILL``), ``stacks``
    what every rank was doing, ``ranks`` which ranks were at fault (the one that failed
    first, or those that hung; none when the whole run ran out of time)."""

    def __init__(self, message: str, cause: str | None = None,
                 stacks: dict[int, str] | None = None, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.cause = cause or (message.splitlines() or [""])[0]
        #: Every rank's last words by rank: the traceback of a rank that failed, the Python
        #: stack of one that hung (dumped on request before it was killed).
        self.stacks = dict(stacks or {})
        self.ranks = tuple(ranks)


class Interrupted(RuntimeError):
    """A second SIGINT / SIGTERM stopped the run at once."""


def exit_code(err: BaseException, expected: tuple[type[BaseException], ...] = (),
              failed: tuple[type[BaseException], ...] = ()) -> int | None:
    """The exit status ``err`` ends a command with (the module docstring's rule), or None for
    an error that is a bug (``expected``: more kinds of bad input; ``failed``: more kinds of
    failed run)."""
    if isinstance(err, (Interrupted, KeyboardInterrupt)):
        return INTERRUPTED
    if isinstance(err, (LaunchFailed, *failed)) or (
            isinstance(err, OSError) and err.errno in _OUT_OF_ROOM):
        return FAILED
    if isinstance(err, (ValueError, OSError, *expected)):
        return BAD_INPUT
    return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def one_line_errors(expected: tuple[type[BaseException], ...] = (),
                    failed: tuple[type[BaseException], ...] = (),
                    say: Callable[[str], None] = _stderr) -> Iterator[None]:
    """Errors raised inside end the command by :func:`exit_code`'s rule, as one line
    (``say("error: MESSAGE")``) and ``SystemExit``; a bug propagates with its traceback."""
    try:
        yield
    except BaseException as err:  # noqa: BLE001 - sorted by the rule; the rest re-raised
        code = exit_code(err, expected, failed)
        if code is None:
            raise
        say(f"error: {str(err) or type(err).__name__.lower()}")
        raise SystemExit(code) from None
