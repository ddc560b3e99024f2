"""The Python client (``bridge/client.py``) against the real API: real gunicorn, real
admission, real Postgres, a real Celery worker for ``wait``.

The network faults come from ``FaultyProxy``, a small TCP proxy in this file in front of
the real gunicorn. We cannot make a real network drop a connection on cue, and the rule
under test is what the client does when one is dropped, so the proxy plays the network:
it reads each HTTP request whole and, by turn, passes it through, resets the connection
before the API sees it, lets the API admit it and resets the connection before the
answer gets back (the case only a same-key retry survives), or answers 503/429 itself
as an overloaded load balancer would. Everything behind it is the real thing.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from bridge.client import (
    ApiError,
    AuthError,
    DispatchKeyConflict,
    InvalidRequest,
    RunNotFound,
    Runs,
    TransportError,
    TransportTimeout,
    Unavailable,
    WaitTimeout,
)
from tests.processes import start_worker

# -- the proxy -------------------------------------------------------------------------------


def _read_http(sock: socket.socket, buffer: bytearray) -> bytes | None:
    """Read one HTTP/1.1 message (headers and a Content-Length body) from ``sock``."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    head_end = buffer.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buffer[:head_end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(buffer) < head_end + length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    message = bytes(buffer[:head_end + length])
    del buffer[:head_end + length]
    return message


def _reset(sock: socket.socket) -> None:
    """Close with an RST: the peer sees a connection reset, not a clean end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _answer(status: int, reason: str, extra: str = "") -> bytes:
    body = (b'{"error": {"code": "proxy", "message": "from the proxy", "details": {}}}'
            if status == 429 else b"<html>service unavailable</html>")
    ctype = "application/json" if status == 429 else "text/html"
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class FaultyProxy:
    """A TCP proxy that treats each request by the next mode of ``plan`` (cycled).

    Modes: ``pass``; ``drop_before`` (reset, the API never sees it); ``drop_after`` (the
    API answers, the client gets a reset instead); ``503``; ``429:<seconds>``.
    """

    def __init__(self, upstream: str, plan: list[str]):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self._plan = itertools.cycle(plan)
        self._lock = threading.Lock()
        self.seen: Counter[str] = Counter()   # mode -> requests treated so
        self.requests: list[str] = []          # "METHOD /path" in arrival order
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = bytearray()
        try:
            while True:
                request = _read_http(conn, buffer)
                if request is None:
                    conn.close()
                    return
                with self._lock:
                    mode = next(self._plan)
                    self.seen[mode] += 1
                    self.requests.append(b" ".join(request.split(b" ", 2)[:2]).decode())
                if mode == "drop_before":
                    _reset(conn)
                    return
                if mode == "503":
                    conn.sendall(_answer(503, "Service Unavailable"))
                    continue
                if mode.startswith("429:"):
                    conn.sendall(_answer(429, "Too Many Requests",
                                         f"Retry-After: {mode.split(':')[1]}\r\n"))
                    continue
                with socket.create_connection(self.upstream, timeout=30) as upstream:
                    upstream.sendall(request)
                    response = _read_http(upstream, bytearray())
                if mode == "drop_after" or response is None:
                    _reset(conn)
                    return
                conn.sendall(response)
        except Exception:  # noqa: BLE001 - a proxy bug must look like a failure, not a hang
            _reset(conn)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


@pytest.fixture
def proxies(live_api):
    made: list[FaultyProxy] = []

    def make(*plan: str) -> FaultyProxy:
        made.append(FaultyProxy(live_api, list(plan)))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


def fast(url: str, token: str, **kwargs) -> Runs:
    """A client with short backoffs (the machine is shared; the rules are the same)."""
    return Runs(url, token, **{"backoff_initial": 0.02, "backoff_max": 0.3,
                               "retry_for": 120.0, **kwargs})


def rows(pg, tenant_id: int) -> list[tuple]:
    return pg.execute("SELECT id::text, dispatch_key, input FROM runs WHERE tenant_id = %s",
                      [tenant_id]).fetchall()


# -- one run per logical call under a failing network ------------------------------------------


def test_twenty_threads_through_a_dropping_proxy_admit_exactly_one_run_per_call(
        proxies, tenant, pg, caplog):
    """Every other request fails (reset before the API, reset after it admitted, a 503):
    100 logical calls from 20 threads, half with the caller's key and half without,
    leave exactly 100 runs, each the call's own."""
    proxy = proxies("pass", "drop_before", "pass", "drop_after", "pass", "503")
    calls = [(t, i) for t in range(20) for i in range(5)]
    caplog.set_level(logging.WARNING, logger="poimen.client")

    with fast(proxy.url, tenant.token) as runs:
        def call(t: int, i: int):
            key = f"caller-{t}-{i}" if i % 2 == 0 else None
            return (t, i, key, runs.admit("echo", {"thread": t, "call": i, "secret": "s3cr3t"},
                                          dispatch_key=key))

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(lambda c: call(*c), calls))

    stored = {run_id: (key, inp) for run_id, key, inp in rows(pg, tenant.id)}
    assert len(stored) == len(calls)                      # exactly one run per logical call
    assert {run.id for *_, run in results} == set(stored)  # and each call got its own
    for t, i, key, run in results:
        assert stored[run.id][1] == {"thread": t, "call": i, "secret": "s3cr3t"}
        if key is not None:
            assert run.dispatch_key == key
        else:
            assert run.dispatch_key.startswith("client-")  # generated once, kept on retries
    # The faults really happened, and some admitted runs only survived through a replay.
    assert proxy.seen["drop_before"] >= 15 and proxy.seen["drop_after"] >= 15
    assert proxy.seen["503"] >= 15
    assert any(run.replayed for *_, run in results)
    # Quiet logs: the retries are logged, never the token or a run's input.
    assert "retrying POST /v1/runs" in caplog.text
    assert tenant.token not in caplog.text and "s3cr3t" not in caplog.text


