"""The broker is off the request path: a dead or black-holed Redis does not slow admission.

gunicorn talks to Redis through a TCP proxy this test controls: in *black-hole*
mode it accepts connections and never answers (the worst kind of broker
outage: no error, just silence); in *forward* mode it relays to the real
Redis. Admission must answer at once either way; the run reaches the queue,
and is executed, once the broker answers again.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from urllib.parse import urlparse

import pytest
import requests

from tests.processes import start_web, start_worker, wait_until


class SwitchableProxy:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.forwarding = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.forwarding:
                self.held.append(client)  # accepted, never answered
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def forward(self) -> None:
        self.forwarding = True
        for held in self.held:  # the silent connections go away as in a real recovery
            held.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def proxy(base_env):
    redis_url = urlparse(base_env["REDIS_URL"])
    proxy = SwitchableProxy((redis_url.hostname, redis_url.port))
    yield proxy
    proxy.close()


@pytest.mark.processes
def test_a_black_holed_broker_does_not_slow_admission_and_the_run_runs_after(
        proxy, test_env, tenant, tmp_path, pg, redis_client, queue_name):
    real = urlparse(test_env["REDIS_URL"])
    env = {**test_env, "REDIS_URL": f"redis://127.0.0.1:{proxy.port}{real.path}",
           "POIMEN_BROKER_SOCKET_TIMEOUT": "2"}
    web, url = start_web(env, tmp_path)
    queued_before = redis_client.llen(queue_name)  # earlier tests' runs no worker took
    try:
        took = []
        run_ids = []
        for n in range(5):
            started = time.monotonic()
            answer = requests.post(f"{url}/v1/runs", headers=tenant.headers, timeout=10,
                                   json={"workflow_ref": "echo", "input": {"n": n}})
            took.append(time.monotonic() - started)
            assert answer.status_code == 201, answer.text
            run_ids.append(answer.json()["id"])
        assert max(took) < 1.0, took
        assert redis_client.llen(queue_name) == queued_before  # nothing reached the broker

        proxy.forward()  # the broker answers again
        worker = start_worker(test_env, tmp_path)  # on the real Redis
        try:
            wait_until(lambda: pg.execute(
                "SELECT count(*) FROM runs WHERE id = ANY(%s) AND status = 'succeeded'",
                [run_ids]).fetchone()[0] == len(run_ids), timeout=60,
                what="every run to be sent and executed once the broker is back")
        finally:
            worker.teardown()  # SIGKILL: what this test is about happened before
    finally:
        web.teardown()


def test_a_committed_run_reaches_the_queue_within_50_ms(live_api, tenant, redis_client,
                                                        queue_name):
    delays = []
    for n in range(10):
        redis_client.delete(queue_name)
        answer = requests.post(f"{live_api}/v1/runs", headers=tenant.headers, timeout=10,
                               json={"workflow_ref": "echo", "input": {"n": n}})
        assert answer.status_code == 201
        committed = time.monotonic()  # the answer is sent after the commit
        run_id = answer.json()["id"]
        deadline = committed + 5
        while time.monotonic() < deadline:
            raw = redis_client.lrange(queue_name, 0, -1)
            if any(json.loads(m)["headers"]["id"] == run_id for m in raw):
                break
            time.sleep(0.001)
        else:
            pytest.fail(f"run {run_id} never reached the queue")
        delays.append(time.monotonic() - committed)
    assert statistics.median(delays) < 0.05, delays
