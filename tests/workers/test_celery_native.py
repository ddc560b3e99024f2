"""Celery's own tools keep their meaning (docs/guide/celery.md), against real processes.

Flower (the Procfile's command) and a real event receiver (what ``celery
events`` uses) see each run's task end the way the run ended; ``celery control
revoke`` (with and without ``--terminate``) cancels runs; a plain
``@shared_task(bind=True)`` runs as a workflow; workflows choose their queue,
time limits and priority.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid

import pytest
import requests

from tests.processes import (
    BIN,
    ROOT,
    Process,
    free_port,
    start_beat,
    start_procfile_process,
    start_worker,
    wait_until,
)

MODULES = "tests.workflows,tests.workflows.celery_tasks"


@pytest.fixture
def celery_tasks(app):
    """Register the Celery-task workflows in this process too (admission validates refs)."""
    import tests.workflows.celery_tasks as module

    return module


@pytest.fixture
def env(fast_env, celery_tasks, side_effects):
    """Child processes' environment (the test workflows record into side_effects), with
    fast probes and repair (``FAST_TIMINGS``): these tests are not about the timings."""
    return {**fast_env, "POIMEN_WORKFLOW_MODULES": MODULES}


def run_row(pg, run_id):
    return pg.execute(
        "SELECT status, attempt, failures, result, error, cancel_requested FROM runs "
        "WHERE id = %s", [run_id]).fetchone()


def wait_status(pg, run_id, statuses, timeout=90):
    return wait_until(lambda: run_row(pg, run_id)[0] in statuses and run_row(pg, run_id),
                      timeout=timeout, what=f"run {run_id} to reach {statuses}")


def run_events(pg, run_id) -> list[str]:
    return [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]


def effects(pg, run_id) -> list[str]:
    return [r[0] for r in pg.execute(
        "SELECT kind FROM side_effects WHERE run_id = %s ORDER BY id", [run_id])]


def celery_cli(env, *args: str) -> subprocess.CompletedProcess:
    """Run ``celery -A workers <args>`` as an operator would."""
    proc = subprocess.run([str(BIN / "celery"), "-A", "workers", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def wait_ready(worker: Process, timeout: float = 90) -> None:
    def ready() -> bool:
        if not worker.alive():
            raise AssertionError(f"{worker.name} exited:\n{worker.log()[-3000:]}")
        return " ready." in worker.log()

    wait_until(ready, timeout=timeout, what=f"{worker.name} to be ready")


class EventLog:
    """Celery task events, captured by a real receiver (as ``celery events`` does)."""

    def __init__(self, celery_app):
        self.app = celery_app
        self.events: list[dict] = []
        self.ready = threading.Event()
        self.receiver = None
        self.thread = threading.Thread(target=self._capture, daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the event receiver never started consuming"

    def _capture(self) -> None:
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self._on_event})
            self.receiver.on_consume_ready = lambda *a, **k: self.ready.set()
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def _on_event(self, event: dict) -> None:
        if event.get("type", "").startswith("task-"):
            self.events.append(event)

    def of(self, run_id) -> list[str]:
        return [e["type"] for e in self.full(run_id)]

    def full(self, run_id) -> list[dict]:
        return [e for e in list(self.events) if e.get("uuid") == str(run_id)]

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(10)


@pytest.fixture
def task_events(app):
    log = EventLog(app.extensions["celery"])
    yield log
    log.stop()


@pytest.fixture
def flower(env, tmp_path, processes):
    """The Procfile's ``flower``, with basic auth (its API is refused without it)."""
    port = free_port()
    proc = start_procfile_process("flower", {**env, "PORT": str(port),
                                             "FLOWER_BASIC_AUTH": "ops:s3cret"}, tmp_path)
    processes.append(proc)
    url = f"http://127.0.0.1:{port}"

    def answering() -> bool:
        if not proc.alive():
            raise AssertionError(f"flower exited:\n{proc.log()[-3000:]}")
        return requests.get(f"{url}/healthcheck", timeout=2).ok

    wait_until(answering, timeout=90, what="flower")
    assert requests.get(f"{url}/api/task/info/{uuid.uuid4()}", timeout=5).status_code == 401

    def task_info(run_id) -> dict | None:
        r = requests.get(f"{url}/api/task/info/{run_id}", auth=("ops", "s3cret"), timeout=5)
        return r.json() if r.status_code == 200 else None

    task_info.url = url  # its pages (``browser``)
    return task_info


