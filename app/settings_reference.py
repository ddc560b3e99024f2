"""Every environment variable the code reads: the one list, and the configuration reference.

``python -m app.settings_reference`` writes ``docs/operations/configuration.md`` from
``SETTINGS`` (``make docs`` does the same); ``--check`` exits 1 if the committed
file differs. ``tests/deploy/test_configuration_reference.py`` fails when the
code reads a variable this list does not name, and when the document is stale.

This module only describes settings. ``poimenconfig.py`` reads them, for every
process, when the process starts (the framework entry points ``celeryconfig.py``,
``app/gunicorn_conf.py`` and ``logconfig.py`` read their own); each default is one
constant there, and the defaults written here must match them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

WEB, WORKER, BEAT, FLOWER = "web", "worker", "beat", "flower"
INBOX, OUTBOX, RELEASE, CLI, DEV = "inbox", "outbox", "release", "cli", "dev"
CELERY = (WEB, WORKER, BEAT, FLOWER)          # every process that builds the Celery app
APP = (RELEASE, *CELERY, CLI)                 # every process that runs create_app()
ALL = (*APP, INBOX, OUTBOX)

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations" / "configuration.md"


@dataclass(frozen=True)
class Setting:
    name: str
    default: str          # as text; "" when unset means off or required (the meaning says)
    processes: tuple[str, ...]
    meaning: str
    section: str


def _s(section: str):
    def make(name: str, default: str, processes, meaning: str) -> Setting:
        procs = (processes,) if isinstance(processes, str) else tuple(processes)
        return Setting(name, default, procs, meaning, section)
    return make


_core = _s("Services")
_heroku = _s("Heroku add-on variables (translated)")
_proc = _s("Processes and ports")
_db = _s("Database pool")
_celery = _s("Celery and repair")
_kafka = _s("Kafka and topics")
_inbox = _s("Inbox relay")
_outbox = _s("Outbox relay")
_obs = _s("Logs, metrics and the console")
_trace = _s("Tracing and error reporting (optional)")
_dev = _s("Development and tests only")

SETTINGS: tuple[Setting, ...] = (
    # -- services
    _core("DATABASE_URL", "", (*APP, OUTBOX, DEV),
          "Postgres. Heroku's `postgres://` is accepted. Required (the dev tooling starts an "
          "embedded one when unset)."),
    _core("POIMEN_LOCK_DATABASE_URL", "DATABASE_URL", (WORKER, OUTBOX),
          "Direct (never pooled) Postgres for the liveness locks: one permanent connection per "
          "worker pool process and one per outbox relay. Must bypass a transaction-mode pooler; "
          "a worker refuses to start behind one."),
    _core("REDIS_URL", "redis://127.0.0.1:6379/0", (*CELERY, CLI, DEV),
          "Celery broker. `rediss://` uses TLS (see `POIMEN_REDIS_SSL_CERT_REQS`)."),
    _core("CELERY_BROKER_URL", "REDIS_URL", (*CELERY, CLI),
          "Celery broker; wins over `REDIS_URL` when both are set."),
    _core("POIMEN_REDIS_SSL_CERT_REQS", "required", (*CELERY, CLI),
          "For a `rediss://` broker: `required` (verify the server's certificate), `optional` or "
          "`none`. Heroku Data for Redis serves a self-signed certificate: set `none` there "
          "(app.json does). Applied to Celery's `broker_use_ssl` and to redis-py."),
    _core("POIMEN_REDIS_SSL_CA_CERTS", "", (*CELERY, CLI),
          "For a `rediss://` broker: a CA bundle file to verify the server's certificate with."),
    _core("KAFKA_BOOTSTRAP_SERVERS", "KAFKA_URL", (WEB, INBOX, OUTBOX, CLI, DEV),
          "Kafka-protocol brokers, `host:port,...`. Required by the relays (else `KAFKA_URL`); "
          "`web` uses it for the console's dead-letter page only."),
    _core("KAFKA_*", "", (WEB, INBOX, OUTBOX, CLI),
          "Any other `KAFKA_<NAME>` is the librdkafka setting `<name>` with `_` as `.` "
          "(`KAFKA_SECURITY_PROTOCOL=SASL_SSL` -> `security.protocol`); it wins over a "
          "translated Heroku value. Credentials are shown as `***` in logs."),
    # -- Heroku
    _heroku("KAFKA_URL", "", (WEB, INBOX, OUTBOX, CLI),
            "Apache Kafka on Heroku: `kafka+ssl://host:port,...`. Used when "
            "`KAFKA_BOOTSTRAP_SERVERS` is unset: the list becomes `host:port,...` and "
            "`kafka+ssl` sets `security.protocol=SSL`."),
    _heroku("KAFKA_TRUSTED_CERT", "", (WEB, INBOX, OUTBOX, CLI),
            "PEM of the CA that signed the brokers: librdkafka `ssl.ca.pem`. Host names are not "
            "verified against it (`ssl.endpoint.identification.algorithm=none`: Heroku's broker "
            "certificates do not name the hosts); the chain is."),
    _heroku("KAFKA_CLIENT_CERT", "", (WEB, INBOX, OUTBOX, CLI),
            "PEM client certificate: librdkafka `ssl.certificate.pem`."),
    _heroku("KAFKA_CLIENT_CERT_KEY", "", (WEB, INBOX, OUTBOX, CLI),
            "PEM client key: librdkafka `ssl.key.pem`."),
    _heroku("KAFKA_PREFIX", "", (WEB, INBOX, OUTBOX, CLI, DEV),
            "Heroku multi-tenant plans: put in front of every topic name "
            "(`acme.` + `poimen.<tenant>.dispatch`) and consumer group (`acme.poimen-inbox`)."),
    # -- processes
    _proc("PORT", "8000 (web), 5555 (flower)", (WEB, FLOWER, WORKER, BEAT, INBOX, OUTBOX),
          "HTTP port of `web` and `flower`; the metrics port of `worker`, `beat`, `inbox` and "
          "`outbox` "
          "when `METRICS_PORT` is unset (Heroku sets `PORT` on every dyno)."),
    _proc("METRICS_PORT", "worker and beat: off, inbox: 9101, outbox: 9102",
          (WORKER, BEAT, INBOX, OUTBOX),
          "Prometheus (`/metrics`, `/healthz`) port of the process; `0` turns it off. `beat` "
          "alone exports the global gauges (docs/operations/metrics.md)."),
    _proc("WEB_CONCURRENCY", "2", WEB, "gunicorn worker processes (Procfile)."),
    _proc("WEB_THREADS", "4", WEB, "threads per gunicorn worker (Procfile)."),
    _proc("WORKER_CONCURRENCY", "2", WORKER,
          "Celery pool processes (Procfile). Each holds one lock connection to Postgres."),
    _proc("CELERY_BEAT_SCHEDULE", "/tmp/poimen-celerybeat-schedule", BEAT,
          "beat's schedule file (Procfile)."),
    _proc("POIMEN_SHUTDOWN_GRACE", "25", (WEB, WORKER, INBOX, OUTBOX),
          "Seconds a process may take to stop on SIGTERM (Heroku kills at 30): a worker's runs "
          "in flight may finish, then are left to repair; gunicorn's graceful timeout; the "
          "relays finish, flush and commit."),
    _proc("POIMEN_WORKFLOW_MODULES", "", (*CELERY, CLI),
          "Comma list of modules that register workflows (web validates `workflow_ref` with "
          "them, workers run them)."),
    _proc("POIMEN_API_URL", "", INBOX, "Where the inbox POSTs runs (the web process). Required."),
    _proc("POIMEN_API_TOKEN", "", INBOX,
          "The inbox's token: a service token with `--scope admit`. Required."),
    _proc("POIMEN_TOKEN_CACHE_SECONDS", "10", WEB,
          "How long a looked-up token is trusted (a revocation takes up to this long)."),
    _proc("POIMEN_ADMISSION_FAST_PATH", "1", WEB,
          "`1`: a plain `POST /v1/runs` (JSON body, a token this process has cached) is "
          "answered in front of Flask, with the same rules and answers at a third less CPU "
          "(`app/fastpath.py`); `0`: every request through Flask. Off by itself while "
          "OpenTelemetry or Sentry is configured (`SENTRY_DSN`, any `OTEL_EXPORTER_OTLP_*"
          "ENDPOINT`, `OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`), and for any request "
          "a hook, signal receiver or middleware other than Poimen's would see "
          "(`opentelemetry-instrument`, Sentry's Flask integration, an extension's "
          "`before_request`)."),
    _proc("POIMEN_BATCH_MAX", "1000", WEB,
          "The most items one `POST /v1/runs/batch` may carry; more is a 413 "
          "(`batch_too_large`) and nothing is admitted. The body must also fit in 1 MiB."),
    # -- database pool
    _db("POIMEN_DB_PRE_PING", "1", APP,
        "`1`: ping a pooled connection at checkout when the server wrote to its socket "
        "since (a restart cut it) or it sat idle, so a database restart fails no request "
        "on a quiet pool; `0` turns it off."),
    _db("POIMEN_DB_PING_IDLE_SECONDS", "1", APP,
        "A pooled connection idle this long is pinged at checkout; one used more recently "
        "is trusted (no round trip per transaction under load)."),
    _db("POIMEN_DB_POOL_SIZE", "5", APP, "SQLAlchemy pool size per process."),
    _db("POIMEN_DB_MAX_OVERFLOW", "10", APP, "SQLAlchemy connections beyond the pool size."),
    _db("POIMEN_DB_POOL_RECYCLE", "300", APP, "Seconds after which a pooled connection is replaced."),
    # -- celery and repair
    _celery("POIMEN_QUEUE", "poimen", (*CELERY, CLI), "Celery queue name."),
    _celery("POIMEN_VISIBILITY_TIMEOUT", "3600", (*CELERY, CLI),
            "Redis visibility timeout, seconds: an unacknowledged message is redelivered after it."),
    _celery("POIMEN_UNACKED_RESTORE_INTERVAL", "10", (*CELERY, CLI),
            "Seconds between the Redis transport's sweeps for unacknowledged messages."),
    _celery("POIMEN_UNACKED_RESTORE_THROTTLE", "10", (*CELERY, CLI),
            "The sweep runs every interval x throttle seconds."),
    _celery("POIMEN_BROKER_SOCKET_TIMEOUT", "5", (*CELERY, CLI),
            "Redis socket timeouts, seconds: a hung broker fails a send instead of hanging it."),
    _celery("POIMEN_AMQP_CONSUMER_TIMEOUT", "86400", (*CELERY, CLI),
            "RabbitMQ only: seconds a worker's consumer may hold a run's message unacknowledged "
            "(`x-consumer-timeout`, honoured by RabbitMQ 3.12+); must exceed the longest run. "
            "`0`: the server's `consumer_timeout` decides. See docs/operations/rabbitmq.md."),
    _celery("POIMEN_QUEUE_MAX_PRIORITY", "", (*CELERY, CLI),
            "RabbitMQ only: `x-max-priority` (1-255; RabbitMQ advises at most 10) of every queue "
            "Celery declares (the default queue and each workflow's own), so "
            "`@workflow(priority=...)` orders the waiting messages; Celery's "
            "`task_queue_max_priority`, if set, does the same. Unset or `0`: no priorities. Set "
            "it alike in every process: RabbitMQ refuses to re-declare an existing queue with "
            "other arguments (`PRECONDITION_FAILED`; the worker then refuses to start). Redis "
            "ignores it: there priorities are always on, in kombu's four lists (0 first). See "
            "docs/operations/rabbitmq.md."),
    _celery("POIMEN_ACK_PENDING_MAX", "64", WORKER,
            "Redis only: the most acknowledged messages whose removal from the `unacked` hash "
            "a worker defers (to send it with the next delivery's record); the ack that reaches "
            "it sends them all at once. A worker killed in between leaves at most this many "
            "finished messages to the visibility timeout (the claim absorbs them)."),
    _celery("POIMEN_ACK_PENDING_MAX_AGE", "0.005", WORKER,
            "Redis only: seconds a deferred removal from the `unacked` hash may wait for a "
            "delivery to ride with; then the worker sends it, delivery or not."),
    _celery("CELERY_PREFETCH_MULTIPLIER", "1", WORKER,
            "Celery `worker_prefetch_multiplier`."),
    _celery("POIMEN_SEND_SENT_EVENTS", "0", (*CELERY, CLI),
            "`1`: Celery's `task-sent` events (a second Redis publish per admission)."),
    _celery("POIMEN_EVENT_FLUSH_INTERVAL", "0.1", WORKER,
            "Seconds between a worker's publishes of its buffered Celery task events (received, "
            "started, succeeded ...), and at once when 24 are waiting: Flower sees them at most "
            "this late, in order, with their own timestamps. `0`: Celery's own flush at every "
            "turn of the event loop (about one publish per event under load)."),
    _celery("POIMEN_REPAIR_INTERVAL", "10", BEAT,
            "Seconds between beat's repair ticks (a dead worker's run is re-sent on the first "
            "tick after its lock is seen gone, for delivery once the worker is gone: T_c + 1 + 2 "
            "seconds later)."),
    _celery("POIMEN_REPAIR_MIN_AGE", "10", (BEAT, CLI),
            "Seconds after its last send before a queued run may be re-sent."),
    _celery("POIMEN_TAKEOVER_DELAY", "6", (BEAT, CLI),
            "Seconds after which a re-sent run of a dead worker is delivered at the earliest "
            "(beat's repair and `flask runs redrive`), so a worker cut off by a Postgres restart "
            "can adopt its run first. Not part of the lease ordering: a dead worker's runs are "
            "taken over only T_c + 1 + 2 seconds after its lock was first seen free, whatever "
            "delivers them (docs/internals/execution.md)."),
    _celery("POIMEN_MAX_TAKEOVERS", "5", (WORKER, BEAT),
            "How many lost workers (OOM, segfault, kill -9) a run may outlive where its "
            "workflow does not set `max_takeovers`; the takeover after that ends it `poisoned` "
            "(its own status, `run.poisoned` event and `poimen_runs_poisoned_total`). Set the "
            "same in every worker and in beat; `@workflow(max_takeovers=...)` wins."),
    _celery("POIMEN_BOOT_PROBE_INTERVAL", "2", (WORKER, BEAT, OUTBOX),
            "Seconds between a worker's (and the active outbox relay's) checks that Postgres "
            "still holds its liveness lock; each check renews the lease."),
    _celery("POIMEN_LEASE_CLIENT_SECONDS", "10", (WORKER, BEAT, OUTBOX),
            "T_c: a worker process whose runs' lock was not confirmed by a probe started within "
            "this many seconds is killed (SIGKILL from a kernel timer); the outbox relay stops "
            "publishing. Must satisfy T_c + 1 + 2 <= T_s (checked at start); a worker whose lock "
            "goes early (a restart, `pg_terminate_backend`) keeps its runs and concurrency slots "
            "for T_c + 1 + 2 seconds after the server first saw its lock free."),
    _celery("POIMEN_LEASE_SERVER_SECONDS", "20", (WORKER, BEAT, OUTBOX),
            "T_s: Postgres ends a lock session that sent nothing for this many seconds "
            "(`idle_session_timeout` set on the session, PostgreSQL 14+), releasing its lock."),
    _db("POIMEN_DB_PREPARE_THRESHOLD", "auto", (*APP,),
        "psycopg's `prepare_threshold` for the app's pooled connections. `auto`: a worker "
        "prepares statements (threshold 5) when its `DATABASE_URL` is also its lock database, "
        "which it checked keeps a session (no transaction pooler between); every other process, "
        "and a worker with a separate `POIMEN_LOCK_DATABASE_URL`, prepares none. `off`: none "
        "anywhere. A number: that threshold everywhere, only when `DATABASE_URL` is direct or "
        "its pooler keeps prepared statements (PgBouncer >= 1.21 `max_prepared_statements`): "
        "behind a transaction-mode pooler that does not, a statement prepared on one server "
        "connection runs on another."),
    _celery("POIMEN_DB_TCP_USER_TIMEOUT", "10", (*APP,),
            "Seconds unacknowledged data may wait on a pooled TCP connection before it fails "
            "(libpq `tcp_user_timeout`): a statement into a silent path errors instead of "
            "hanging."),
    _celery("POIMEN_RECORD_RETRY_SECONDS", "60", WORKER,
            "How long a worker retries recording a run's outcome while the database is away."),
    _celery("POIMEN_ERROR_TEXT_MAX_BYTES", "8192", WORKER,
            "Bytes of a failure's text a worker stores with the run, its ledger and its events: "
            "the message's first bytes (a cut message is marked `\"error_truncated\": true` "
            "with its size in `error_bytes`) and the traceback's last (each of its lines cut to "
            "1 KiB). At least 256. See docs/guide/events.md."),
    # -- kafka
    _kafka("POIMEN_TOPIC_PREFIX", "poimen", (WEB, INBOX, OUTBOX, CLI, DEV),
           "Topic prefix: `<prefix>.<tenant>.dispatch|dispatch.dlq|events` (after `KAFKA_PREFIX`)."),
    _kafka("POIMEN_TOPIC_REPLICATION", "-1", (CLI, DEV),
           "Replication factor of declared topics; `-1` is the broker's default."),
    # -- inbox
    _inbox("POIMEN_INBOX_GROUP", "poimen-inbox", INBOX, "Consumer group (after `KAFKA_PREFIX`)."),
    _inbox("POIMEN_INBOX_CONCURRENCY", "8", INBOX, "Partitions delivered in parallel."),
    _inbox("POIMEN_INBOX_PARTITION_WINDOW", "1", INBOX,
           "Calls in flight per partition (1: strict order)."),
    _inbox("POIMEN_INBOX_BATCH_MAX", "100", INBOX,
           "Messages of one partition per `POST /v1/runs/batch` (also kept under the API's "
           "1 MiB body; `1`: one message per call)."),
    _inbox("POIMEN_INBOX_BATCH_LINGER_MS", "5", INBOX,
           "Milliseconds a batch that is not full waits from its oldest message for more; "
           "`0`: post what waits at once."),
    _inbox("POIMEN_INBOX_HTTP_TIMEOUT", "15", INBOX, "Seconds to wait for the API's answer."),
    _inbox("POIMEN_INBOX_BACKOFF_INITIAL", "0.5", INBOX, "First retry backoff, seconds."),
    _inbox("POIMEN_INBOX_BACKOFF_MAX", "30", INBOX, "Retry backoff cap, seconds."),
    _inbox("POIMEN_INBOX_MAX_BUFFERED", "1000", INBOX,
           "Fetched messages held per partition before it is paused."),
    _inbox("POIMEN_INBOX_BUFFER_BYTES", "67108864", INBOX,
           "Bytes of fetched messages held across partitions."),
    _inbox("POIMEN_INBOX_METADATA_REFRESH_MS", "2000", INBOX, "How soon new tenant topics are seen."),
    _inbox("POIMEN_INBOX_SESSION_TIMEOUT_MS", "10000", INBOX, "Consumer group session timeout; at least 6000 (brokers refuse shorter)."),
    _inbox("POIMEN_INBOX_DLQ_PARTITIONS", "1", INBOX,
           "Partitions of a dead-letter topic the relay creates."),
    _inbox("POIMEN_INBOX_LAG_INTERVAL", "5", INBOX, "Seconds between lag measurements."),
    _inbox("POIMEN_INBOX_PROGRESS_INTERVAL", "30", INBOX, "Seconds between progress log lines."),
    _inbox("POIMEN_INBOX_TEST_RAISE_ON", "", INBOX,
           "**Test only, never in production**: a message containing this string makes the "
           "relay's own code raise."),
    # -- outbox
    _outbox("POIMEN_OUTBOX_BATCH_SIZE", "1000", OUTBOX, "Rows read and published per batch."),
    _outbox("POIMEN_OUTBOX_POLL_INTERVAL", "0.2", OUTBOX, "Seconds between reads when idle."),
    _outbox("POIMEN_OUTBOX_BATCH_LINGER_MS", "20", OUTBOX,
            "Milliseconds the relay waits after a batch that was not full before it reads "
            "again, so a steady trickle is published in batches; `0`: read again at once."),
    _outbox("POIMEN_OUTBOX_STANDBY_INTERVAL", "1", OUTBOX,
            "Seconds between a standby relay's tries for the lock."),
    _outbox("POIMEN_OUTBOX_LOCK_CHECK_INTERVAL", "1", OUTBOX,
            "Seconds between the active relay's checks that it still holds the lock."),
    _outbox("POIMEN_OUTBOX_TOPIC_PARTITIONS", "4", OUTBOX,
            "Partitions of an events topic the relay creates."),
    _outbox("POIMEN_OUTBOX_RETENTION", "7d", OUTBOX,
            "How long published rows are kept: seconds, or `7d`, `36h`; `never`."),
    _outbox("POIMEN_OUTBOX_PRUNE_INTERVAL", "60", OUTBOX, "Seconds between prunes."),
    _outbox("POIMEN_OUTBOX_PRUNE_BATCH", "1000", OUTBOX, "Rows deleted per prune statement."),
    _outbox("POIMEN_OUTBOX_LAG_INTERVAL", "5", OUTBOX, "Seconds between lag measurements."),
    _outbox("POIMEN_OUTBOX_BACKOFF_MAX", "10", OUTBOX, "Retry backoff cap, seconds."),
    _outbox("POIMEN_OUTBOX_PROGRESS_INTERVAL", "30", OUTBOX, "Seconds between progress log lines."),
    # -- observability
    _obs("LOG_FORMAT", "text", ALL, "`json`: one JSON object per line (tracebacks inside it)."),
    _obs("LOG_LEVEL", "INFO", ALL, "Log level of every process (a name or a number)."),
    _obs("POIMEN_METRICS_TOKEN", "", WEB,
         "Bearer token `web`'s `/metrics` requires; unset, `web` does not serve `/metrics` (404)."),
    _obs("POIMEN_METRICS_CACHE_SECONDS", "5", (BEAT, WEB),
         "How long `beat` reuses the global gauges (runs by status, live boots, outbox lag, "
         "queue depth, the backlog) between scrapes, and a `web` process a tenant's backlog "
         "for the console's Backlog page."),
    _obs("PROMETHEUS_MULTIPROC_DIR", "a private temporary directory", (WEB, WORKER),
         "prometheus_client's multiprocess directory for gunicorn's workers; when set it is "
         "emptied at start. The worker always uses a private one."),
    _obs("POIMEN_GUNICORN_METRICS_DIR", "", WEB,
         "Internal: set by `app/gunicorn_conf.py` to the directory it made; do not set."),
    _obs("POIMEN_CONSOLE_SECRET", "", WEB,
         "Signs the console's session cookie (`/console`); 32 characters or more, the same in "
         "every `web` process. Unset or shorter: the console answers 503 and the API is "
         "unaffected. `make run` keeps one in `.poimen/console-secret`. Changing it signs "
         "everyone out. See docs/guide/console.md."),
    # -- tracing and error reporting (app/telemetry.py)
    _trace("OTEL_EXPORTER_OTLP_ENDPOINT", "", (WEB, WORKER, BEAT),
           "OpenTelemetry collector, OTLP/HTTP base URL (`http://collector:4318`); spans are "
           "POSTed to its `/v1/traces`. Unset: tracing is off and OpenTelemetry is not "
           "imported. Needs the `otel` extra (`pip install 'poimen[otel]'`); without it, one "
           "warning and the process runs on. The SDK's other `OTEL_*` variables (headers, "
           "sampler, resource attributes) apply as the SDK documents them."),
    _trace("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "", (WEB, WORKER, BEAT),
           "The traces endpoint of its own (`http://collector:4318/v1/traces`), used as it "
           "is, ahead of `OTEL_EXPORTER_OTLP_ENDPOINT`'s `/v1/traces`; either one turns "
           "tracing on."),
    _trace("OTEL_TRACES_EXPORTER", "", WEB,
           "The SDK's own (`opentelemetry-instrument`'s exporter); read here only to keep "
           "the admission fast path out: set to anything but `none`, OpenTelemetry is "
           "meant to be on, as with an OTLP endpoint of any signal "
           "(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, ...)."),
    _trace("OTEL_METRICS_EXPORTER", "", WEB,
           "The SDK's own; read like `OTEL_TRACES_EXPORTER` (its `http.server.*` metrics "
           "count only what Flask serves)."),
    _trace("OTEL_SERVICE_NAME", "poimen-web, poimen-worker, poimen-beat", (WEB, WORKER, BEAT),
           "The `service.name` of the process's spans."),
    _trace("SENTRY_DSN", "", (WEB, WORKER, BEAT),
           "Sentry project DSN. Unset: error reporting is off and `sentry_sdk` is not imported. "
           "Needs the `sentry` extra (`pip install 'poimen[sentry]'`). Events are scrubbed: no "
           "run input or result, request body, local variable, exception message, SQL "
           "parameter or token (docs/operations/metrics.md)."),
    _trace("SENTRY_ENVIRONMENT", "", (WEB, WORKER, BEAT),
           "Sentry's `environment` of the events (`production`, `staging`)."),
    _trace("SENTRY_RELEASE", "", (WEB, WORKER, BEAT),
           "Sentry's `release` of the events (e.g. the deployed commit)."),
    # -- dev
    _dev("POIMEN_DEV_DIR", ".poimen", DEV, "Where `poimen-dev` keeps the embedded services' state."),
    _dev("POIMEN_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//", DEV,
         "Tests only: the RabbitMQ `tests/rabbitmq` uses (the default only if its port answers; "
         "otherwise those tests are skipped, loudly)."),
    _dev("POIMEN_CONSOLE_SCREENSHOT", "", DEV,
         "Tests only: where `tests/console` copies its screenshot of a run's page "
         "(`docs/img/console-run.png` refreshes the README's picture)."),
)

PROCESS_NOTES = {
    WEB: "gunicorn `app:create_app()`", WORKER: "celery worker", BEAT: "celery beat",
    FLOWER: "celery flower", INBOX: "python -m bridge.inbox", OUTBOX: "python -m bridge.outbox",
    RELEASE: "flask db upgrade", CLI: "flask --app app ... operator commands",
    DEV: "poimen-dev / make run / make test",
}


def names() -> set[str]:
    """Every documented variable name (``KAFKA_*`` stands for the librdkafka passthrough)."""
    return {s.name for s in SETTINGS}


def render() -> str:
    """Return ``docs/operations/configuration.md``."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m app.settings_reference` (`make docs`) from",
        "     app/settings_reference.py. Edit that file, not this one. -->",
        "",
        "Every environment variable the code reads, the processes that read it, and its",
        "default. Each process reads its settings when it starts (never at import), in one",
        "module, `poimenconfig.py` (plus the framework entry points `celeryconfig.py`,",
        "`app/gunicorn_conf.py` and `logconfig.py`); every other module receives values.",
        "`tests/deploy/test_configuration_reference.py` fails when the code reads a variable",
        "that is not listed here, or when one listed here is no longer read.",
        "",
        "Processes: " + "; ".join(f"`{p}` ({note})" for p, note in PROCESS_NOTES.items()) + ".",
        "",
    ]
    sections: dict[str, list[Setting]] = {}
    for setting in SETTINGS:
        sections.setdefault(setting.section, []).append(setting)
    for section, settings in sections.items():
        lines += [f"## {section}", "", "| variable | default | read by | meaning |",
                  "|---|---|---|---|"]
        for s in settings:
            default = f"`{s.default}`" if s.default else "—"
            lines.append(f"| `{s.name}` | {default} | {', '.join(s.processes)} | {s.meaning} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run `python -m app.settings_reference`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC} ({len(SETTINGS)} variables)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
