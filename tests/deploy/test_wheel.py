"""The server's wheel runs every process from a fresh venv, with no checkout beside it.

What docs/operations/deploy.md ("From the wheel") says, done for real: build the
client's and the server's wheels with the documented commands (from a copy of the
checkout's files: a build writes ``build/`` and ``*.egg-info`` beside them), create
a venv outside the checkout, install both wheels into it (the dependencies at
requirements.txt's pins, from the package index), and run everything from a
directory that holds only the Procfile and ``bin/docker-entrypoint`` -- the image's
``/app`` (the Dockerfile keeps nothing else of the checkout) -- with ``PYTHONPATH``
unset and nothing of the checkout on ``PATH``:

* every module the processes import is the venv's (a child Python says where each
  one was found), and so are the migrations;
* the release step, the Procfile's line run by the entrypoint, migrates an empty
  scratch database, and the wheel's CLI makes a tenant, tokens and topics;
* web, worker, inbox and outbox start through the entrypoint; a run admitted over
  HTTP succeeds, its events reach Kafka through the outbox, and a dispatch message
  becomes a run through the inbox.

The services are the session's real Postgres, Redis and Kafka; the database, the
Celery queue, the topic prefix and the consumer group are this test's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
import venv
from pathlib import Path

import psycopg
import pytest
import requests
from alembic.script import ScriptDirectory
from confluent_kafka import Consumer, Producer, TopicPartition

from poimen_dev.scratch import scratch_database
from tests.processes import ROOT, Process, free_port, wait_until

pytestmark = pytest.mark.slow

# Every top-level name the server's wheel installs, and the packages under them that
# the processes load (bridge.client is the client's, through poimen_client).
MODULES = ("app", "app.state", "app.console", "app.gunicorn_conf", "workers", "bridge",
           "bridge.inbox", "bridge.outbox", "lease", "logconfig", "poimenconfig", "settings_table",
           "celeryconfig", "poimen_client")
WHERE = r'''
import importlib.util, json, sys, sysconfig
import app
found = {name: getattr(importlib.util.find_spec(name), "origin", None) for name in sys.argv[1:]}
print(json.dumps({"site": sysconfig.get_paths()["purelib"], "found": found,
                  "migrations": str(app.migrations_directory())}))
'''


def progress(message: str) -> None:
    print(f"[wheel test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def copy_checkout(dest: Path) -> Path:
    """The checkout's files (tracked, and untracked but not ignored), as a clone has them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def outside_checkout(env: dict[str, str]) -> dict[str, str]:
    """``env`` with nothing that finds the checkout's code or its venv's commands."""
    env = {k: v for k, v in env.items() if k not in (
        "PYTHONPATH", "VIRTUAL_ENV", "POIMEN_WORKFLOW_MODULES", "POIMEN_QUEUE", "DATABASE_URL")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep)
        if p and not Path(p).resolve().is_relative_to(ROOT))
    env["PYTHONNOUSERSITE"] = "1"
    return env


def pins(dest: Path) -> Path:
    """requirements.txt's pins (not its install lines) as a constraints file."""
    lines = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith((".", "#"))]
    dest.write_text("\n".join(lines) + "\n")
    return dest


