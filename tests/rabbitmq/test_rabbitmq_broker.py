"""Poimen on RabbitMQ: web, worker and beat with ``CELERY_BROKER_URL=amqp://...``, real
processes, the real broker (see conftest.py for where it comes from and how sessions are
kept apart). Postgres and Redis stay where they are used for everything else.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from urllib.parse import unquote, urlsplit

import pytest
import redis as redis_lib
from celery import Celery
from kombu import Connection

from bridge.client import Runs
from celeryconfig import celery_settings
from tests.processes import (
    free_port,
    metric,
    start_beat,
    start_web,
    start_worker,
    wait_until,
)


def run_row(pg, run_id):
    return pg.execute("SELECT status, attempt, takeovers FROM runs WHERE id = %s",
                      [run_id]).fetchone()


def events_of(pg, run_id) -> list[str]:
    return [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]


def amqp_queue_depth(url: str, queue: str) -> int | None:
    """Messages in ``queue`` on RabbitMQ, or None if the queue does not exist there."""
    from kombu.exceptions import ChannelError

    with Connection(url) as conn:
        conn.ensure_connection(max_retries=3)
        channel = conn.channel()
        try:
            return channel.queue_declare(queue=queue, passive=True).message_count
        except ChannelError:
            return None


def start_api(env, tmp_path, processes) -> str:
    web, url = start_web(env, tmp_path, workers=1, threads=4, name="amqp-web")
    processes.append(web)
    return url


def test_a_run_admitted_over_http_is_executed_through_rabbitmq(amqp_env, amqp_url, queue_name,
                                                               tenant, pg, tmp_path, processes):
    url = start_api(amqp_env, tmp_path, processes)
    worker = start_worker(amqp_env, tmp_path, "amqp-worker")
    processes.append(worker)
    with Runs(url, tenant.token) as runs:
        run = runs.admit("echo", {"broker": "rabbitmq"})
        done = runs.wait(run.id, timeout=90)
    assert done.status == "succeeded" and done.result == {"broker": "rabbitmq"}
    assert events_of(pg, run.id) == ["run.admitted", "run.started", "run.succeeded"]
    # The message went through RabbitMQ: the worker is connected there, and the session's
    # queue exists there (drained), not in Redis.
    assert f"Connected to amqp://guest:**@127.0.0.1:5672{urlsplit(amqp_url).path}" in worker.log()
    assert amqp_queue_depth(amqp_url, queue_name) == 0


def test_beat_re_sends_a_run_whose_message_rabbitmq_lost(amqp_env, amqp_url, queue_name, tenant,
                                                         pg, tmp_path, processes):
    """Admit with no worker, purge the queue (the message is lost), then start a worker and
    beat: beat's repair finds the queued run over amqp and re-sends it; it runs once."""
    env = {**amqp_env, "POIMEN_REPAIR_MIN_AGE": "2"}
    url = start_api(env, tmp_path, processes)
    with Runs(url, tenant.token) as runs:
        run = runs.admit("echo", {"lost": True})
    wait_until(lambda: amqp_queue_depth(amqp_url, queue_name) == 1, timeout=30,
               what="the run's message in RabbitMQ")
    with Connection(amqp_url) as conn:
        assert conn.default_channel.queue_purge(queue_name) == 1
    processes.append(start_worker(env, tmp_path, "amqp-worker"))
    processes.append(start_beat(env, tmp_path, "amqp-beat"))
    wait_until(lambda: run_row(pg, run.id)[0] == "succeeded", timeout=90,
               what="beat to re-send the lost run and the worker to finish it")
    assert events_of(pg, run.id).count("run.started") == 1


def test_kill_9_of_a_worker_mid_run_resumes_the_run_exactly_once(amqp_env, tenant, side_effects,
                                                                 pg, tmp_path, processes):
    """SIGKILL the worker running a run: RabbitMQ re-delivers the unacked message, the
    rescuer takes the dead boot's claim over and finishes the run: one resume, one finish."""
    env = {**amqp_env, "POIMEN_REPAIR_MIN_AGE": "30"}
    url = start_api(env, tmp_path, processes)
    victim = start_worker(env, tmp_path, "amqp-victim")
    processes.append(victim)
    with Runs(url, tenant.token) as runs:
        run = runs.admit("blind", {"seconds": 3})
    run_id = uuid.UUID(run.id)
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")
    victim.kill()
    assert side_effects(run_id, "finish") == 0

    processes.append(start_worker(env, tmp_path, "amqp-rescuer"))
    processes.append(start_beat(env, tmp_path, "amqp-beat"))
    wait_until(lambda: run_row(pg, run_id)[0] == "succeeded", timeout=120,
               what="the run to be resumed and succeed")
    assert run_row(pg, run_id)[1:] == (2, 1)  # attempt 2, one takeover
    assert side_effects(run_id, "start") == 2 and side_effects(run_id, "finish") == 1
    events = events_of(pg, run_id)
    assert events.count("run.resumed") == 1 and events.count("run.succeeded") == 1