@pytest.fixture
def browser():
    """Headless Chromium (Debian's ``chromium`` and ``chromium-driver``, as the console's
    tests drive it) that can resolve no host but 127.0.0.1."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.skip("no browser: install Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1700", "--no-first-run", "--disable-sync",
                "--disable-background-networking", "--disable-component-update",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def flower_state(flower, run_id) -> str | None:
    info = flower(run_id)
    return info and info.get("state")


READY_STATES = {"SUCCESS", "FAILURE", "REVOKED"}


def flower_verdict(flower, run_id, what: str, timeout: float = 120) -> dict:
    """Wait until Flower shows ``run_id``'s task in a ready state; return its info."""
    return wait_until(lambda: (flower_state(flower, run_id) in READY_STATES) and flower(run_id),
                      timeout=timeout, what=what)


# -- 1. Flower and `celery events` tell the run's outcome ------------------------------------

def test_flower_and_task_events_show_each_runs_outcome(admit, env, pg, tmp_path, processes,
                                                        flower, task_events, side_effects,
                                                        client, tenant, app):
    """A failed run is FAILURE, a duplicate delivery never SUCCESS, a retry RETRY, a cancel REVOKED."""
    from app.enqueue import send_run

    worker = start_worker(env, tmp_path, "flowerw", concurrency=1)
    processes.append(worker)

    failed = admit("fail", {"message": "secret input text"})
    info = flower_verdict(flower, failed, "Flower to show the failed run's task ready")
    assert info["state"] == "FAILURE", info
    assert run_row(pg, failed)[0] == "failed"
    assert info["name"] == "runs.execute[fail@1]"
    assert "RunFailed" in info["exception"] and "secret input text" not in info["exception"]
    wait_until(lambda: "task-failed" in task_events.of(failed), timeout=30,
               what="a task-failed event")
    assert "task-succeeded" not in task_events.of(failed)
    assert "secret input text" not in worker.log()

    succeeded = admit("echo", {"n": 1})
    assert flower_verdict(flower, succeeded, "the succeeded run's task")["state"] == "SUCCESS"

    # A duplicate delivery of the finished run does no work: no SUCCESS for it.
    # One worker process takes messages in order, so once a later run has
    # succeeded, the duplicate was consumed.
    with app.app_context():
        send_run(app.extensions["celery"], failed, "fail@1")
    wait_until(lambda: task_events.of(failed).count("task-started") == 2, timeout=60,
               what="the duplicate delivery to start")
    marker = admit("echo", {"n": 2})
    wait_until(lambda: "task-succeeded" in task_events.of(marker), timeout=60,
               what="the run after the duplicate to succeed")
    assert "task-succeeded" not in task_events.of(failed)
    assert flower_state(flower, failed) == "FAILURE"

    # A workflow exception with attempts left: RETRY, then the retry's SUCCESS.
    flaky = admit("flaky", {"failures": 1})
    assert flower_verdict(flower, flaky, "the flaky run's task")["state"] == "SUCCESS"
    assert run_row(pg, flaky)[:3] == ("succeeded", 2, 1)
    # Task events reach receivers in batches, up to POIMEN_EVENT_FLUSH_INTERVAL late.
    wait_until(lambda: task_events.of(flaky).count("task-succeeded") == 1, timeout=10,
               what="the flaky run's task-succeeded event")
    assert task_events.of(flaky).count("task-retried") == 1

    # Cancelled through the API while running: REVOKED.
    cancelled = admit("effect", {"seconds": 60})
    wait_until(lambda: side_effects(cancelled, "start") == 1, timeout=60,
               what="the long run to start")
    assert client.post(f"/v1/runs/{cancelled}/cancel", headers=tenant.headers).status_code \
        in (200, 202)
    assert flower_verdict(flower, cancelled, "the cancelled run's task")["state"] == "REVOKED"
    assert run_row(pg, cancelled)[0] == "cancelled"
    assert "task-succeeded" not in task_events.of(cancelled)


