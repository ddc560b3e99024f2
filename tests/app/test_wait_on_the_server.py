"""``GET /v1/runs/<id>?wait=N``: an answer as soon as the run ends, holding no connection.

In-process (Flask's test client, threads) against real Postgres: a run is ended by a
second session while a request waits; the per-process waiter (``app/waiter.py``) reads
every waited run with one statement per interval. The processes test with gunicorn and
100 waiting requests is ``test_wait_on_the_server_processes.py``.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.processes import wait_until


def end(pg, run_id, status: str = "succeeded", result: str = '{"ok": true}') -> None:
    pg.execute("UPDATE runs SET status = %s, result = %s::jsonb, finished_at = now() "
               "WHERE id = %s", [status, result, run_id])


def get(app, tenant, run_id, query: str = ""):
    return app.test_client().get(f"/v1/runs/{run_id}{query}", headers=tenant.headers)


def test_a_wait_answers_as_soon_as_the_run_ends(app, tenant, admit, pg):
    run_id = admit("effect", {})
    answers: dict = {}

    def waiting():
        started = time.monotonic()
        answers["run"] = get(app, tenant, run_id, "?wait=20")
        answers["took"] = time.monotonic() - started

    thread = threading.Thread(target=waiting)
    thread.start()
    time.sleep(1.0)
    assert "run" not in answers  # still waiting: the run has not ended
    ended_at = time.monotonic()
    end(pg, run_id)
    thread.join(20)
    answer = answers["run"]
    assert answer.status_code == 200 and answer.json["status"] == "succeeded"
    assert answer.json["result"] == {"ok": True}
    assert time.monotonic() - ended_at < 2.0  # woken by the end, far before 20 s


def test_a_wait_answers_within_100_ms_of_the_end(app, tenant, admit, pg):
    """The lag from the end's commit to the answer: the poll interval (50 ms) plus a read."""
    lags = []
    for _ in range(5):
        run_id = admit("effect", {})
        done: dict = {}
        thread = threading.Thread(target=lambda r=run_id, d=done: d.update(
            answer=get(app, tenant, r, "?wait=10"), at=time.monotonic()))
        thread.start()
        time.sleep(0.3)
        ended_at = time.monotonic()
        end(pg, run_id)
        thread.join(10)
        assert done["answer"].json["status"] == "succeeded"
        lags.append(done["at"] - ended_at)
    assert sorted(lags)[2] <= 0.1, lags  # the median; a loaded machine may stretch one


def test_a_wait_times_out_with_the_run_as_it_is(app, tenant, admit):
    run_id = admit("effect", {})
    started = time.monotonic()
    answer = get(app, tenant, run_id, "?wait=0.5")
    assert answer.status_code == 200 and answer.json["status"] == "queued"
    assert 0.5 <= time.monotonic() - started < 5
    assert "Poimen-Wait" not in answer.headers


def test_an_ended_run_answers_at_once(app, tenant, admit, pg):
    run_id = admit("effect", {})
    end(pg, run_id, "failed", '{"x": 1}')
    started = time.monotonic()
    assert get(app, tenant, run_id, "?wait=30").json["status"] == "failed"
    assert time.monotonic() - started < 1


def test_a_waiting_request_holds_no_database_connection(app, tenant, admit, pg):
    from app.extensions import db

    run_id = admit("effect", {})
    with app.app_context():
        pool = db.engine.pool
    threads = [threading.Thread(target=get, args=(app, tenant, run_id, "?wait=5"))
               for _ in range(5)]
    for thread in threads:
        thread.start()
    from app.waiter import waiting

    wait_until(lambda: waiting() == 5, timeout=10,
               what="five requests waiting")
    # Five waiters, no connection among them: at most the poller's own, for its one read
    # every 50 ms (on a loaded machine a sample may catch it in the middle of one).
    samples = []
    for _ in range(50):
        samples.append(pool.checkedout())
        time.sleep(0.01)
    assert max(samples) <= 1, samples
    end(pg, run_id)
    for thread in threads:
        thread.join(10)


def test_waiters_beyond_the_bound_answer_at_once_marked_full(app, tenant, admit, pg):
    from app.waiter import waiting

    run_id = admit("effect", {})
    with app.app_context():
        bound = app.config["POIMEN_WAIT_MAX"]
    threads = [threading.Thread(target=get, args=(app, tenant, run_id, "?wait=10"))
               for _ in range(bound)]
    for thread in threads:
        thread.start()
    wait_until(lambda: waiting() == bound, timeout=10, what="the bound reached")
    started = time.monotonic()
    answer = get(app, tenant, run_id, "?wait=10")
    assert time.monotonic() - started < 2
    assert answer.json["status"] == "queued" and answer.headers["Poimen-Wait"] == "full"
    end(pg, run_id)
    for thread in threads:
        thread.join(10)


@pytest.mark.parametrize("query", ["?wait=-1", "?wait=61", "?wait=soon", "?wait=nan",
                                   "?other=1"])
def test_a_bad_wait_is_a_400(app, tenant, admit, query):
    answer = get(app, tenant, admit("effect", {}), query)
    assert answer.status_code == 400
    assert answer.json["error"]["code"] == "invalid_parameter"


def test_the_clients_wait_and_result_wait_on_the_server(live_api, tenant, admit, pg):
    from poimen_client import RunFailed, Runs, WaitTimeout

    runs = Runs(live_api, tenant.token, retry_for=5)
    ok, bad = admit("effect", {}), admit("effect", {})
    threading.Timer(0.5, end, args=(pg, ok)).start()
    started = time.monotonic()
    assert runs.result(str(ok), timeout=20) == {"ok": True}
    assert time.monotonic() - started < 5
    end(pg, bad, "failed")
    pg.execute("""UPDATE runs SET error = '{"code": "boom", "type": "ValueError"}' """
               "WHERE id = %s", [bad])
    with pytest.raises(RunFailed) as failed:
        runs.result(str(bad), timeout=5)
    assert failed.value.status == "failed" and failed.value.error["code"] == "boom"
    with pytest.raises(WaitTimeout):
        runs.wait(str(admit("effect", {})), timeout=0.5)