def read_events(bootstrap: str, topic: str, run_id: str, timeout: float = 60) -> list[dict]:
    """The events of ``run_id`` on ``topic``, read from the start until it succeeded."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "session.timeout.ms": 6000})
    events: list[dict] = []
    try:
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        assert meta.error is None, f"{topic}: {meta.error}"
        consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])

        def succeeded() -> bool:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                event = json.loads(msg.value())
                if event["run_id"] == run_id:
                    assert msg.key().decode().endswith(f":{run_id}"), msg.key()
                    events.append(event)
            return any(e["type"] == "run.succeeded" for e in events)

        wait_until(succeeded, timeout=timeout, interval=0, what=f"run.succeeded on {topic}")
        return events
    finally:
        consumer.close()


@pytest.mark.timeout(1200)
def test_the_wheel_installed_outside_the_checkout_runs_every_process(test_env, base_env,
                                                                    tmp_path):
    assert not tmp_path.resolve().is_relative_to(ROOT)
    env = outside_checkout(test_env)
    started = time.monotonic()

    # -- build and install --------------------------------------------------------------------
    checkout = copy_checkout(tmp_path / "checkout")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    # The processes' working directory, as the image's /app: the Procfile and the
    # entrypoint that runs its lines, nothing else.
    run_dir = tmp_path / "image-app"
    (run_dir / "bin").mkdir(parents=True)
    for name in ("Procfile", "bin/docker-entrypoint"):
        shutil.copy2(checkout / name, run_dir / name)

    def run(*argv: str, cwd: Path = run_dir, timeout: float = 120, **extra: str) -> str:
        proc = subprocess.run(argv, cwd=cwd, env={**env, **extra}, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, (f"{' '.join(argv)}:\n{proc.stdout[-4000:]}"
                                      f"{proc.stderr[-4000:]}")
        return proc.stdout

    wheels = tmp_path / "wheels"
    pip = str(bin_dir / "pip")
    progress("building the client's and the server's wheels")
    run(pip, "wheel", "--no-deps", "-w", str(wheels), "./clients/python", cwd=checkout,
        timeout=300)
    run(pip, "wheel", "--no-deps", "-w", str(wheels), "--config-settings",
        "poimen-environment=dedicated", ".", cwd=checkout, timeout=300)
    built = sorted(p.name for p in wheels.glob("*.whl"))
    assert built == ["poimen-0.1.0-py3-none-any.whl",
                     "poimen_client-0.1.0-py3-none-any.whl"], built
    shutil.rmtree(checkout)  # nothing of the checkout is left to find

    progress("installing both wheels and their dependencies into a fresh venv "
             "(a minute or two)")
    run(pip, "install", "--quiet", "-c", str(pins(tmp_path / "pins.txt")),
        *(str(p) for p in sorted(wheels.glob("*.whl"))), timeout=900)
    run(pip, "check")
    progress(f"installed ({time.monotonic() - started:.0f} s so far)")

    # Every module is the venv's, and so are the migrations.
    where = json.loads(run(str(bin_dir / "python"), "-c", WHERE, *MODULES).strip()
                       .splitlines()[-1])
    site = Path(where["site"])
    assert site.is_relative_to(env_dir), site
    not_installed = {name: origin for name, origin in where["found"].items()
                     if not origin or not Path(origin).is_relative_to(site)}
    assert not not_installed, not_installed
    shipped = Path(where["migrations"])
    assert shipped == site / "app" / "migrations", shipped
    assert ({p.name for p in (shipped / "versions").glob("*.py")}
            == {p.name for p in (ROOT / "migrations" / "versions").glob("*.py")})

    # -- the release step and the operator's CLI, from the venv -------------------------------
    tag = uuid.uuid4().hex[:8]
    with scratch_database(base_env["DATABASE_URL"], "poimen_wheel", base_env,
                          migrate=False) as database_url:
        env.update({
            "DATABASE_URL": database_url,
            "POIMEN_QUEUE": f"poimen-wheel-{tag}",
            "POIMEN_TOPIC_PREFIX": f"wh{tag}",
            "POIMEN_INBOX_GROUP": f"inbox-wheel-{tag}",
            "POIMEN_OUTBOX_POLL_INTERVAL": "0.05",
            "POIMEN_INBOX_METADATA_REFRESH_MS": "1000",
            "WEB_CONCURRENCY": "1",
            "WORKER_CONCURRENCY": "1",
            "POIMEN_CONSOLE_SECRET": uuid.uuid4().hex * 2,
        })
        procs: list[Process] = []
        try:
            _run_the_platform(env, bin_dir, run_dir, tmp_path, procs, run)
        finally:
            for proc in reversed(procs):
                proc.teardown()  # SIGKILL, but a relay stops: it leaves its consumer group
                print(f"--- {proc.name} ---\n{proc.log()[-4000:]}")
    progress(f"done in {time.monotonic() - started:.0f} s")


def _run_the_platform(env, bin_dir: Path, run_dir: Path, log_dir: Path,
                      procs: list[Process], run) -> None:
    def start(name: str, **extra: str) -> Process:
        proc = Process(name, [str(run_dir / "bin" / "docker-entrypoint"), name],
                       {**env, **extra}, log_dir, cwd=run_dir).start()
        procs.append(proc)
        return proc

    progress("release: migrating an empty database with the wheel's migrations")
    release = start("release")
    assert release.proc.wait(120) == 0, release.log()
    flask = str(bin_dir / "flask")
    assert "(head)" in run(flask, "--app", "app", "db", "current")
    with psycopg.connect(env["DATABASE_URL"]) as conn:
        heads = [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")]
    checkout_head = ScriptDirectory(str(ROOT / "migrations")).get_current_head()
    assert heads == [checkout_head], heads

    tenant = f"wheel{env['POIMEN_QUEUE'][-8:]}"
    run(flask, "--app", "app", "tenants", "create", tenant)
    token = run(flask, "--app", "app", "tokens", "create", "--tenant", tenant).split()[-1]
    service = run(flask, "--app", "app", "tokens", "create", "--service", "--scope", "admit",
                  "--label", "inbox").split()[-1]
    assert token.startswith("pmn_") and service.startswith("pmn_")
    declared = run(flask, "--app", "app", "topics", "declare", "--partitions", "1")
    prefix = env["POIMEN_TOPIC_PREFIX"]
    assert f"{prefix}.{tenant}.events\tcreated" in declared, declared

    progress("starting web, worker, outbox and inbox from the venv")
    web_port = free_port()
    api = f"http://127.0.0.1:{web_port}"
    web = start("web", PORT=str(web_port))
    worker = start("worker", METRICS_PORT=str(free_port()))
    relays = {}
    for name, extra in (("outbox", {}),
                        ("inbox", {"POIMEN_API_URL": api, "POIMEN_API_TOKEN": service})):
        port = free_port()
        relays[name] = (start(name, METRICS_PORT=str(port), **extra),
                        f"http://127.0.0.1:{port}/metrics")
        relays[name][0].graceful = True  # a consumer leaves its group

    def answering(proc: Process, url: str) -> bool:
        assert proc.alive(), f"{proc.name} exited:\n{proc.log()[-3000:]}"
        return requests.get(url, timeout=2).ok

    wait_until(lambda: answering(web, f"{api}/readyz"), timeout=60, what="web")
    for proc, url in relays.values():
        wait_until(lambda proc=proc, url=url: answering(proc, url), timeout=60,
                   what=proc.name)
    wait_until(lambda: worker.alive() and "ready" in worker.log(), timeout=60, what="worker")

    # Each process is the venv's program (the entrypoint exec'd it), run in the image's /app.
    for proc in procs[1:]:
        argv = [a.decode() for a in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")]
        program = shutil.which(argv[0], path=env["PATH"]) or argv[0]
        assert Path(program).parent == bin_dir, (proc.name, argv)
        assert Path(f"/proc/{proc.pid}/cwd").resolve() == run_dir.resolve(), proc.name

    # The console's templates and static files are the wheel's.
    sign_in = requests.get(f"{api}/console/sign-in", timeout=10)
    assert sign_in.status_code == 200 and "<form" in sign_in.text, sign_in.text[:500]
    css = requests.get(f"{api}/console/static/console.css", timeout=10)
    assert css.status_code == 200
    assert css.content == (ROOT / "app" / "static" / "console" / "console.css").read_bytes()

    # -- a run over HTTP, its event through the outbox -----------------------------------------
    headers = {"Authorization": f"Bearer {token}"}
    progress("admitting a run over HTTP")
    created = requests.post(f"{api}/v1/runs", headers=headers, timeout=10, json={
        "workflow_ref": "echo", "input": {"from": "the wheel"}, "dispatch_key": "wheel-http"})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    def status(rid: str) -> dict:
        body = requests.get(f"{api}/v1/runs/{rid}", headers=headers, timeout=5).json()
        assert body["status"] in ("queued", "running", "succeeded"), body
        return body

    done = wait_until(lambda: (body := status(run_id))["status"] == "succeeded" and body,
                      timeout=60, what="the run to succeed")
    assert done["result"] == {"from": "the wheel"}
    events = read_events(env["KAFKA_BOOTSTRAP_SERVERS"], f"{prefix}.{tenant}.events", run_id)
    assert [e["type"] for e in events][0] == "run.admitted", events
    assert all(e["tenant"] == tenant for e in events)

    # -- a dispatch message through the inbox ---------------------------------------------------
    progress("publishing a dispatch message for the inbox")
    producer = Producer({"bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"]})
    producer.produce(f"{prefix}.{tenant}.dispatch", key=f"{tenant}:wheel-kafka".encode(),
                     value=json.dumps({"workflow_ref": "echo", "input": {"via": "kafka"},
                                       "dispatch_key": "wheel-kafka"}).encode())
    assert producer.flush(30) == 0

    def admitted_from_kafka() -> dict | None:
        assert relays["inbox"][0].alive(), relays["inbox"][0].log()[-3000:]
        found = requests.get(f"{api}/v1/runs", params={"dispatch_key": "wheel-kafka"},
                             headers=headers, timeout=5).json()["runs"]
        return found and status(found[0]["id"])["status"] == "succeeded" and found[0]

    kafka_run = wait_until(admitted_from_kafka, timeout=90, what="the inbox's run to succeed")
    assert status(kafka_run["id"])["result"] == {"via": "kafka"}