def _task_page(browser, flower, run_id) -> dict[str, object]:
    """Flower's task page of ``run_id`` in the browser: each row's label (lower case) -> its
    value element. Flower's basic auth travels in the URL (as a person types it once)."""
    from selenium.webdriver.common.by import By

    browser.get(flower.url.replace("http://", "http://ops:s3cret@") + f"/task/{run_id}")
    wait_until(lambda: browser.find_elements(By.ID, "taskid"), timeout=30,
               what=f"Flower's page of task {run_id}")
    assert browser.find_element(By.ID, "taskid").get_attribute("textContent") == str(run_id)
    rows = {}
    for row in browser.find_elements(By.CSS_SELECTOR, "#task-page dl .detail-row"):
        label = row.find_element(By.TAG_NAME, "dt").get_attribute("textContent").strip()
        rows[label.lower()] = row.find_element(By.TAG_NAME, "dd")
    return rows


def _links_to(value, run_id) -> bool:
    from selenium.webdriver.common.by import By

    links = value.find_elements(By.TAG_NAME, "a")
    return any(a.get_attribute("href").endswith(f"/task/{run_id}") for a in links)


def test_flowers_task_page_shows_a_runs_retries_and_its_run_tree(admit, env, pg, tmp_path,
                                                                 processes, flower, browser):
    """What Flower shows of a Celery task's retries and its parent/root, it shows of runs: a
    run that succeeds on its third attempt shows Retries 2, a fan-out child links its parent
    run's task (and its tree's root), a top-level run none (its root is itself)."""
    from selenium.webdriver.common.by import By

    processes.append(start_worker(env, tmp_path, "treew", concurrency=1))
    flaky = admit("flaky", {"failures": 2})
    assert flower_verdict(flower, flaky, "the flaky run's task")["state"] == "SUCCESS"
    assert run_row(pg, flaky)[:3] == ("succeeded", 3, 2)
    # The page shows the task's latest received message: its third.
    page = wait_until(lambda: (rows := _task_page(browser, flower, flaky)).get("retries")
                      and rows["retries"].text.strip() == "2" and rows,
                      timeout=30, what="Flower's page to show Retries 2")
    assert "parent id" not in page  # a top-level run: no parent, not the task that sent it
    assert _links_to(page["root id"], flaky)

    review = admit("doc-review", {"participants": ["ana"]})
    child = wait_until(lambda: pg.execute("SELECT id FROM runs WHERE parent_run_id = %s",
                                          [review]).fetchone(),
                       timeout=90, what="the review's child run")[0]
    assert flower_verdict(flower, child, "the child run's task")["state"] == "SUCCESS"
    wait_status(pg, review, {"succeeded"})
    page = _task_page(browser, flower, child)
    assert page["retries"].text.strip() == "0"
    assert _links_to(page["parent id"], review) and _links_to(page["root id"], review)
    # The link leads to the parent run's own task page.
    page["parent id"].find_element(By.TAG_NAME, "a").click()
    wait_until(lambda: browser.find_element(By.ID, "taskid").get_attribute("textContent")
               == str(review), timeout=30, what="the parent run's task page")
    parent_page = _task_page(browser, flower, review)
    assert "parent id" not in parent_page and _links_to(parent_page["root id"], review)
    # The review waited for its child (a join) and resumed: a second execution.
    assert parent_page["retries"].text.strip() == "1"


def test_a_duplicate_delivery_while_the_run_goes_is_not_a_success(admit, env, pg, tmp_path,
                                                                   processes, task_events,
                                                                   side_effects, app):
    from app.enqueue import send_run

    processes.append(start_worker(env, tmp_path, "dupw", concurrency=2))
    run_id = admit("effect", {"seconds": 4})
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")
    with app.app_context():
        send_run(app.extensions["celery"], run_id, "effect@1")
    wait_until(lambda: task_events.of(run_id).count("task-started") == 2, timeout=60,
               what="the duplicate delivery to start")
    assert run_row(pg, run_id)[0] == "running"
    assert "task-succeeded" not in task_events.of(run_id)
    wait_status(pg, run_id, {"succeeded"})
    # The run's own SUCCESS, told apart by its result. The worker's events reach the
    # receiver in the order it sent them, so a SUCCESS of the duplicate delivery, which
    # ended seconds earlier, would be here by then (events are flushed in batches: a
    # count taken at the first SUCCESS to arrive could miss the second).
    wait_until(lambda: any(e["type"] == "task-succeeded" and "succeeded" in str(e.get("result"))
                           for e in task_events.full(run_id)),
               timeout=30, what="the run's own SUCCESS")
    assert task_events.of(run_id).count("task-succeeded") == 1
    assert side_effects(run_id, "start") == 1


