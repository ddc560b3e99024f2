"""The API through a Postgres restart.

gunicorn, started as the Procfile's ``web``, serves the private Postgres of
``tests/chaos/conftest.py``. While clients keep calling every endpoint, the
database is stopped, probed, started again, and restarted under load:

* no answer is ever a 500 (nor anything outside the API's own statuses);
* while the database is down every endpoint that needs it, ``/readyz``
  included, answers 503 (``/metrics`` does not need it and answers 200) with ``{"error": {"code", "message", "details"}}``
  and ``code == "database_unavailable"``;
* within 5 s of the database accepting connections again, ``POST /v1/runs``
  answers 201 (and stale pooled connections do not cost a failed request).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest
import requests

from tests.processes import start_web, wait_until

pytestmark = pytest.mark.slow

BACK_WITHIN = 5.0  # seconds from the database accepting connections to a 201
METRICS_TOKEN = "chaos-metrics-token"


@pytest.fixture
def web(chaos_env, tmp_path):
    # /metrics needs its token (from the environment, not the database).
    proc, url = start_web({**chaos_env, "POIMEN_METRICS_TOKEN": METRICS_TOKEN,
                           "POIMEN_METRICS_CACHE_SECONDS": "0"}, tmp_path)
    yield url, proc
    proc.stop()


def _post_run(url, tenant, **kwargs):
    return requests.post(f"{url}/v1/runs", headers=tenant.headers, timeout=10,
                         json={"workflow_ref": "echo", "input": {"n": 1}, **kwargs})


def _calls(url, tenant, run_id):
    """Every endpoint of the API that reads or writes the database, as (name, thunk)."""
    h = tenant.headers
    return [
        ("POST /v1/runs", lambda: _post_run(url, tenant)),
        ("POST /v1/runs (keyed)",
         lambda: _post_run(url, tenant, dispatch_key=f"k-{uuid.uuid4().hex}")),
        ("GET /v1/runs/<id>", lambda: requests.get(f"{url}/v1/runs/{run_id}", headers=h,
                                                   timeout=10)),
        ("GET /v1/runs", lambda: requests.get(f"{url}/v1/runs?status=queued", headers=h,
                                              timeout=10)),
        ("POST /v1/runs/<id>/cancel",
         lambda: requests.post(f"{url}/v1/runs/{uuid.uuid4()}/cancel", headers=h, timeout=10)),
        ("GET /readyz", lambda: requests.get(f"{url}/readyz", timeout=10)),
        ("GET /metrics", lambda: requests.get(
            f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10)),
        ("unknown token", lambda: requests.get(
            f"{url}/v1/runs", headers={"Authorization": "Bearer pmn_nope"}, timeout=10)),
    ]


# What each endpoint may answer when the database is up (the cancel targets a
# run that does not exist; the unknown token is refused).
UP_STATUSES = {200, 201, 404, 401}


def _error_shape(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    return body["error"]


class Traffic:
    """Client threads calling every endpoint in a loop, recording every answer."""

    def __init__(self, calls, threads: int = 4):
        self.calls = calls
        self.stop_event = threading.Event()
        # (sent at, call, status, error code): "at" is when the request was sent, so a
        # request sent while the database was down never counts as "after".
        self.answers: list[tuple[float, str, int, str]] = []
        self.failures: list[str] = []
        self.created: list[str] = []  # ids of the runs answered 201
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True)
                        for i in range(threads)]

    def _loop(self, offset: int) -> None:
        i = offset
        while not self.stop_event.is_set():
            name, call = self.calls[i % len(self.calls)]
            i += 1
            sent = time.monotonic()
            try:
                r = call()
            except requests.RequestException as err:  # the server itself must stay up
                with self.lock:
                    self.failures.append(f"{name}: {err!r}")
                continue
            code = ""
            if r.status_code >= 400:
                try:
                    code = _error_shape(r)["code"]
                except (AssertionError, ValueError):
                    with self.lock:
                        self.failures.append(f"{name}: {r.status_code} not the error shape: "
                                             f"{r.text[:200]}")
            with self.lock:
                self.answers.append((sent, name, r.status_code, code))
                if r.status_code == 201:
                    self.created.append(r.json()["id"])

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        for t in self.threads:
            t.join(30)

    def statuses(self) -> Counter:
        with self.lock:
            return Counter(status for _, _, status, _ in self.answers)


def _assert_all_answers_allowed(traffic: Traffic, web_proc, private_postgres):
    statuses = traffic.statuses()
    print(f"\nanswers: {dict(sorted(statuses.items()))}")
    # Every 201 is a run in the database (none lost in a restart), once.
    with private_postgres.connect() as conn:
        found = conn.execute("SELECT count(*) FROM runs WHERE id = ANY(%s::uuid[])",
                             [traffic.created]).fetchone()[0]
    assert found == len(set(traffic.created)) == len(traffic.created) > 0
    assert not traffic.failures, traffic.failures[:5]
    assert 500 not in statuses, web_proc.log()[-4000:]
    assert set(statuses) <= UP_STATUSES | {503}, statuses
    assert all(code == "database_unavailable"
               for _, _, status, code in traffic.answers if status == 503)


def test_every_endpoint_answers_503_while_down_and_201_soon_after(
        web, chaos_tenant, private_postgres):
    url, web_proc = web
    first = _post_run(url, chaos_tenant)
    assert first.status_code == 201, first.text
    calls = _calls(url, chaos_tenant, first.json()["id"])
    # Warm every pooled connection in both gunicorn workers, so they are all stale later.
    for _ in range(20):
        for _, call in calls:
            assert call().status_code in UP_STATUSES

    with Traffic(calls) as traffic:
        wait_until(lambda: len(traffic.answers) > 50, timeout=60, what="traffic before")
        private_postgres.stop()
        try:
            # Down: every endpoint that needs the database, probed once more by hand, is a
            # JSON 503. /metrics does not: web exports only its own process metrics (the
            # global gauges are beat's, docs/operations/metrics.md), so the scrape survives the outage.
            for name, call in calls:
                r = call()
                if name == "GET /metrics":
                    assert r.status_code == 200, (name, r.status_code, r.text[:300])
                    assert "poimen_admission_seconds" in r.text
                    continue
                assert r.status_code == 503, (name, r.status_code, r.text[:300])
                error = _error_shape(r)
                assert error["code"] == "database_unavailable", (name, error)
                assert r.headers.get("Retry-After"), name
            # /healthz is liveness, not readiness: the process is fine.
            assert requests.get(f"{url}/healthz", timeout=10).status_code == 200
            down_since = time.monotonic()
            wait_until(lambda: sum(1 for at, *_ in traffic.answers if at > down_since) > 50,
                       timeout=60, what="traffic while down")
        finally:
            private_postgres.start()
        back_at = time.monotonic()
        created = wait_until(lambda: _post_run(url, chaos_tenant).status_code == 201
                             and time.monotonic(), timeout=60, interval=0.05,
                             what="a 201 after the database came back")
        wait_until(lambda: sum(1 for at, *_ in traffic.answers if at > created) > 50,
                   timeout=60, what="traffic after")
    back_after = created - back_at
    print(f"first 201 {back_after:.2f}s after the database accepted connections")
    _assert_all_answers_allowed(traffic, web_proc, private_postgres)
    assert back_after <= BACK_WITHIN
    # After the first 201 every answer is an up-answer again (no stale connection failed).
    late = Counter(status for at, _, status, _ in traffic.answers if at > created + 0.5)
    assert set(late) <= UP_STATUSES, late


def test_restart_under_load_has_no_500(web, chaos_tenant, private_postgres):
    url, web_proc = web
    first = _post_run(url, chaos_tenant)
    assert first.status_code == 201, first.text
    calls = _calls(url, chaos_tenant, first.json()["id"])
    restarts = 3
    with Traffic(calls) as traffic:
        for _ in range(restarts):
            wait_until(lambda: len(traffic.answers) > 50, timeout=60, what="traffic")
            private_postgres.restart()
            back_at = time.monotonic()
            created = wait_until(lambda: _post_run(url, chaos_tenant).status_code == 201
                                 and time.monotonic(), timeout=60, interval=0.05,
                                 what="a 201 after the restart")
            print(f"\nfirst 201 {created - back_at:.2f}s after the restart")
            assert created - back_at <= BACK_WITHIN
            wait_until(lambda since=back_at: sum(1 for a in traffic.answers if a[0] > since)
                       > 100, timeout=60, what="traffic after the restart")
            # A request sent once the server accepts connections again must not
            # fail on a pooled connection the restart cut.
            stale = [a for a in traffic.answers if a[0] > back_at and a[2] == 503]
            assert not stale, stale[:5]
    _assert_all_answers_allowed(traffic, web_proc, private_postgres)
    print(f"answers: {len(traffic.answers)} over {restarts} restarts, "
          f"503s: {traffic.statuses()[503]}")


def test_idle_pooled_connections_cut_by_a_restart_fail_no_request(web, chaos_tenant,
                                                                   private_postgres):
    """Pools full of connections the restart cut, and no traffic to notice: the next
    requests must all succeed (pre-ping replaces each dead connection at checkout)."""
    url, web_proc = web
    first = _post_run(url, chaos_tenant)
    calls = _calls(url, chaos_tenant, first.json()["id"])
    # Fill both gunicorn workers' pools with several connections each.
    with Traffic(calls, threads=8) as traffic:
        wait_until(lambda: len(traffic.answers) > 200, timeout=60, what="warm-up traffic")
    assert len(private_postgres.backends()) >= 4
    private_postgres.restart()
    answers = Counter()
    for _ in range(10):
        for name, call in calls:
            answers[(name, call().status_code)] += 1
    print(f"\nafter an idle restart: {dict(answers)}")
    failed = {key: n for key, n in answers.items() if key[1] not in UP_STATUSES}
    assert not failed, failed
