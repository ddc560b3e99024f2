"""A run's body and everything it starts end together: one process group per pool process.

The lease's fence (``lease.KillFence``, ``workers/boots.py``), ``kill -9`` of a
pool process, the end of the SIGTERM grace (``workers/shutdown.py``) and every
``os._exit`` of a pool process stop the *pool process*. A body's children
(``subprocess.run(["ffmpeg", ...])``, a shell loop, a ``multiprocessing``
fork) are other processes: left alone, they run on while a rescuer starts the
run again, and two executions overlap. So:

* each prefork pool process leads a process group of its own
  (:func:`lead_own_group`, at ``worker_process_init``, before it takes any
  task): everything a body starts, and everything that starts, is in that
  group unless it leaves it itself (``setsid``, ``setpgid``);
* next to it runs a *guardian* (``/bin/sh``, about a megabyte), in the same
  group, reading a pipe whose only writer is the pool process. The kernel
  closes that pipe when the pool process dies, however it dies (the fence's
  SIGKILL, an operator's ``kill -9``, ``os._exit``, Celery's parent-death
  SIGKILL when the main process dies), and the guardian then SIGKILLs the
  whole group (``kill -s KILL -- -<group>``): the body's tree ends within
  milliseconds of the pool process, without the main process, the database or
  the pool process's interpreter. It ignores every catchable signal, so only
  SIGKILL (the group's own end, or a whole container's) stops it first;
* a forked child of the pool process (``os.fork``, ``multiprocessing``) closes
  its copy of the pipe at once (:func:`_forget_guardian_in_child`), or the pipe
  would stay open while that child lives. ``subprocess`` children never get it
  (the descriptor is close-on-exec).

Signals to the worker's own group no longer reach pool processes (a terminal's
Ctrl-C, a Procfile runner's or a test's ``killpg``). The main process passes
on what they need (:func:`tell_pool`, from ``worker_shutting_down``): a warm
shutdown by SIGTERM becomes :data:`NOTICE` to each pool process, which starts
the SIGTERM grace there (``workers.shutdown``; Heroku's own SIGTERM to every
process of the dyno still arrives too, and the two count once), a Ctrl-C's
SIGINT goes on to each pool group as the terminal would have sent it, and a
cold shutdown (SIGQUIT, a second Ctrl-C) SIGKILLs each running task's pool
process (``celery_native.RunRequest.cancel``), whose guardian ends the rest
of its group, as the group-wide SIGQUIT did before. Not covered: a process
that leaves the group itself (``setsid``, ``setpgid``, a daemon); a cgroup
would hold it, and this platform (Heroku, a plain container) gives a worker no
cgroup of its own.
docs/internals/execution.md, "The body's process tree".
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)

# What the main process sends a pool process on a warm shutdown by SIGTERM: "the
# worker is stopping", counted as the shutdown's SIGTERM, never as a second one.
NOTICE = signal.SIGUSR2

# The guardian: wait for EOF on stdin (the pool process is gone), then SIGKILL the
# group ("$1"). Itself in that group, it goes too.
_GUARDIAN = ('trap "" HUP INT QUIT TERM USR1 USR2 PIPE ALRM; '
             'while read -r _; do :; done; '
             'kill -s KILL -- "-$1"')

_guardian: subprocess.Popen[bytes] | None = None
_pipe: int | None = None  # the write end: open exactly while this pool process lives


def lead_own_group() -> None:
    """In a fresh pool process: lead a new process group and start its guardian.

    Call before the process takes a task. Idempotent per process.
    """
    global _guardian, _pipe
    if _pipe is not None:
        return
    os.setpgid(0, 0)
    read_end, write_end = os.pipe()  # both close-on-exec: no exec'd child inherits them
    try:
        _guardian = subprocess.Popen(
            ["/bin/sh", "-c", _GUARDIAN, "poimen-guardian", str(os.getpgid(0))],
            stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True)  # never the boot's lock socket: liveness is the pool process's
    except OSError:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    _pipe = write_end
    log.debug("pool process %s leads process group %s (guardian %s)", os.getpid(),
              os.getpgid(0), _guardian.pid)


def _forget_guardian_in_child() -> None:
    # A forked child (the body's multiprocessing) must not hold the pipe open: the
    # guardian would wait for it, not for the pool process. It stays in the group.
    global _guardian, _pipe
    if _pipe is not None:
        try:
            os.close(_pipe)
        except OSError:
            pass
    _pipe = None
    _guardian = None


os.register_at_fork(after_in_child=_forget_guardian_in_child)


# -- the main process ----------------------------------------------------------------------------

def pool_groups() -> list[int]:
    """The pool processes of this (main) process that lead a group of their own."""
    from billiard.process import active_children

    leaders = []
    for child in active_children():
        try:
            if child.pid and os.getpgid(child.pid) == child.pid:
                leaders.append(child.pid)
        except OSError:
            continue  # gone meanwhile
    return leaders


def tell_pool(sig: str | None, how: str | None) -> None:
    """In the main process, at ``worker_shutting_down``: pass a warm shutdown on to the pool.

    SIGTERM sends :data:`NOTICE` to each pool process (its SIGTERM grace starts;
    the body's children are not told: Heroku's SIGTERM reaches them itself, and
    the grace's end ends them). SIGINT (a terminal's Ctrl-C) goes to each pool
    process's whole group, as the terminal would have sent it: pool processes
    and guardians ignore it, a body's children get it as before. A cold
    shutdown needs nothing here: Celery cancels each running task through its
    request, which kills the pool process (``celery_native.RunRequest.cancel``)
    and so its group.
    """
    if how != "Warm":
        return
    if sig == "SIGTERM":
        for pid in pool_groups():
            _signal(pid, NOTICE)
    elif sig == "SIGINT":
        for pid in pool_groups():
            _signal(-pid, signal.SIGINT)


def _signal(target: int, signum: int) -> None:
    try:
        os.kill(target, signum)
    except (ProcessLookupError, PermissionError):
        pass