# -- 2. revoke and terminate cancel runs -----------------------------------------------------

def test_revoke_of_a_queued_run_cancels_it_and_it_never_runs(admit, env, pg, tmp_path,
                                                             processes, side_effects,
                                                             task_events, client, tenant):
    worker = start_worker(env, tmp_path, "revw", concurrency=1)
    processes.append(worker)
    # Beat re-sends queued runs twice a second: a revoked run left queued would be re-sent.
    processes.append(start_beat(env, tmp_path))
    wait_ready(worker)
    # The worker's one process is busy, so the next run waits in the queue.
    blocker = admit("effect", {"seconds": 120})
    wait_until(lambda: side_effects(blocker, "start") == 1, timeout=60, what="the blocker")
    queued = admit("effect", {"seconds": 0})
    assert run_row(pg, queued)[0] == "queued"

    out = celery_cli(env, "control", "--timeout", "10", "revoke", str(queued))
    assert "revw@" in out.stdout and "revoked" in out.stdout, out.stdout
    # Free the worker: it takes the revoked run's message next.
    assert client.post(f"/v1/runs/{blocker}/cancel", headers=tenant.headers).status_code \
        in (200, 202)

    status, attempt, *_ = wait_status(pg, queued, {"cancelled", "succeeded"}, timeout=60)
    assert status == "cancelled"
    assert attempt == 0
    assert run_events(pg, queued) == ["run.admitted", "run.cancelled"]
    assert side_effects(queued, "start") == 0
    wait_until(lambda: "task-revoked" in task_events.of(queued), timeout=30,
               what="the task-revoked event")
    assert "task-started" not in task_events.of(queued)


def test_a_revoke_is_recorded_when_issued_and_survives_a_full_worker_restart(
        admit, env, pg, tmp_path, processes, side_effects, client, tenant, redis_client,
        queue_name):
    """Celery keeps revoked ids in worker memory only: a run revoked while its message waited
    ran after the next full restart (every Heroku deploy). The revoke is the API's cancel,
    recorded by the command itself, before any worker sees the message."""
    worker = start_worker(env, tmp_path, "revr", concurrency=1)
    processes.append(worker)
    wait_ready(worker)
    blocker = admit("effect", {"seconds": 120})
    wait_until(lambda: side_effects(blocker, "start") == 1, timeout=60, what="the blocker")
    queued = admit("effect", {"seconds": 0})
    wait_until(lambda: redis_client.llen(queue_name) == 1, timeout=10,
               what="the run's message waiting in the queue")

    celery_cli(env, "control", "--timeout", "2", "revoke", str(queued))
    # At once, in the API: the command recorded it (no worker has seen the message yet).
    answer = client.get(f"/v1/runs/{queued}", headers=tenant.headers).get_json()
    assert answer["status"] == "cancelled", answer
    assert redis_client.llen(queue_name) == 1

    worker.kill()  # a full restart: the worker's in-memory revoked set is gone
    restarted = start_worker(env, tmp_path, "revr2", concurrency=1)
    processes.append(restarted)
    wait_ready(restarted)
    wait_until(lambda: redis_client.llen(queue_name) == 0, timeout=60,
               what="the restarted worker to take the message")
    time.sleep(3)  # what it does with the message would show by now
    assert side_effects(queued, "start") == 0
    assert run_row(pg, queued)[0] == "cancelled"
    assert run_events(pg, queued) == ["run.admitted", "run.cancelled"]


def test_revoke_terminate_cancels_a_running_run_and_it_is_not_resumed(admit, env, pg, tmp_path,
                                                                     processes, side_effects,
                                                                     task_events):
    worker = start_worker(env, tmp_path, "termw", concurrency=1)
    processes.append(worker)
    # Beat re-sends runs of dead boots twice a second: a resumable run would be resumed.
    processes.append(start_beat({**env, "POIMEN_TAKEOVER_DELAY": "0"}, tmp_path))
    run_id = admit("blind", {"seconds": 60})  # no checkpoint: only killing it stops it
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")

    # The CLI's form of revoke(terminate=True), with Celery's default signal.
    out = celery_cli(env, "control", "--timeout", "10", "terminate", "SIGTERM", str(run_id))
    assert "termw@" in out.stdout, out.stdout

    status, attempt, failures, result, error, cancel_requested = wait_status(
        pg, run_id, {"cancelled", "succeeded", "failed"}, timeout=60)
    assert (status, attempt, failures, cancel_requested) == ("cancelled", 1, 0, True)
    events = run_events(pg, run_id)
    assert events.count("run.started") == 1 and "run.resumed" not in events, events
    assert events[-1] == "run.cancelled"
    wait_until(lambda: "task-revoked" in task_events.of(run_id), timeout=10,
               what="the task-revoked event")

    # The worker lives on with a new pool process, and later runs are not hurt.
    after = admit("effect", {"seconds": 0})
    wait_status(pg, after, {"succeeded"}, timeout=60)
    assert worker.alive()
    events = run_events(pg, run_id)
    assert events.count("run.started") == 1 and "run.resumed" not in events, events
    assert side_effects(run_id, "start") == 1 and side_effects(run_id, "finish") == 0