# -- queue depth on both brokers ---------------------------------------------------------------


def test_beats_queue_depth_gauge_answers_on_rabbitmq(amqp_env, amqp_url, queue_name, tenant,
                                                    tmp_path, processes):
    """The scraped gauge itself (beat exports the global gauges): two runs admitted over
    amqp with no worker are two messages waiting, and the scrape logs no failure."""
    env = {**amqp_env, "POIMEN_REPAIR_INTERVAL": "3600", "POIMEN_METRICS_CACHE_SECONDS": "0"}
    if amqp_queue_depth(amqp_url, queue_name):  # copies earlier tests' workers left behind
        with Connection(amqp_url) as conn:
            conn.default_channel.queue_purge(queue_name)
    url = start_api(env, tmp_path, processes)
    port = free_port()
    beat = start_beat({**env, "METRICS_PORT": str(port)}, tmp_path, "amqp-beat")
    processes.append(beat)
    with Runs(url, tenant.token) as runs:
        for i in range(2):
            runs.admit("echo", {"i": i})
    wait_until(lambda: metric(f"http://127.0.0.1:{port}/metrics", "poimen_queue_depth",
                              queue=queue_name) == 2, timeout=60,
               what="beat's poimen_queue_depth to count two messages on RabbitMQ")
    assert "queue depth not measured" not in beat.log()



# amqp: the session's vhost is made by rabbitmqctl (amqp_url), so that case starts processes.
@pytest.mark.parametrize("broker", ["redis", pytest.param("amqp", marks=pytest.mark.processes)])
def test_queue_depth_answers_on_both_brokers(broker, base_env, request):
    """What the queue-depth gauge reads (``workers.metrics.queue_depths``), on each broker:
    0 for a queue nobody declared yet, then the messages waiting, with no consumer."""
    from workers.metrics import queue_depths

    url = base_env["REDIS_URL"] if broker == "redis" else request.getfixturevalue("amqp_url")
    queue = f"poimen-depth-{uuid.uuid4().hex[:8]}"
    app = Celery("depth", set_as_current=False)
    app.config_from_object(celery_settings(url, {"POIMEN_QUEUE": queue}))
    try:
        assert queue_depths(app) == {queue: 0}
        for n in range(3):
            app.send_task("poimen.depth-probe", args=[n])
        wait_until(lambda: queue_depths(app) == {queue: 3}, timeout=20,
                   what=f"three messages counted on {broker}")
    finally:
        if broker == "redis":
            client = redis_lib.Redis.from_url(url)
            client.delete(queue)
            client.close()
        else:
            with Connection(url) as conn:
                conn.default_channel.queue_delete(queue)
        app.close()


# -- RabbitMQ's consumer_timeout ---------------------------------------------------------------


def consumer_arguments(amqp_url: str, queue: str) -> list[str]:
    vhost = unquote(urlsplit(amqp_url).path[1:]) or "/"
    out = subprocess.run(["rabbitmqctl", "-q", "list_consumers", "-p", vhost,
                          "queue_name", "arguments"], capture_output=True, text=True,
                         timeout=60).stdout
    return [line for line in out.splitlines() if line.startswith(queue + "\t")]


@pytest.mark.skipif(not shutil.which("rabbitmqctl"), reason="needs rabbitmqctl on this machine")
def test_the_workers_consumer_asks_for_the_configured_consumer_timeout(amqp_env, amqp_url,
                                                                       queue_name, tmp_path,
                                                                       processes):
    """With acks_late a run holds its message unacked for its whole length; the worker's
    consumer carries ``x-consumer-timeout`` (POIMEN_AMQP_CONSUMER_TIMEOUT, seconds) so
    RabbitMQ (3.12+; see docs/operations/rabbitmq.md for older servers) does not close its channel
    under a run longer than the server's default 30 minutes."""
    if urlsplit(amqp_url).hostname not in ("127.0.0.1", "localhost"):
        pytest.skip("rabbitmqctl only sees a local broker")
    env = {**amqp_env, "POIMEN_AMQP_CONSUMER_TIMEOUT": "7200"}
    processes.append(start_worker(env, tmp_path, "amqp-timeout"))
    lines = wait_until(lambda: consumer_arguments(amqp_url, queue_name), timeout=60,
                       what="the worker's consumer on RabbitMQ")
    assert len(lines) == 1
    assert "x-consumer-timeout" in lines[0] and "7200000" in lines[0], lines[0]


