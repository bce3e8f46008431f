"""Keeps what orbax's abandoned reads print from burying the one error a failed restore raises.

When one array of a restore cannot be read (a data file is missing or corrupt), orbax raises at
once and closes its event loop while the other reads are still in flight in tensorstore. Each of
them then fails again, later and on other threads, and Python prints every one: a traceback per
callback that finds the loop closed (through ``sys.excepthook``), "Task exception was never
retrieved" (the ``asyncio`` logger) and "Exception ignored in" (``sys.unraisablehook``). All of
them repeat the failure the restore already raised.

``quiet_abandoned_reads`` installs a filter on each of the three channels for the duration of a
restore. Only reports that are recognisably these repeats are dropped; everything else goes on
to the handler that was there before. After a failed restore the filters stay (the abandoned
reads may report until the process exits); after a successful one they are removed.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

_READ_FAILURE = "Encountered error while reading"  # orbax's message for a failed array read
_LOOP_CLOSED = "Event loop is closed"


def _is_repeat(error: BaseException | None) -> bool:
    if error is None:
        return False
    text = str(error)
    if isinstance(error, RuntimeError) and text == _LOOP_CLOSED:
        return True
    return text.startswith(_READ_FAILURE)


class _AsyncioFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not _is_repeat(error)


@contextlib.contextmanager
def quiet_abandoned_reads() -> Iterator[None]:
    """Filters the repeats of a failed orbax read while the body runs (and after, if it raised)."""
    previous_excepthook = sys.excepthook
    previous_unraisablehook = sys.unraisablehook
    log_filter = _AsyncioFilter()

    def excepthook(kind, error, traceback):
        if not _is_repeat(error):
            previous_excepthook(kind, error, traceback)

    def unraisablehook(unraisable):
        if not _is_repeat(unraisable.exc_value):
            previous_unraisablehook(unraisable)

    sys.excepthook = excepthook
    sys.unraisablehook = unraisablehook
    logging.getLogger("asyncio").addFilter(log_filter)
    try:
        yield
    except BaseException:
        raise  # the filters stay: abandoned reads may report until the process exits
    else:
        if sys.excepthook is excepthook:
            sys.excepthook = previous_excepthook
        if sys.unraisablehook is unraisablehook:
            sys.unraisablehook = previous_unraisablehook
        logging.getLogger("asyncio").removeFilter(log_filter)