def test_purge_deletes_messages_not_runs_and_beat_sends_them_again(admit, env, pg, tmp_path,
                                                                   processes, queue_name,
                                                                   redis_client, sent):
    run_id = admit("echo", {"purged": True})
    sent()
    assert redis_client.llen(queue_name) >= 1

    out = celery_cli(env, "purge", "-f", "-Q", queue_name)
    assert redis_client.llen(queue_name) == 0, out.stdout
    assert run_row(pg, run_id)[0] == "queued"  # the run lives in Postgres

    processes.append(start_worker(env, tmp_path, "purgew", concurrency=1))
    processes.append(start_beat(env, tmp_path))
    status, attempt, *_ = wait_status(pg, run_id, {"succeeded", "failed"}, timeout=90)
    assert (status, attempt) == ("succeeded", 1)


# -- 3. existing @shared_task code as a workflow ---------------------------------------------

def test_a_shared_task_that_retries_twice_runs_as_a_workflow(admit, env, pg, tmp_path,
                                                            processes, task_events):
    processes.append(start_worker(env, tmp_path, "taskw", concurrency=1))
    # A fan-out child's (as a parent's spawn admits it): its request names its run tree.
    parent = admit("echo", {"n": 0})
    run_id = admit("tests.celery_tasks.retry_twice", {"countdown": 0.2}, parent_run_id=parent)
    given_up = admit("celery-give-up")

    status, attempt, failures, result, error, _ = wait_status(pg, run_id, {"succeeded",
                                                                           "failed"})
    assert status == "succeeded", error
    assert (attempt, failures) == (3, 2)  # three attempts, one success
    # self.request.id is the run id (each attempt recorded its side effect under it).
    assert effects(pg, run_id) == ["try:0", "try:1", "try:2"]
    # The third attempt's delivery is the worker's retry send: still the child's tree.
    assert result == {"request_id": str(run_id), "retries": 2, "parent_id": str(parent),
                      "root_id": str(parent)}
    events = run_events(pg, run_id)
    assert events.count("run.retrying") == 2 and events.count("run.started") == 3
    assert events[-1] == "run.succeeded"
    wait_until(lambda: task_events.of(run_id).count("task-succeeded") == 1, timeout=10,
               what="the task-succeeded event")
    assert task_events.of(run_id).count("task-retried") == 2

    # max_retries=1: the second self.retry() raises the task's exception: failed.
    status, attempt, failures, _, error, _ = wait_status(pg, given_up, {"succeeded", "failed"})
    assert (status, attempt, failures) == ("failed", 2, 2)
    assert error["type"].endswith("NotYet")
    assert effects(pg, given_up) == ["try:0", "try:1"]


# -- 4. routing and time limits --------------------------------------------------------------