def close_vhost_connections(amqp_url: str) -> int:
    """Close every client connection to this session's vhost, server-side."""
    vhost = unquote(urlsplit(amqp_url).path[1:]) or "/"
    out = subprocess.run(["rabbitmqctl", "-q", "list_connections", "pid", "vhost"],
                         capture_output=True, text=True, timeout=60).stdout
    pids = [line.split("\t")[0] for line in out.splitlines()
            if line.split("\t")[1:2] == [vhost]]
    for pid in pids:
        subprocess.run(["rabbitmqctl", "-q", "close_connection", pid, "poimen test"],
                       capture_output=True, timeout=60)
    return len(pids)


@pytest.mark.skipif(not shutil.which("rabbitmqctl"), reason="needs rabbitmqctl on this machine")
def test_a_run_outlives_its_worker_losing_the_broker_connection(amqp_env, amqp_url, tenant,
                                                                side_effects, pg, tmp_path,
                                                                processes):
    """What a consumer timeout does to a long run, done on purpose: the broker closes the
    worker's connection while the run's message is unacked. The run keeps going and
    finishes once; the message RabbitMQ re-delivers is a duplicate to the claim."""
    if urlsplit(amqp_url).path in ("", "/", "//"):
        pytest.skip("needs a vhost of its own (closing shared connections would hurt others)")
    # A short shutdown grace: were the worker to SIGTERM the run's pool process on the
    # connection loss (Celery's worker_cancel_long_running_tasks_on_connection_loss), the
    # run would be abandoned 2 s later and resumed from the top, and this test would fail.
    env = {**amqp_env, "POIMEN_SHUTDOWN_GRACE": "2"}
    url = start_api(env, tmp_path, processes)
    worker = start_worker(env, tmp_path, "amqp-cut")
    processes.append(worker)
    with Runs(url, tenant.token) as runs:
        run = runs.admit("blind", {"seconds": 8})
    run_id = uuid.UUID(run.id)
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")
    assert close_vhost_connections(amqp_url) >= 1
    wait_until(lambda: run_row(pg, run_id)[0] == "succeeded", timeout=90,
               what="the run to finish after the connection loss")
    assert side_effects(run_id, "start") == 1 and side_effects(run_id, "finish") == 1
    assert run_row(pg, run_id)[1:] == (1, 0)  # attempt 1, never taken over
    assert events_of(pg, run_id) == ["run.admitted", "run.started", "run.succeeded"]
    assert worker.alive()


def test_broker_settings_apply_only_to_their_broker():
    env = {"POIMEN_QUEUE": "q", "POIMEN_VISIBILITY_TIMEOUT": "99"}
    redis_conf = celery_settings("rediss://h:6380/0", env)
    assert redis_conf["broker_transport_options"]["visibility_timeout"] == 99.0
    assert "task_queues" not in redis_conf
    amqp_conf = celery_settings("amqp://guest:guest@h:5672//", env)
    assert amqp_conf["broker_transport_options"] == {"confirm_publish": True}
    (queue,) = amqp_conf["task_queues"]
    assert (queue.name, queue.routing_key, queue.exchange.name) == ("q", "q", "q")
    assert queue.consumer_arguments == {"x-consumer-timeout": 86_400_000}
    off = celery_settings("amqp://h//", {**env, "POIMEN_AMQP_CONSUMER_TIMEOUT": "0"})
    assert off["task_queues"][0].consumer_arguments is None
    assert "broker_transport_options" not in celery_settings("sqs://", env)
    # The settings every broker shares are the same on each.
    for name in ("task_acks_late", "task_reject_on_worker_lost", "task_default_queue"):
        assert redis_conf[name] == amqp_conf[name]


# -- priorities (POIMEN_QUEUE_MAX_PRIORITY) ----------------------------------------------------


def declare_ok(url: str, queue: str, arguments: dict | None) -> bool:
    """Whether RabbitMQ accepts declaring ``queue`` with ``arguments`` (an existing queue
    accepts only its own: a declare with others fails with PRECONDITION_FAILED)."""
    from amqp.exceptions import PreconditionFailed
    from kombu import Exchange, Queue

    with Connection(url) as conn:
        channel = conn.channel()
        try:
            Queue(queue, Exchange(queue, type="direct"), routing_key=queue,
                  queue_arguments=arguments)(channel).declare()
            return True
        except PreconditionFailed:
            return False


def delete_queue(url: str, queue: str) -> None:
    with Connection(url) as conn:
        conn.default_channel.queue_delete(queue)
        conn.default_channel.exchange_delete(queue)


