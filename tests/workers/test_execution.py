"""Execution with real worker processes: races, crashes, redelivery, cancellation."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os

import pytest
import requests

from tests.processes import start_beat, start_worker, wait_until


def run_row(pg, run_id):
    return pg.execute(
        "SELECT status, attempt, claimed_by, result, error, failures FROM runs WHERE id = %s",
        [run_id],
    ).fetchone()


FINAL = {"succeeded", "failed", "cancelled"}


def wait_status(pg, run_id, statuses, timeout=60):
    """Wait for ``run_id`` to reach one of ``statuses``; a different final status fails at once."""
    def reached():
        row = run_row(pg, run_id)
        if row[0] in FINAL and row[0] not in statuses:
            raise AssertionError(f"run {run_id} ended {row[0]}, not {statuses}: {row}")
        return row[0] in statuses and row

    return wait_until(reached, timeout=timeout, what=f"run {run_id} to reach {statuses}")


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path


RACE_ROUNDS = 30


@pytest.mark.processes
def test_racing_deliveries_execute_each_run_once(admit, side_effects, test_env, pg):
    """6: two processes deliver the same run at the same instant, 30 times."""
    run_ids = [str(admit("effect", {"seconds": 0.05})) for _ in range(RACE_ROUNDS)]
    ctx = multiprocessing.get_context("spawn")
    barrier, outcomes = ctx.Barrier(2), ctx.Queue()
    saved = dict(os.environ)
    os.environ.update(test_env)
    try:
        racers = [ctx.Process(target=_race_entry, args=(barrier, run_ids, outcomes))
                  for _ in range(2)]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(180)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert [r.exitcode for r in racers] == [0, 0]
    results = [outcomes.get(timeout=5) for _ in range(2 * RACE_ROUNDS)]

    executions = sum(1 for _, outcome in results if outcome == "claimed")
    print(f"\n{RACE_ROUNDS} races: {executions} executions, "
          f"{sum(1 for _, o in results if o != 'claimed')} deliveries absorbed")
    assert executions == RACE_ROUNDS
    for run_id in run_ids:
        assert side_effects(run_id, "start") == 1
        assert side_effects(run_id, "finish") == 1
        assert run_row(pg, run_id)[:2] == ("succeeded", 1)


def _race_entry(barrier, run_ids, outcomes):
    from tests.workers.racer import race

    race(barrier, run_ids, outcomes)


def test_duplicate_messages_to_real_workers_execute_once(admit, side_effects, fast_env, pg,
                                                          log_dir, processes, app,
                                                          redis_client, queue_name):
    """Every run sent 4 times to two real Celery workers runs exactly once."""
    from app.enqueue import send_run

    run_ids = [admit("effect", {"seconds": 0.2}) for _ in range(10)]
    with app.app_context():
        celery_app = app.extensions["celery"]
        for _ in range(3):  # admission already sent each once
            for run_id in run_ids:
                send_run(celery_app, run_id, "effect@1")
    processes.append(start_worker(fast_env, log_dir, "w1", concurrency=2))
    processes.append(start_worker(fast_env, log_dir, "w2", concurrency=2))
    for run_id in run_ids:
        wait_status(pg, run_id, {"succeeded"})
    # Every copy has left the queue (handed to a worker): a deterministic point. Their
    # acknowledgements (kombu's Redis "unacked" hash, this queue's entries) are waited
    # for too, but only for a bounded time: on a loaded machine an entry can outlive
    # 60 s (under load from other test sessions, never alone), and the side-effect counts
    # below, not the drain, are the witness.
    def unacked_here() -> int:
        return sum(1 for raw in redis_client.hvals("unacked")
                   if json.loads(raw)[2] == queue_name)

    wait_until(lambda: redis_client.llen(queue_name) == 0, timeout=60,
               what="every copy handed to a worker")
    with contextlib.suppress(AssertionError):
        wait_until(lambda: unacked_here() == 0, timeout=30, what="every copy acknowledged")
    for run_id in run_ids:
        assert side_effects(run_id, "start") == 1, run_id
        assert side_effects(run_id, "finish") == 1, run_id


def test_kill_9_mid_run_is_resumed_by_another_worker(admit, side_effects, fast_env, pg,
                                                      log_dir, processes):
    """7: SIGKILL a worker mid-run; beat finds the dead boot's run, another worker resumes."""
    env = {**fast_env, "POIMEN_REPAIR_MIN_AGE": "30"}  # queued runs: not re-sent
    run_id = admit("effect", {"seconds": 3})
    victim = start_worker(env, log_dir, "victim")
    processes.append(victim)
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")
    victim_boot = run_row(pg, run_id)[2]
    victim.kill()
    assert run_row(pg, run_id)[0] == "running"

    processes.append(start_worker(env, log_dir, "rescuer"))
    processes.append(start_beat(env, log_dir))
    status, attempt, holder, result, error, failures = wait_status(pg, run_id, {"succeeded"})
    assert attempt == 2
    assert failures == 0  # losing a worker is not the workflow's failure
    assert side_effects(run_id, "start") == 2   # started again from the top ...
    assert side_effects(run_id, "finish") == 1  # ... and finished exactly once
    assert result == {"attempt": 2}
    events = [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]
    assert events == ["run.admitted", "run.started", "run.resumed", "run.succeeded"]
    # The rescuer's boot holds the finished run, not the victim's.
    assert holder is not None and holder != victim_boot


