"""SIGTERM the way Heroku sends it: to every process of the dyno, SIGKILL 30 s later.

A worker must stop taking runs, let the runs in flight finish within
``POIMEN_SHUTDOWN_GRACE`` seconds (default 25), and leave whatever still runs
at that deadline to repair, never half-finished.

Celery's main process already does the first part: SIGTERM is its warm
shutdown (stop consuming, wait for the pool). Its prefork pool processes,
though, exit on SIGTERM at once (billiard's handler), so the dyno-wide SIGTERM
kills every run in flight, and a 5-second run starts again from the top on
another worker. So a pool process handles SIGTERM itself while it executes a
task (:func:`task_starting`, at ``task_prerun``: billiard has installed its
own handler by then, and replaces any installed earlier):

* the first SIGTERM during a task is noted (:func:`shutting_down` turns true,
  which workflows see as ``ctx.shutting_down`` and may checkpoint on) and
  starts the ``POIMEN_SHUTDOWN_GRACE`` deadline; the task goes on;
* at the deadline, or on a second SIGTERM (billiard's pool terminate in a cold
  shutdown, an impatient operator), the process exits at once. Its boot's lock
  goes with it, so the run it held is a dead boot's: Celery requeues its
  message (``task_reject_on_worker_lost``) and beat re-sends it, and the next
  worker takes it over. A finish is one fenced transaction, so nothing is ever
  finished twice or half;
* a SIGTERM while idle (no task, nothing to protect) ends the process at once,
  so an idle pool never delays a shutdown.

A pool process leads a process group of its own (``workers/proctree.py``:
the fence ends a body's children with it), so a SIGTERM to the worker's group
reaches only the main process. The main process records it
(``worker_shutting_down``), so :func:`shutting_down` means the same in both,
and passes it on as ``proctree.NOTICE``, which a pool process reads as the
shutdown's SIGTERM: the first of the two (Heroku's SIGTERM reaches every
process of the dyno, the notice follows it, either may come first) starts the
grace, and a second SIGTERM, or a second notice (the worker's group got SIGTERM
again), ends the process at once. At the grace's
end, the pool process's exit ends its process group too (its guardian). What was measured, and why not
Celery's own soft shutdown or ``REMAP_SIGTERM``: ``docs/internals/reliability.md``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

from poimenconfig import DEFAULT_SHUTDOWN_GRACE

from .proctree import NOTICE

log = logging.getLogger(__name__)

# Exit status of a pool process that gave up its run at the deadline (EX_TEMPFAIL).
EXIT_ABANDONED = 75

_received_at: float | None = None  # time.monotonic() of this process's first SIGTERM
_sigterms = 0  # SIGTERMs received (directly: Heroku's, an operator's, billiard's)
_notices = 0  # the main process's notices of a SIGTERM it received (proctree.NOTICE)
_grace = DEFAULT_SHUTDOWN_GRACE
_in_pool_process = False
_executing = False
_lock = threading.Lock()
_abandon_timer: threading.Timer | None = None  # the batching worker's (abandon_after)


def shutting_down() -> bool:
    """Whether this process got SIGTERM: finish soon, or checkpoint and stop."""
    return _received_at is not None


def seconds_left() -> float | None:
    """Seconds until this process gives up its run (None if not shutting down)."""
    if _received_at is None:
        return None
    return max(0.0, _received_at + _grace - time.monotonic())


def mark_received() -> None:
    """Record SIGTERM (the main process: Celery's own handler has received it)."""
    global _received_at
    with _lock:
        if _received_at is None:
            _received_at = time.monotonic()


def init_pool_process(grace: float) -> None:
    """In a fresh pool process: remember the grace, ``POIMEN_SHUTDOWN_GRACE`` (``worker_process_init``)."""
    global _in_pool_process, _grace
    _in_pool_process = True
    _grace = grace


def task_starting() -> None:
    """Before a task in a pool process: SIGTERM now protects it (``task_prerun``)."""
    global _executing
    if not _in_pool_process:
        return  # the solo/threads pools run tasks in the main process: Celery's handler rules
    _executing = True
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(NOTICE) is not _on_notice:
        signal.signal(NOTICE, _on_notice)


def task_finished() -> None:
    """After a task in a pool process (``task_postrun``)."""
    global _executing
    _executing = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _sigterms
    _sigterms += 1
    if _sigterms > 1 or not _executing:
        _die(signum)  # the second SIGTERM, or nothing in flight to protect
    _start_grace()


def _on_notice(signum: int, frame: FrameType | None) -> None:
    # The main process's word of a SIGTERM it got (proctree.tell_pool): the same
    # shutdown as Heroku's SIGTERM to this process, so the two count once; the main
    # process's second SIGTERM is a second one.
    global _notices
    _notices += 1
    if _notices > 1 or not _executing:
        _die(signal.SIGTERM)  # as that SIGTERM to the pool process would have
    _start_grace()


def _start_grace() -> None:
    global _received_at
    if _received_at is not None:
        return  # the shutdown's SIGTERM and its notice: one grace
    _received_at = time.monotonic()
    log.warning("SIGTERM: finishing the run in flight; giving it up in %.0fs", _grace)
    timer = threading.Timer(_grace, _abandon, args=(f"the {_grace:.0f}s shutdown grace",))
    timer.daemon = True
    timer.start()


def abandon_after(grace: float) -> None:
    """The batching worker's grace (one process, its runs in threads): Celery's warm
    shutdown lets them finish; at the deadline the process exits and leaves what still
    runs to repair, as a pool process does. Called after ``mark_received`` (which starts
    no timer: a prefork main process has none to give up)."""
    global _grace, _abandon_timer
    with _lock:
        if _abandon_timer is not None:
            return  # a second SIGTERM: Celery's own cold shutdown follows
        _grace = grace
        log.warning("SIGTERM: finishing the runs in flight; giving them up in %.0fs", grace)
        _abandon_timer = threading.Timer(
            grace, _abandon, args=(f"the {grace:.0f}s shutdown grace",))
        _abandon_timer.daemon = True
        _abandon_timer.start()


def _die(signum: int) -> None:
    """End the process by ``signum`` itself, as the default action would."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _abandon(why: str) -> None:
    # Exit now, from the timer's thread: no Python cleanup may write for the run
    # any more. Postgres drops the boot's lock with the connection, which makes
    # the run a dead boot's, taken over by the next worker.
    log.warning("pool process %s exits after %s; its run is left to repair", os.getpid(), why)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001, S110 - exiting anyway
            pass
    os._exit(EXIT_ABANDONED)