def test_priority_queues_deliver_higher_priority_runs_first(amqp_env, amqp_url, tenant, pg,
                                                           tmp_path, processes):
    """With POIMEN_QUEUE_MAX_PRIORITY the web's sender declares the queue with
    x-max-priority (RabbitMQ then refuses the queue without it); runs queued before any
    worker starts are delivered to a one-process worker highest priority first, whatever
    order they were admitted in."""
    queue = f"poimen-prio-{uuid.uuid4().hex[:8]}"  # a queue of its own: arguments are fixed
    env = {**amqp_env, "POIMEN_QUEUE": queue, "POIMEN_QUEUE_MAX_PRIORITY": "10"}
    try:
        url = start_api(env, tmp_path, processes)
        with Runs(url, tenant.token) as runs:
            routine = [runs.admit("routine", {"i": i}).id for i in range(3)]  # priority 1
            urgent = [runs.admit("urgent", {"i": i}).id for i in range(3)]    # priority 9
        wait_until(lambda: amqp_queue_depth(amqp_url, queue) == 6, timeout=60,
                   what="six messages waiting in RabbitMQ")
        assert declare_ok(amqp_url, queue, {"x-max-priority": 10})
        assert not declare_ok(amqp_url, queue, None), "declared without x-max-priority"

        processes.append(start_worker(env, tmp_path, "amqp-prio"))  # one pool process
        ids = [*routine, *urgent]
        wait_until(lambda: pg.execute(
            "SELECT count(*) FROM runs WHERE id = ANY(%s) AND status = 'succeeded'",
            [ids]).fetchone()[0] == 6, timeout=90, what="the six runs to succeed")
        order = [str(r[0]) for r in pg.execute(
            "SELECT id FROM runs WHERE id = ANY(%s) ORDER BY started_at", [ids])]
        assert order[:3] == sorted(order[:3], key=urgent.index), order
        assert set(order[:3]) == set(urgent) and set(order[3:]) == set(routine), order
    finally:
        delete_queue(amqp_url, queue)


def test_a_worker_refuses_to_start_when_rabbitmq_holds_its_queue_with_other_arguments(
        amqp_env, amqp_url, tmp_path, processes):
    """The queue exists without x-max-priority; a worker asked for priorities stops at once
    with an error that names the queue, the argument and what to do."""
    queue = f"poimen-prio-{uuid.uuid4().hex[:8]}"
    assert declare_ok(amqp_url, queue, None)
    try:
        env = {**amqp_env, "POIMEN_QUEUE": queue, "POIMEN_QUEUE_MAX_PRIORITY": "10"}
        worker = start_worker(env, tmp_path, "amqp-refused")
        processes.append(worker)
        assert worker.proc.wait(60) == 1
        log = worker.log()
        assert "poimen worker refuses to start" in log and repr(queue) in log, log[-3000:]
        assert "x-max-priority" in log and "POIMEN_QUEUE_MAX_PRIORITY" in log, log[-3000:]
        assert declare_ok(amqp_url, queue, None), "the queue is left as it was"
    finally:
        delete_queue(amqp_url, queue)


def test_the_priority_setting_leaves_redis_as_it_is(base_env, fast_env, tenant, pg, tmp_path,
                                                   processes):
    """On Redis POIMEN_QUEUE_MAX_PRIORITY sets nothing (kombu keeps its four priority lists
    whatever the queue's arguments): a worker with it starts and runs prioritized runs."""
    env = {"POIMEN_QUEUE": "q", "POIMEN_QUEUE_MAX_PRIORITY": "10"}
    assert "task_queue_max_priority" not in celery_settings(base_env["REDIS_URL"], env)
    assert celery_settings("amqp://h//", env)["task_queue_max_priority"] == 10
    env = {**fast_env, "POIMEN_QUEUE_MAX_PRIORITY": "10"}
    url = start_api(env, tmp_path, processes)
    processes.append(start_worker(env, tmp_path, "redis-prio"))
    with Runs(url, tenant.token) as runs:
        ids = [runs.admit(ref, {}).id for ref in ("urgent", "routine", "echo")]
        assert [runs.wait(i, timeout=90).status for i in ids] == ["succeeded"] * 3


@pytest.mark.processes  # amqp_url makes the session's vhost with rabbitmqctl
def test_celerys_own_task_queue_max_priority_is_declared_too(amqp_url):
    """Celery's ``task_queue_max_priority``, set after the settings (as a workflow module
    may), gives the worker's queue its x-max-priority as POIMEN_QUEUE_MAX_PRIORITY does."""
    from workers.queues import check_queue_arguments

    queue = f"poimen-prio-{uuid.uuid4().hex[:8]}"
    app = Celery("prio", set_as_current=False)
    app.config_from_object(celery_settings(amqp_url, {"POIMEN_QUEUE": queue}))
    app.conf.task_queue_max_priority = 5
    try:
        check_queue_arguments(app, [app.amqp.queues[queue]])  # what the worker declares
        assert declare_ok(amqp_url, queue, {"x-max-priority": 5})
        assert not declare_ok(amqp_url, queue, None)
    finally:
        delete_queue(amqp_url, queue)
        app.close()