def test_redelivery_while_running_executes_once(admit, side_effects, fast_env, pg, log_dir,
                                                processes):
    """8: a Redis visibility_timeout shorter than the run redelivers it mid-run."""
    env = {**fast_env, "POIMEN_VISIBILITY_TIMEOUT": "1", "POIMEN_UNACKED_RESTORE_INTERVAL": "1",
           "POIMEN_UNACKED_RESTORE_THROTTLE": "1"}
    run_id = admit("effect", {"seconds": 5})
    workers = [start_worker(env, log_dir, f"vt{i}", concurrency=2) for i in range(2)]
    processes.extend(workers)
    wait_status(pg, run_id, {"succeeded"}, timeout=90)
    assert side_effects(run_id, "start") == 1
    assert side_effects(run_id, "finish") == 1
    logs = "".join(w.log() for w in workers)
    assert "duplicate" in logs, "the message was never redelivered; the test proved nothing"


def test_cancel_before_start_never_runs(admit, side_effects, fast_env, pg, log_dir, processes,
                                        client, tenant, redis_client, queue_name):
    """9: cancelled while queued; the worker consumes the message and does nothing."""
    run_id = admit("effect", {"seconds": 0})
    r = client.post(f"/v1/runs/{run_id}/cancel", headers=tenant.headers)
    assert r.json["status"] == "cancelled"
    processes.append(start_worker(fast_env, log_dir))
    wait_until(lambda: redis_client.llen(queue_name) == 0 and "finished" in processes[0].log(),
               timeout=60, what="the message to be consumed")
    assert run_row(pg, run_id)[0] == "cancelled"
    assert side_effects(run_id) == 0


def test_cancel_while_running_stops_at_the_next_checkpoint(admit, side_effects, fast_env, pg,
                                                           log_dir, processes, client, tenant):
    run_id = admit("effect", {"seconds": 30})
    processes.append(start_worker(fast_env, log_dir))
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="start")
    r = client.post(f"/v1/runs/{run_id}/cancel", headers=tenant.headers)
    assert r.status_code == 202 and r.json["cancel_requested"] is True
    status, *_ = wait_status(pg, run_id, {"cancelled", "succeeded"}, timeout=30)
    assert status == "cancelled"
    assert side_effects(run_id, "cancelled") == 1
    assert side_effects(run_id, "finish") == 0