def test_wait_returns_the_run_a_real_worker_finished(proxies, tenant, test_env, tmp_path):
    """``wait`` polls through the same failing network until the worker finishes the run."""
    proxy = proxies("pass", "drop_before", "pass", "503")
    worker = start_worker(test_env, tmp_path, "client-worker")
    try:
        with fast(proxy.url, tenant.token) as runs:
            run = runs.admit("echo", {"hello": "client"})
            done = runs.wait(run.id, timeout=90)
    finally:
        worker.teardown()  # SIGKILL: the worker's shutdown is not what this tests
    assert done.id == run.id
    assert done.status == "succeeded" and done.finished
    assert done.result == {"hello": "client"}
    assert proxy.seen["drop_before"] >= 1


def test_wait_times_out_with_the_run_as_last_seen(live_api, tenant):
    with fast(live_api, tenant.token) as runs:
        run = runs.admit("echo", {})  # no worker in this test: it stays queued
        started = time.monotonic()
        with pytest.raises(WaitTimeout) as err:
            runs.wait(run.id, timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 15
    assert err.value.run.id == run.id and err.value.run.status == "queued"


# -- batches -----------------------------------------------------------------------------------


def test_admit_takes_every_admission_field(live_api, tenant, pg):
    """``admit`` sends a ``concurrency_key`` and a ``goal_id``: the run holds them, and
    its replay is the same run."""
    with fast(live_api, tenant.token) as runs:
        run = runs.admit("pair", {"v": 1}, dispatch_key="fields-1", goal_id="goal-1",
                         concurrency_key="customer-7")
        again = runs.admit("pair", {"v": 1}, dispatch_key="fields-1", goal_id="goal-1",
                           concurrency_key="customer-7")
    assert run.goal_id == "goal-1" and run.raw["concurrency_key"] == "customer-7"
    assert again.replayed and again.id == run.id
    assert pg.execute("SELECT concurrency_key, goal_id FROM runs WHERE id = %s",
                      [run.id]).fetchone() == ("customer-7", "goal-1")


def test_admit_many_answers_each_item_in_order_with_runs_or_errors(live_api, tenant, pg):
    with fast(live_api, tenant.token) as runs:
        first = runs.admit("echo", {"v": 1}, dispatch_key="batch-1")
        results = runs.admit_many([
            {"workflow_ref": "echo", "input": {"v": 2}},                          # created
            {"workflow_ref": "echo", "input": {"v": 1}, "dispatch_key": "batch-1"},  # replay
            {"workflow_ref": "echo", "input": {"v": 9}, "dispatch_key": "batch-1"},  # conflict
            {"workflow_ref": "no-such-flow"},                                      # 422
        ])
        assert runs.admit_many([]) == []
    created, replay, conflict, unknown = results
    assert not created.replayed and created.dispatch_key.startswith("client-")
    assert replay.replayed and replay.id == first.id
    assert isinstance(conflict, DispatchKeyConflict) and conflict.run_id == first.id
    assert isinstance(unknown, InvalidRequest) and unknown.code == "unknown_workflow"
    assert len(rows(pg, tenant.id)) == 2


def test_every_run_of_a_batch_executes(live_api, tenant, test_env, tmp_path):
    """Real processes (gunicorn and a worker): each run a batch admitted is sent after its
    commit and reaches succeeded."""
    worker = start_worker(test_env, tmp_path, "batch-worker")
    try:
        with fast(live_api, tenant.token) as runs:
            admitted = runs.admit_many([{"workflow_ref": "echo", "input": {"n": n}}
                                        for n in range(12)])
            done = [runs.wait(run.id, timeout=120) for run in admitted]
    finally:
        worker.teardown()  # SIGKILL: the worker's shutdown is not what this tests
    assert [run.status for run in done] == ["succeeded"] * 12
    assert [run.result for run in done] == [{"n": n} for n in range(12)]


# -- what is retried, and what is not ----------------------------------------------------------


def test_429_is_retried_after_its_retry_after_with_the_same_key(proxies, tenant, pg):
    proxy = proxies("429:2", "pass")
    started = time.monotonic()
    with fast(proxy.url, tenant.token) as runs:
        run = runs.admit("echo", {"n": 1})
    assert time.monotonic() - started >= 2.0  # the header, not the 20 ms backoff
    assert proxy.requests == ["POST /v1/runs", "POST /v1/runs"]
    assert [r[0] for r in rows(pg, tenant.id)] == [run.id]
    assert not run.replayed  # the 429 never reached the API: the second try created it


def test_retries_are_bounded_and_end_in_the_last_error(proxies, tenant, pg):
    proxy = proxies("503")
    started = time.monotonic()
    with fast(proxy.url, tenant.token, retry_for=1.5) as runs, pytest.raises(Unavailable) as err:
        runs.admit("echo", {})
    assert time.monotonic() - started < 10
    assert err.value.status == 503 and err.value.code == "http_503" and err.value.body is None
    assert proxy.seen["503"] >= 2
    assert rows(pg, tenant.id) == []


def test_a_dead_api_is_a_transport_error_after_the_retries(tenant):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with fast(f"http://127.0.0.1:{port}", tenant.token, retry_for=0.5) as runs:
        with pytest.raises(TransportError):
            runs.get(str(uuid.uuid4()))


def test_a_refused_connection_is_a_connection_error_not_a_timeout(tenant):
    """urllib3 2 makes a refused connection a subclass of its timeout error: the reason
    the inbox counts and logs must still say `connection` (docs/operations/inbox.md)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with fast(f"http://127.0.0.1:{port}", tenant.token, retry_for=0.1) as runs:
        with pytest.raises(TransportError) as err:
            runs.get(str(uuid.uuid4()))
    assert not isinstance(err.value, TransportTimeout)
    assert err.value.reason == "connection"


@pytest.mark.parametrize("bad", ["unknown_workflow", "bad_token"])
def test_the_callers_own_errors_are_raised_at_once_with_the_apis_body(proxies, tenant, bad):
    proxy = proxies("pass")
    token = tenant.token if bad == "unknown_workflow" else "pmn_not_a_token"
    with fast(proxy.url, token) as runs, pytest.raises(ApiError) as err:
        runs.admit("no-such-workflow" if bad == "unknown_workflow" else "echo", {})
    assert proxy.requests == ["POST /v1/runs"]  # never retried
    if bad == "unknown_workflow":
        assert isinstance(err.value, InvalidRequest) and err.value.status == 422
        assert err.value.code == "unknown_workflow"
        assert err.value.details == {"workflow_ref": "no-such-workflow"}
    else:
        assert isinstance(err.value, AuthError) and err.value.status == 401
    assert set(err.value.body["error"]) == {"code", "message", "details"}


def test_a_key_reused_for_another_request_is_a_conflict_naming_the_run(live_api, tenant):
    with fast(live_api, tenant.token) as runs:
        first = runs.admit("echo", {"v": 1}, dispatch_key="order-7", goal_id="g-1")
        again = runs.admit("echo", {"v": 1}, dispatch_key="order-7", goal_id="g-1")
        with pytest.raises(DispatchKeyConflict) as err:
            runs.admit("echo", {"v": 2}, dispatch_key="order-7", goal_id="g-1")
    assert not first.replayed and again.replayed and again.id == first.id
    assert first.goal_id == "g-1"
    assert err.value.status == 409 and err.value.run_id == first.id


# -- get, list, cancel -------------------------------------------------------------------------


def test_list_follows_cursors_and_get_and_cancel_answer_runs(proxies, tenant, make_tenant):
    proxy = proxies("pass")
    with fast(proxy.url, tenant.token) as runs:
        made = [runs.admit("echo", {"i": i}, goal_id="batch") for i in range(5)]
        runs.admit("echo", {"i": 99}, goal_id="other")
        listed = list(runs.list(goal_id="batch", page_size=2))
        assert [r.id for r in listed] == [r.id for r in reversed(made)]  # newest first
        assert sum(1 for r in proxy.requests if r.startswith("GET /v1/runs?")) == 3
        assert runs.get(made[0].id).input == {"i": 0}
        cancelled = runs.cancel(made[1].id)
        assert cancelled.status == "cancelled"
        assert [r.id for r in runs.list(status=["cancelled"])] == [made[1].id]
    with fast(proxy.url, make_tenant().token) as stranger, pytest.raises(RunNotFound):
        stranger.get(made[0].id)  # another tenant's run is a 404