def test_a_workflow_on_another_queue_runs_only_on_a_worker_consuming_it(
        admit, env, pg, tmp_path, processes, celery_tasks, redis_client, side_effects):
    slow = celery_tasks.SLOW_QUEUE
    default = start_worker(env, tmp_path, "defaultw", concurrency=1)
    processes.append(default)
    routed = admit("routed-slow")
    plain = admit("echo")

    # The default worker drains its own queue and leaves the slow one alone.
    wait_status(pg, plain, {"succeeded"})
    assert run_row(pg, routed)[0] == "queued"
    assert side_effects(routed, "start") == 0

    # The message carries the workflow's queue, priority and time limits.
    keys = [k for k in redis_client.keys(f"{slow}*") if k.decode().startswith(slow)]
    messages = [json.loads(m) for k in keys for m in redis_client.lrange(k, 0, -1)]
    mine = [m for m in messages if m["headers"]["id"] == str(routed)]
    assert len(mine) == 1, messages
    assert mine[0]["properties"]["priority"] == 3
    assert mine[0]["headers"]["timelimit"] == [120, 100]
    assert mine[0]["headers"]["shadow"] == "runs.execute[routed-slow@1]"

    slow_worker = start_worker(env, tmp_path, "sloww", concurrency=1, extra=["-Q", slow])
    processes.append(slow_worker)
    status, *_ , result, error, _ = wait_status(pg, routed, {"succeeded", "failed"})
    assert status == "succeeded", error
    assert result["ppid"] == slow_worker.pid  # a pool process of the slow queue's worker
    assert side_effects(routed, "start") == 1


def test_beat_keeps_a_queue_no_worker_consumes_within_a_page(
        admit, env, pg, tmp_path, processes, celery_tasks, redis_client):
    """Repair bounded per queue, with real beat and a real worker that consumes only the
    default queue: 300 runs on a queue nobody consumes are re-sent every tick only up to
    that queue's room below a page (1,000 messages); reading the default queue's depth
    (empty) instead would grow the slow queue by 300 a tick without bound."""
    slow = celery_tasks.SLOW_QUEUE

    def slow_depth() -> int:  # priority levels are lists of their own on Redis
        return sum(redis_client.llen(k) for k in redis_client.keys(f"{slow}*")
                   if k.decode().startswith(slow))

    for key in redis_client.keys(f"{slow}*"):
        redis_client.delete(key)
    processes.append(start_worker(env, tmp_path, "pagew", concurrency=1))
    processes.append(start_beat(env, tmp_path))
    for n in range(300):
        admit("routed-slow", {"n": n})
    try:
        wait_until(lambda: slow_depth() >= 900, timeout=60, what="repair to fill the room")
        depths = []
        for _ in range(12):  # a dozen more ticks
            time.sleep(float(env["POIMEN_REPAIR_INTERVAL"]))
            depths.append(slow_depth())
        assert max(depths) <= 1000, depths
    finally:
        for key in redis_client.keys(f"{slow}*"):
            redis_client.delete(key)


def test_a_run_past_its_hard_time_limit_fails_and_is_not_resumed(admit, env, pg, tmp_path,
                                                                processes, side_effects,
                                                                task_events):
    worker = start_worker(env, tmp_path, "limitw", concurrency=1)
    processes.append(worker)
    processes.append(start_beat({**env, "POIMEN_TAKEOVER_DELAY": "0"}, tmp_path))
    run_id = admit("over-time", {"seconds": 60})

    status, attempt, failures, result, error, _ = wait_status(
        pg, run_id, {"failed", "succeeded", "cancelled"}, timeout=90)
    assert status == "failed"
    assert error["code"] == "time_limit", error
    assert attempt == 1 and failures == 1
    wait_until(lambda: "task-failed" in task_events.of(run_id), timeout=30,
               what="the task-failed event")

    # Later runs go through the same worker (its killed pool process was replaced);
    # by then beat has had many ticks to resume the over-time run, had it been left running.
    # The soft limit reaches the workflow as SoftTimeLimitExceeded, which it may catch.
    soft = admit("soft-time", {"seconds": 60})
    status, *_, result, error, _ = wait_status(pg, soft, {"succeeded", "failed"}, timeout=60)
    assert (status, result) == ("succeeded", {"stopped_by": "soft_time_limit"}), error
    after = admit("effect", {"seconds": 0})
    wait_status(pg, after, {"succeeded"}, timeout=60)
    events = run_events(pg, run_id)
    assert events == ["run.admitted", "run.started", "run.failed"], events
    assert side_effects(run_id, "start") == 1 and side_effects(run_id, "finish") == 0
    assert worker.alive()


def test_routing_options_are_checked_when_a_workflow_is_declared():
    from workers.registry import InvalidDefinition, workflow

    def body(ctx, input):
        return None

    for bad in ({"soft_time_limit": 10, "time_limit": 5}, {"time_limit": 0},
                {"priority": 256}, {"queue": "no spaces allowed"}, {"time_limit": True}):
        with pytest.raises(InvalidDefinition):
            workflow("bad-routing", version="1", **bad)(body)