def test_workflow_retries_then_fails_or_succeeds(admit, side_effects, fast_env, pg, log_dir,
                                                 processes):
    recovers = admit("flaky", {"failures": 2})      # max_attempts=3: succeeds on the 3rd try
    gives_up = admit("flaky", {"failures": 5})      # fails 3 times: failed
    processes.append(start_worker(fast_env, log_dir, concurrency=2))
    status, attempt, _, result, error, failures = wait_status(pg, recovers, {"succeeded",
                                                                            "failed"})
    assert (status, attempt, failures, result) == ("succeeded", 3, 2,
                                                   {"failures_before_success": 2})
    status, attempt, _, result, error, failures = wait_status(pg, gives_up, {"succeeded",
                                                                            "failed"})
    assert (status, attempt, failures) == ("failed", 3, 3)
    assert error["type"] == "tests.workflows.Flaky"
    assert error["message"] == "failure number 3"
    assert "Traceback" in error["traceback"]
    assert side_effects(gives_up, "try") == 3


def test_http_run_reaches_succeeded_with_its_result(live_api, tenant, fast_env, log_dir,
                                                    processes):
    processes.append(start_worker(fast_env, log_dir))
    r = requests.post(f"{live_api}/v1/runs", headers=tenant.headers, timeout=10,
                      json={"workflow_ref": "echo", "input": {"hello": "world"}})
    assert r.status_code == 201
    url = f"{live_api}{r.headers['Location']}"
    run = wait_until(lambda: (body := requests.get(url, headers=tenant.headers,
                                                   timeout=10).json())["status"] == "succeeded"
                     and body, timeout=60, what="echo to succeed")
    assert run["result"] == {"hello": "world"}
    assert run["started_at"] and run["finished_at"] and run["attempt"] == 1

    failed = requests.post(f"{live_api}/v1/runs", headers=tenant.headers, timeout=10,
                           json={"workflow_ref": "fail", "input": {"message": "boom"}}).json()
    url = f"{live_api}/v1/runs/{failed['id']}"
    run = wait_until(lambda: (body := requests.get(url, headers=tenant.headers,
                                                   timeout=10).json())["status"] == "failed"
                     and body, timeout=60, what="fail to fail")
    assert run["error"]["message"] == "boom"
    assert run["error"]["type"] == "workers.examples.ExampleFailure"


def test_a_run_whose_message_was_lost_is_re_sent_by_beat(admit, side_effects, fast_env, pg,
                                                         log_dir, processes, redis_client,
                                                         queue_name):
    """Committed, but its Celery message is gone: beat's repair re-sends it."""
    run_id = admit("effect", {"seconds": 0})
    redis_client.delete(queue_name)  # the message is lost
    env = fast_env
    processes.append(start_worker(env, log_dir))
    processes.append(start_beat(env, log_dir))
    wait_status(pg, run_id, {"succeeded"}, timeout=60)
    assert side_effects(run_id, "finish") == 1


def test_a_worker_prepares_statements_only_where_database_url_is_its_checked_lock_database(
        admit, fast_env, pg, log_dir, processes):
    """POIMEN_DB_PREPARE_THRESHOLD=auto (the default): a worker whose DATABASE_URL is its lock
    database (checked at start to keep a session: no transaction pooler) prepares statements
    and runs with them; one given a separate POIMEN_LOCK_DATABASE_URL prepares none (its
    DATABASE_URL may be a pooler's: tests/chaos/test_pooler.py runs that case for real)."""
    env = {name: value for name, value in fast_env.items()
           if name not in ("POIMEN_DB_PREPARE_THRESHOLD", "POIMEN_LOCK_DATABASE_URL")}
    direct = start_worker(env, log_dir, "direct", concurrency=2)
    processes.append(direct)
    # More runs than psycopg's threshold (5): the claim and the finish run prepared.
    run_ids = [admit("echo", {"n": n}) for n in range(12)]
    for run_id in run_ids:
        wait_status(pg, run_id, {"succeeded"})
    assert "prepared statements on" in direct.log()
    direct.stop()

    # The same database under another spelling: no longer provably the pooled one's.
    separate = {**env, "POIMEN_LOCK_DATABASE_URL": env["DATABASE_URL"] + (
        "&" if "?" in env["DATABASE_URL"] else "?") + "application_name=poimen-lock-test"}
    pooled = start_worker(separate, log_dir, "separate")
    processes.append(pooled)
    run_id = admit("echo", {"n": 99})
    wait_status(pg, run_id, {"succeeded"})
    assert "prepared statements off" in pooled.log()
    assert "prepared statements on" not in pooled.log()
