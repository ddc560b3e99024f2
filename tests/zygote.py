"""``python -m tests.zygote``: start the tests' Celery workers and beats by fork, from a Python
that has already imported Celery, kombu, SQLAlchemy, Flask and psycopg.

A worker's start is mostly importing those libraries: 0.85 s of CPU, of which the child
of a process that imported them pays 0.2-0.3 s. The system lane starts about 250 workers
and beats on two cores, and it is bound by CPU. So :mod:`tests.processes` asks this
server for them (``tests.processes.Zygote``): it forks, and the child runs
``python -m tests.celery_launch ...`` as a fresh interpreter would.

What the child gets, as ``subprocess.Popen`` would give it:

* its own session and process group (``start_new_session``), its working directory,
  the request's environment, stdin on ``/dev/null``, stdout and stderr appended to its
  log, no other file descriptor;
* ``sys.argv`` and ``sys.path[0]`` as ``python -m`` sets them; the server's own modules
  (``tests.*``) forgotten, so the child imports the project from its working directory;
* an interpreter's exit: non-daemon threads joined, ``atexit`` run, streams flushed, the
  status of ``SystemExit`` (or 1 after an uncaught exception, or the signal that killed
  it, reported as ``Popen`` does: ``-N``).

What it cannot get is a fresh import of the preloaded libraries, so nothing that would
make one differ is allowed through:

* the server is started with a request's environment, and records every environment
  variable the libraries read while it imports them (``CELERY_TRACE_APP``,
  ``PSYCOPG_IMPL``, ``KOMBU_LOG_DEBUG`` ...); a request that gives any of those, or any
  ``PYTHON*`` variable, another value is not served here (the client then starts it
  with ``Popen``, or another server for that environment);
* ``prometheus_client``, which picks its multiprocess mode from the environment at import,
  and every project module stay out of the preload (checked at start);
* the server starts no thread (checked), so a fork copies no lock another thread held.

The protocol: one JSON object per line on stdin, one answer per line on stdout.
``{"spawn": {"argv", "env", "cwd", "log"}}`` answers ``{"pid"}``; ``{"poll": pid}``
answers ``{"returncode"}`` (``null`` while it runs; reaped once it ended). The server
exits when its stdin closes (the pytest process ended).
"""

from __future__ import annotations

import json
import os
import sys
import threading

# What every worker and beat imports first. The preload is checked below: a module that
# reads the environment at import is recorded, and a forbidden one refuses the start.
PRELOAD = (
    "celery.bin.worker", "celery.bin.beat", "celery.bin.base", "celery.app.utils",
    "celery.apps.worker", "celery.apps.beat", "celery.app.trace", "celery.beat",
    "celery.worker.consumer", "celery.worker.strategy", "celery.concurrency.prefork",
    "kombu.transport.redis", "redis", "click", "jinja2", "werkzeug", "flask",
    "flask_sqlalchemy", "sqlalchemy.orm", "sqlalchemy.dialects.postgresql.psycopg",
    "psycopg",
)
# Never preloaded: prometheus_client chooses its value class (multiprocess or not) from
# PROMETHEUS_MULTIPROC_DIR when imported; the project's own packages are the code under test.
FORBIDDEN = ("prometheus_client", "app", "workers", "bridge", "poimenconfig", "celeryconfig",
             "lease", "logconfig", "tests")
# The one command served: what tests/processes.py's CELERY_PROGRAM runs.
SERVED_MODULE = "tests.celery_launch"


def preload() -> dict[str, str | None]:
    """Import :data:`PRELOAD`; return every environment variable read meanwhile, with its
    value (``None``: unset). A read of the whole environment is recorded as ``"*"``."""
    read: set[str] = set()
    get, iterate = os._Environ.__getitem__, os._Environ.__iter__

    def recording_get(self, key):
        read.add(key)
        return get(self, key)

    def recording_iter(self):
        read.add("*")
        return iterate(self)

    os._Environ.__getitem__ = recording_get  # type: ignore[method-assign]
    os._Environ.__iter__ = recording_iter  # type: ignore[method-assign]
    try:
        for name in PRELOAD:
            __import__(name)
    finally:
        os._Environ.__getitem__ = get  # type: ignore[method-assign]
        os._Environ.__iter__ = iterate  # type: ignore[method-assign]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN
                    and m not in ("tests", "tests.zygote", "__main__"))
    if loaded:
        raise SystemExit(f"tests.zygote: the preload imported {loaded}")
    if threading.active_count() != 1:
        raise SystemExit(f"tests.zygote: the preload started threads {threading.enumerate()}")
    return {key: (None if key == "*" else os.environ.get(key)) for key in sorted(read)}


def serves(recorded: dict[str, str | None], env: dict[str, str]) -> bool:
    """Whether a child with ``env`` may be forked from a server whose preload ``recorded``
    these variables (its ``PYTHON*`` ones included by the client)."""
    if "*" in recorded:
        return False
    return all(env.get(key) == value for key, value in recorded.items())


def main() -> None:
    recorded = preload()
    recorded.update({k: v for k, v in os.environ.items() if k.startswith("PYTHON")})
    _answer({"ready": True, "recorded": recorded})
    ended: dict[int, int] = {}
    pending = b""
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "spawn" in request:
                argv = request["spawn"]["argv"]
                if argv[1:3] != ["-m", SERVED_MODULE]:
                    _answer({"error": f"tests.zygote serves {SERVED_MODULE} only, not {argv}"})
                else:
                    _answer({"pid": _spawn(request["spawn"])})
            else:
                _answer({"returncode": _poll(int(request["poll"]), ended)})


def _answer(message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _poll(pid: int, ended: dict[int, int]) -> int | None:
    if pid not in ended:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if not done:
            return None
        ended[pid] = os.waitstatus_to_exitcode(status)
    return ended[pid]


def _spawn(request: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    # The answer waits until the child leads its own session, as Popen returns only once
    # its child has (start_new_session): a killpg right after the start reaches it.
    started, leading = os.pipe()
    pid = os.fork()
    if pid:
        os.close(leading)
        os.read(started, 1)  # a byte once it leads, or the end if it died before
        os.close(started)
        return pid
    code = 1
    try:
        os.close(started)
        os.setsid()
        os.write(leading, b"s")
        os.close(leading)
        code = _child(request["argv"], request["env"], request["cwd"], request["log"])
    except BaseException:  # noqa: BLE001 - the child's own set-up failed: say why, exit 1
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _child(argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
    os.chdir(cwd)
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already
    os.environ.clear()
    os.environ.update(env)
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]
    sys.path[0] = cwd
    sys.argv = [argv[0], *argv[3:]]
    return _run_as_main(SERVED_MODULE)


def _run_as_main(module: str) -> int:
    """Run ``module`` as ``python -m`` does, then end as the interpreter would."""
    import atexit
    import runpy
    import signal
    import traceback

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        _shutdown(atexit)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001 - an uncaught exception, printed as Python does
        traceback.print_exc()
        code = 1
    _shutdown(atexit)
    return code & 0xFF


def _shutdown(atexit) -> None:
    threading._shutdown()  # type: ignore[attr-defined] - what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    main()
