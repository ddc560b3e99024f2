"""The whole platform from the Procfile's own command lines, for the operations tests."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from confluent_kafka import Producer

from bridge.topics import declare_topics
from tests import kafka_topics
from tests.processes import Process, free_port, start_procfile_process, wait_until

METRICS_TOKEN = "ops-metrics-token"


@dataclass
class Platform:
    """web, worker, beat, inbox and outbox as deployed; ports and names of this test's world."""

    env: dict[str, str]
    log_dir: Path
    tenant: str
    prefix: str
    procs: dict[str, Process] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    creds: Any = None  # the tenant's TenantCreds (tests/conftest.py)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.ports['web']}"

    def metrics_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}/metrics"

    def start(self, name: str, **env: str) -> Process:
        port = free_port()
        self.ports[name] = port
        variable = "PORT" if name == "web" else "METRICS_PORT"
        proc = start_procfile_process(name, {**self.env, variable: str(port), **env},
                                      self.log_dir)
        self.procs[name] = proc
        return proc

    def wait_ready(self) -> None:
        """Wait until every started process answers (web) or says it is ready."""
        def up(name: str):
            def check() -> bool:
                proc = self.procs[name]
                assert proc.alive(), f"{name} exited:\n{proc.log()[-3000:]}"
                if name == "web":
                    return requests.get(f"{self.api}/readyz", timeout=2).ok
                if name == "worker" and self.env.get("LOG_LEVEL", "INFO") in ("INFO", "DEBUG"):
                    return "ready" in proc.log()  # consuming, not only started
                return requests.get(f"http://127.0.0.1:{self.ports[name]}/healthz",
                                    timeout=2).ok
            return check

        for name in self.procs:
            wait_until(up(name), timeout=90, what=f"{name} to be up")

    def publish(self, *values: dict | bytes) -> None:
        declare_topics(self.env["KAFKA_BOOTSTRAP_SERVERS"], self.prefix, [self.tenant], 1)
        producer = Producer({"bootstrap.servers": self.env["KAFKA_BOOTSTRAP_SERVERS"]})
        for value in values:
            raw = json.dumps(value).encode() if isinstance(value, dict) else value
            producer.produce(f"{self.prefix}.{self.tenant}.dispatch", raw)
        assert producer.flush(30) == 0, "the broker did not acknowledge the messages"

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        kafka_topics.delete_under(self.env["KAFKA_BOOTSTRAP_SERVERS"], self.prefix)


def platform_env(test_env: dict[str, str], service_token: str, tmp_path: Path,
                 **extra: str) -> tuple[dict[str, str], str]:
    tag = uuid.uuid4().hex[:8]
    prefix = f"ops{tag}"
    env = {
        **test_env,
        "WEB_CONCURRENCY": "2", "WEB_THREADS": "4", "WORKER_CONCURRENCY": "2",
        "POIMEN_METRICS_TOKEN": METRICS_TOKEN,
        "POIMEN_API_TOKEN": service_token,
        "POIMEN_TOPIC_PREFIX": prefix,
        "POIMEN_INBOX_GROUP": f"ops-inbox-{tag}",
        "POIMEN_INBOX_METADATA_REFRESH_MS": "1000",
        "POIMEN_OUTBOX_POLL_INTERVAL": "0.1",
        "POIMEN_REPAIR_INTERVAL": "1",
        "CELERY_BEAT_SCHEDULE": str(tmp_path / "beat-schedule"),
        **extra,
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env, prefix


def start_platform(test_env: dict[str, str], make_tenant, tmp_path: Path,
                   **extra: str) -> Platform:
    """Start web (gunicorn, 2 workers), worker, beat, inbox and outbox from the Procfile."""
    service = make_tenant(service=True)
    tenant = make_tenant()
    env, prefix = platform_env(test_env, service.token, tmp_path, **extra)
    platform = Platform(env, tmp_path, tenant.name, prefix, creds=tenant)
    try:
        platform.start("web")
        platform.env["POIMEN_API_URL"] = platform.api
        for name in ("worker", "beat", "inbox", "outbox"):
            platform.start(name)
        platform.wait_ready()
    except BaseException:
        platform.stop()
        raise
    return platform
