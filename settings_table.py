"""Every environment variable Poimen reads, each written once: name, type, default, meaning.

``SETTINGS`` is the table. ``poimenconfig.py`` takes each default and each value's
parsing from it (``get_str``, ``get_int``, ``get_float``, ``raw``; ``default_*`` for a
dataclass field), and so do the framework entry points ``celeryconfig.py`` and
``logconfig.py``; ``app/settings_reference.py`` writes ``docs/operations/configuration.md``
from it. ``tests/deploy/test_configuration_reference.py`` fails when the code reads a
variable the table does not hold, when an entry is read nowhere, and when a read writes
a default of its own instead of the table's.

Standard library only, and it reads nothing: every accessor takes the environment
(``env``) its caller read, so every process (the relays included) may import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

WEB, WORKER, BEAT, FLOWER = "web", "worker", "beat", "flower"
INBOX, OUTBOX, RELEASE, CLI, DEV = "inbox", "outbox", "release", "cli", "dev"
CELERY = (WEB, WORKER, BEAT, FLOWER)          # every process that builds the Celery app
APP = (RELEASE, *CELERY, CLI)                 # every process that runs create_app()
ALL = (*APP, INBOX, OUTBOX)

PROCESS_NOTES: Final[dict[str, str]] = {
    WEB: "gunicorn `app:create_app()`", WORKER: "celery worker", BEAT: "celery beat",
    FLOWER: "celery flower", INBOX: "python -m bridge.inbox", OUTBOX: "python -m bridge.outbox",
    RELEASE: "flask db upgrade", CLI: "flask --app app ... operator commands",
    DEV: "poimen-dev / make run / make test",
}

# The relays' metrics ports when neither METRICS_PORT nor PORT is set.
INBOX_METRICS_PORT: Final = 9101
OUTBOX_METRICS_PORT: Final = 9102

Kind = type[str] | type[int] | type[float]
Value = str | int | float
KIND_NAMES: Final[dict[Kind, str]] = {str: "text", int: "integer", float: "number"}


@dataclass(frozen=True)
class Setting:
    """One environment variable: how a value set is parsed (``kind``), what applies when it is
    unset (``default``; None: nothing, which means off or required as ``doc`` says), which
    processes read it, and its documentation."""

    name: str
    kind: Kind
    default: Value | None
    processes: tuple[str, ...]
    doc: str
    section: str
    # The default as the reference states it where it is not one value (per process, another
    # variable's); None: the default itself.
    shown: str | None = None

    def parse(self, raw: str) -> Value:
        """``raw`` as ``kind`` (``int('x')``'s own ValueError for a bad value)."""
        return self.kind(raw)

    @property
    def default_text(self) -> str:
        """The default as the reference shows it ("" when there is none)."""
        if self.shown is not None:
            return self.shown
        if self.default is None:
            return ""
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


class _Section:
    """Makes the entries of one section of the reference."""

    def __init__(self, title: str) -> None:
        self.title = title

    def __call__(self, name: str, kind: Kind, default: Value | None,
                 processes: str | tuple[str, ...], doc: str, shown: str | None = None) -> Setting:
        procs = (processes,) if isinstance(processes, str) else tuple(processes)
        if default is not None and type(default) is not kind:
            raise TypeError(f"{name}: default {default!r} is not a {kind.__name__}")
        return Setting(name, kind, default, procs, doc, self.title, shown)


_core = _Section("Services")
_heroku = _Section("Heroku add-on variables (translated)")
_proc = _Section("Processes and ports")
_db = _Section("Database pool")
_celery = _Section("Celery and repair")
_kafka = _Section("Kafka and topics")
_inbox = _Section("Inbox relay")
_outbox = _Section("Outbox relay")
_obs = _Section("Logs, metrics and the console")
_trace = _Section("Tracing and error reporting (optional)")
_dev = _Section("Development and tests only")

SETTINGS: tuple[Setting, ...] = (
    # -- services
    _core("DATABASE_URL", str, None, (*APP, OUTBOX, DEV),
          "Postgres. Heroku's `postgres://` is accepted. Required (the dev tooling starts an "
          "embedded one when unset)."),
    _core("POIMEN_LOCK_DATABASE_URL", str, None, (WORKER, OUTBOX),
          "Direct (never pooled) Postgres for the liveness locks: one permanent connection per "
          "worker pool process and one per outbox relay. Must bypass a transaction-mode pooler; "
          "a worker refuses to start behind one.",
          shown="DATABASE_URL"),
    _core("REDIS_URL", str, "redis://127.0.0.1:6379/0", (*CELERY, CLI, DEV),
          "Celery broker. `rediss://` uses TLS (see `POIMEN_REDIS_SSL_CERT_REQS`)."),
    _core("CELERY_BROKER_URL", str, None, (*CELERY, CLI),
          "Celery broker; wins over `REDIS_URL` when both are set.",
          shown="REDIS_URL"),
    _core("POIMEN_REDIS_SSL_CERT_REQS", str, "required", (*CELERY, CLI),
          "For a `rediss://` broker: `required` (verify the server's certificate), `optional` or "
          "`none`. Heroku Data for Redis serves a self-signed certificate: set `none` there "
          "(app.json does). Applied to Celery's `broker_use_ssl` and to redis-py."),
    _core("POIMEN_REDIS_SSL_CA_CERTS", str, None, (*CELERY, CLI),
          "For a `rediss://` broker: a CA bundle file to verify the server's certificate with."),
    _core("KAFKA_BOOTSTRAP_SERVERS", str, None, (WEB, INBOX, OUTBOX, CLI, DEV),
          "Kafka-protocol brokers, `host:port,...`. Required by the relays (else `KAFKA_URL`); "
          "`web` uses it for the console's dead-letter page only.",
          shown="KAFKA_URL"),
    _core("KAFKA_*", str, None, (WEB, INBOX, OUTBOX, CLI),
          "Any other `KAFKA_<NAME>` is the librdkafka setting `<name>` with `_` as `.` "
          "(`KAFKA_SECURITY_PROTOCOL=SASL_SSL` -> `security.protocol`); it wins over a "
          "translated Heroku value. Credentials are shown as `***` in logs."),
    # -- Heroku
    _heroku("KAFKA_URL", str, None, (WEB, INBOX, OUTBOX, CLI),
            "Apache Kafka on Heroku: `kafka+ssl://host:port,...`. Used when "
            "`KAFKA_BOOTSTRAP_SERVERS` is unset: the list becomes `host:port,...` and "
            "`kafka+ssl` sets `security.protocol=SSL`."),
    _heroku("KAFKA_TRUSTED_CERT", str, None, (WEB, INBOX, OUTBOX, CLI),
            "PEM of the CA that signed the brokers: librdkafka `ssl.ca.pem`. Host names are not "
            "verified against it (`ssl.endpoint.identification.algorithm=none`: Heroku's broker "
            "certificates do not name the hosts); the chain is."),
    _heroku("KAFKA_CLIENT_CERT", str, None, (WEB, INBOX, OUTBOX, CLI),
            "PEM client certificate: librdkafka `ssl.certificate.pem`."),
    _heroku("KAFKA_CLIENT_CERT_KEY", str, None, (WEB, INBOX, OUTBOX, CLI),
            "PEM client key: librdkafka `ssl.key.pem`."),
    _heroku("KAFKA_PREFIX", str, None, (WEB, INBOX, OUTBOX, CLI, DEV),
            "Heroku multi-tenant plans: put in front of every topic name "
            "(`acme.` + `poimen.<tenant>.dispatch`) and consumer group (`acme.poimen-inbox`)."),
    # -- processes
    _proc("PORT", int, None, (WEB, FLOWER, WORKER, BEAT, INBOX, OUTBOX),
          "HTTP port of `web` and `flower`; the metrics port of `worker`, `beat`, `inbox` and "
          "`outbox` "
          "when `METRICS_PORT` is unset (Heroku sets `PORT` on every dyno).",
          shown="8000 (web), 5555 (flower)"),
    _proc("METRICS_PORT", int, None,
          (WORKER, BEAT, INBOX, OUTBOX),
          "Prometheus (`/metrics`, `/healthz`) port of the process; `0` turns it off. `beat` "
          "alone exports the global gauges (docs/operations/metrics.md).",
          shown=f"worker and beat: off, inbox: {INBOX_METRICS_PORT}, outbox: {OUTBOX_METRICS_PORT}"),
    _proc("WEB_CONCURRENCY", int, 2, WEB, "gunicorn worker processes (Procfile)."),
    _proc("POIMEN_WEB_PROCESS", str, None, WEB,
          "set to `1` by `app/gunicorn_conf.py` in `web`'s processes (never by hand): their "
          "database pool is `WEB_DB_CONNECTIONS`."),
    _proc("WEB_DB_CONNECTIONS", int, 4, WEB,
          "database connections one gunicorn worker's pool holds at most (its pool size; no "
          "overflow; `POIMEN_DB_POOL_SIZE` and `POIMEN_DB_MAX_OVERFLOW` are the other "
          "processes'). Its threads beyond them wait for one, or wait on a run (`?wait=`), "
          "which holds none."),
    _proc("WEB_THREADS", int, 128, WEB,
          "threads per gunicorn worker (Procfile). A request waiting on a run "
          "(`GET /v1/runs/<id>?wait=`) takes one, and no database connection; "
          "`POIMEN_WAIT_MAX` of them at most, so the rest stay for admissions."),
    _proc("WORKER_CONCURRENCY", int, 2, WORKER,
          "Celery pool processes (Procfile). Each holds one lock connection to Postgres. "
          "Under `POIMEN_WORKER_MODE=batch`: the process's threads, runs in flight at once "
          "(16 is a good start for I/O-bound bodies)."),
    _proc("POIMEN_WORKER_MODE", str, "prefork", WORKER,
          "`prefork` (Celery's prefork pool: a process per run in flight) or `batch` "
          "(Celery's threads pool, one process whose runs' claims and finishes are sent "
          "many at once, a claim batch and a finish batch taken together in one commit: "
          "docs/internals/batching.md). A batch worker refuses to start while a workflow "
          "sets a hard time limit."),
    _proc("POIMEN_WORKER_BATCH_WINDOW_MS", float, 2.0, WORKER,
          "`batch` mode: how long the store batcher waits for more claims or finishes "
          "after the first arrives, before it sends them."),
    _proc("POIMEN_WORKER_BATCH_LINGER_MS", float, 5.0, WORKER,
          "`batch` mode, under load: once every run in flight waits on the store batcher, how "
          "long (from the first request) it may still wait for the runs the worker is "
          "about to start, while the rate requests arrive at says one is due in that time "
          "and some thread of the pool is free. Larger batches cost less CPU per run "
          "(docs/internals/batching.md); at a low rate it never waits. 0: off."),
    _proc("POIMEN_WORKER_BATCH_MAX", int, 64, WORKER,
          "`batch` mode: the most claims (or finishes) one statement carries."),
    _proc("CELERY_BEAT_SCHEDULE", str, "/tmp/poimen-celerybeat-schedule", BEAT,
          "beat's schedule file (Procfile)."),
    _proc("POIMEN_SHUTDOWN_GRACE", float, 25.0, (WEB, WORKER, INBOX, OUTBOX),
          "Seconds a process may take to stop on SIGTERM (Heroku kills at 30): a worker's runs "
          "in flight may finish, then are left to repair; gunicorn's graceful timeout; the "
          "relays finish, flush and commit."),
    _proc("POIMEN_WORKFLOW_MODULES", str, None, (*CELERY, CLI),
          "Comma list of modules that register workflows (web validates `workflow_ref` with "
          "them, workers run them)."),
    _proc("POIMEN_API_URL", str, None, INBOX, "Where the inbox POSTs runs (the web process). Required."),
    _proc("POIMEN_API_TOKEN", str, None, INBOX,
          "The inbox's token: a service token with `--scope admit`. Required."),
    _proc("POIMEN_TOKEN_CACHE_SECONDS", float, 10.0, WEB,
          "How long a looked-up token is trusted (a revocation takes up to this long)."),
    _proc("POIMEN_ADMISSION_FAST_PATH", str, "1", WEB,
          "`1`: a plain `POST /v1/runs` (JSON body, a token this process has cached) is "
          "answered in front of Flask, with the same rules and answers at a third less CPU "
          "(`app/fastpath.py`); `0`: every request through Flask. Off by itself while "
          "OpenTelemetry or Sentry is configured (`SENTRY_DSN`, any `OTEL_EXPORTER_OTLP_*"
          "ENDPOINT`, `OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`), and for any request "
          "a hook, signal receiver or middleware other than Poimen's would see "
          "(`opentelemetry-instrument`, Sentry's Flask integration, an extension's "
          "`before_request`)."),
    _proc("POIMEN_WAIT_MAX", int, 120, WEB,
          "Requests one gunicorn worker lets wait on a run at once (`?wait=`); one more "
          "answers at once with the run as it is and `Poimen-Wait: full`. Keep it below "
          "`WEB_THREADS`: the threads left over serve admissions."),
    _proc("POIMEN_WAIT_MAX_SECONDS", float, 60.0, WEB,
          "The longest `?wait=` a request may ask for."),
    _proc("POIMEN_WAIT_POLL_SECONDS", float, 0.05, WEB,
          "How often a gunicorn worker reads whether its waited runs ended (one statement "
          "for all of them, only while one waits): the most an answer lags a run's end, "
          "besides the read."),
    _proc("POIMEN_BATCH_MAX", int, 1000, WEB,
          "The most items one `POST /v1/runs/batch` may carry; more is a 413 "
          "(`batch_too_large`) and nothing is admitted. The body must also fit in 1 MiB."),
    # -- database pool
    _db("POIMEN_DB_PRE_PING", str, "1", APP,
        "`1`: ping a pooled connection at checkout when the server wrote to its socket "
        "since (a restart cut it) or it sat idle, so a database restart fails no request "
        "on a quiet pool; `0` turns it off."),
    _db("POIMEN_DB_PING_IDLE_SECONDS", float, 1.0, APP,
        "A pooled connection idle this long is pinged at checkout; one used more recently "
        "is trusted (no round trip per transaction under load)."),
    _db("POIMEN_DB_POOL_SIZE", int, 5, APP, "SQLAlchemy pool size per process."),
    _db("POIMEN_DB_MAX_OVERFLOW", int, 10, APP, "SQLAlchemy connections beyond the pool size."),
    _db("POIMEN_DB_POOL_RECYCLE", int, 300, APP, "Seconds after which a pooled connection is replaced."),
    # -- celery and repair
    _celery("POIMEN_QUEUE", str, "poimen", (*CELERY, CLI), "Celery queue name."),
    _celery("POIMEN_VISIBILITY_TIMEOUT", float, 3600.0, (*CELERY, CLI),
            "Redis visibility timeout, seconds: an unacknowledged message is redelivered after it."),
    _celery("POIMEN_UNACKED_RESTORE_INTERVAL", int, 10, (*CELERY, CLI),
            "Seconds between the Redis transport's sweeps for unacknowledged messages."),
    _celery("POIMEN_UNACKED_RESTORE_THROTTLE", int, 10, (*CELERY, CLI),
            "The sweep runs every interval x throttle seconds."),
    _celery("POIMEN_BROKER_SOCKET_TIMEOUT", float, 5.0, (*CELERY, CLI),
            "Redis socket timeouts, seconds: a hung broker fails a send instead of hanging it."),
    _celery("POIMEN_AMQP_CONSUMER_TIMEOUT", str, "86400", (*CELERY, CLI),
            "RabbitMQ only: seconds a worker's consumer may hold a run's message unacknowledged "
            "(`x-consumer-timeout`, honoured by RabbitMQ 3.12+); must exceed the longest run. "
            "`0`: the server's `consumer_timeout` decides. See docs/operations/rabbitmq.md."),
    _celery("POIMEN_QUEUE_MAX_PRIORITY", str, None, (*CELERY, CLI),
            "RabbitMQ only: `x-max-priority` (1-255; RabbitMQ advises at most 10) of every queue "
            "Celery declares (the default queue and each workflow's own), so "
            "`@workflow(priority=...)` orders the waiting messages; Celery's "
            "`task_queue_max_priority`, if set, does the same. Unset or `0`: no priorities. Set "
            "it alike in every process: RabbitMQ refuses to re-declare an existing queue with "
            "other arguments (`PRECONDITION_FAILED`; the worker then refuses to start). Redis "
            "ignores it: there priorities are always on, in kombu's four lists (0 first). See "
            "docs/operations/rabbitmq.md."),
    _celery("POIMEN_ACK_PENDING_MAX", int, 64, WORKER,
            "Redis only: the most acknowledged messages whose removal from the `unacked` hash "
            "a worker defers (to send it with the next delivery's record); the ack that reaches "
            "it sends them all at once. A worker killed in between leaves at most this many "
            "finished messages to the visibility timeout (the claim absorbs them)."),
    _celery("POIMEN_ACK_PENDING_MAX_AGE", float, 0.005, WORKER,
            "Redis only: seconds a deferred removal from the `unacked` hash may wait for a "
            "delivery to ride with; then the worker sends it, delivery or not."),
    _celery("POIMEN_DELIVERY_FETCH_MAX", int, 64, WORKER,
            "Redis only: after kombu's BRPOP delivers a message, a worker fetches up to this "
            "many more in one round trip (fewer if its prefetch has less room), each recorded in "
            "the `unacked` hash in the same atomic step as its pop. `0`: one message per BRPOP, "
            "as kombu does."),
    _celery("CELERY_PREFETCH_MULTIPLIER", int, 1, WORKER,
            "Celery `worker_prefetch_multiplier`."),
    _celery("POIMEN_SEND_SENT_EVENTS", str, "0", (*CELERY, CLI),
            "`1`: Celery's `task-sent` events (a second Redis publish per admission)."),
    _celery("POIMEN_EVENT_FLUSH_INTERVAL", float, 0.1, WORKER,
            "Seconds between a worker's publishes of its buffered Celery task events (received, "
            "started, succeeded ...), and at once when 24 are waiting: Flower sees them at most "
            "this late, in order, with their own timestamps. `0`: Celery's own flush at every "
            "turn of the event loop (about one publish per event under load)."),
    _celery("POIMEN_REPAIR_INTERVAL", float, 10.0, BEAT,
            "Seconds between beat's repair ticks (a dead worker's run is re-sent on the first "
            "tick after its lock is seen gone, for delivery once the worker is gone: T_c + 1 + 2 "
            "seconds later)."),
    _celery("POIMEN_RELEASE_INTERVAL", float, 1.0, BEAT,
            "Seconds between beat's timer ticks: delayed runs now due are sent, and runs "
            "never started whose expires_at passed end expired. Between ticks the timer "
            "sleeps only until the next delayed run or reserved rate-limited start is due, "
            "and sends it then."),
    _celery("POIMEN_RELEASE_PAGE", int, 1000, BEAT,
            "Runs one statement of a timer tick sends or expires at most (a full page is "
            "followed at once by the next, up to 20 per tick)."),
    _celery("POIMEN_REPAIR_MIN_AGE", float, 10.0, (BEAT, CLI),
            "Seconds after its last send before a queued run may be re-sent."),
    _celery("POIMEN_TAKEOVER_DELAY", float, 6.0, (BEAT, CLI),
            "Seconds after which a re-sent run of a dead worker is delivered at the earliest "
            "(beat's repair and `flask runs redrive`), so a worker cut off by a Postgres restart "
            "can adopt its run first. Not part of the lease ordering: a dead worker's runs are "
            "taken over only T_c + 1 + 2 seconds after its lock was first seen free, whatever "
            "delivers them (docs/internals/execution.md)."),
    _celery("POIMEN_MAX_TAKEOVERS", int, 5, (WORKER, BEAT),
            "How many lost workers (OOM, segfault, kill -9) a run may outlive where its "
            "workflow does not set `max_takeovers`; the takeover after that ends it `poisoned` "
            "(its own status, `run.poisoned` event and `poimen_runs_poisoned_total`). Set the "
            "same in every worker and in beat; `@workflow(max_takeovers=...)` wins."),
    _celery("POIMEN_BOOT_PROBE_INTERVAL", float, 2.0, (WORKER, BEAT, OUTBOX),
            "Seconds between a worker's (and the active outbox relay's) checks that Postgres "
            "still holds its liveness lock; each check renews the lease."),
    _celery("POIMEN_LEASE_CLIENT_SECONDS", float, 10.0, (WORKER, BEAT, OUTBOX),
            "T_c: a worker process whose runs' lock was not confirmed by a probe started within "
            "this many seconds is killed (SIGKILL from a kernel timer); the outbox relay stops "
            "publishing. Must satisfy T_c + 1 + 2 <= T_s (checked at start); a worker whose lock "
            "goes early (a restart, `pg_terminate_backend`) keeps its runs and concurrency slots "
            "for T_c + 1 + 2 seconds after the server first saw its lock free."),
    _celery("POIMEN_LEASE_SERVER_SECONDS", float, 20.0, (WORKER, BEAT, OUTBOX),
            "T_s: Postgres ends a lock session that sent nothing for this many seconds "
            "(`idle_session_timeout` set on the session, PostgreSQL 14+), releasing its lock."),
    _db("POIMEN_DB_PREPARE_THRESHOLD", str, "auto", (*APP,),
        "psycopg's `prepare_threshold` for the app's pooled connections. `auto`: a worker "
        "prepares statements (threshold 5) when its `DATABASE_URL` is also its lock database, "
        "which it checked keeps a session (no transaction pooler between); every other process, "
        "and a worker with a separate `POIMEN_LOCK_DATABASE_URL`, prepares none. `off`: none "
        "anywhere. A number: that threshold everywhere, only when `DATABASE_URL` is direct or "
        "its pooler keeps prepared statements (PgBouncer >= 1.21 `max_prepared_statements`): "
        "behind a transaction-mode pooler that does not, a statement prepared on one server "
        "connection runs on another."),
    _celery("POIMEN_DB_TCP_USER_TIMEOUT", float, 10.0, (*APP,),
            "Seconds unacknowledged data may wait on a pooled TCP connection before it fails "
            "(libpq `tcp_user_timeout`): a statement into a silent path errors instead of "
            "hanging."),
    _celery("POIMEN_RECORD_RETRY_SECONDS", float, 60.0, WORKER,
            "How long a worker retries recording a run's outcome while the database is away."),
    _celery("POIMEN_ERROR_TEXT_MAX_BYTES", int, 8192, WORKER,
            "Bytes of a failure's text a worker stores with the run, its ledger and its events: "
            "the message's first bytes (a cut message is marked `\"error_truncated\": true` "
            "with its size in `error_bytes`) and the traceback's last (each of its lines cut to "
            "1 KiB). At least 256. See docs/guide/events.md."),
    # -- kafka
    _kafka("POIMEN_TOPIC_PREFIX", str, "poimen", (WEB, INBOX, OUTBOX, CLI, DEV),
           "Topic prefix: `<prefix>.<tenant>.dispatch|dispatch.dlq|events` (after `KAFKA_PREFIX`)."),
    _kafka("POIMEN_TOPIC_REPLICATION", int, -1, (CLI, DEV),
           "Replication factor of declared topics; `-1` is the broker's default."),
    # -- inbox
    _inbox("POIMEN_INBOX_GROUP", str, "poimen-inbox", INBOX, "Consumer group (after `KAFKA_PREFIX`)."),
    _inbox("POIMEN_INBOX_CONCURRENCY", int, 8, INBOX, "Partitions delivered in parallel."),
    _inbox("POIMEN_INBOX_PARTITION_WINDOW", int, 1, INBOX,
           "Calls in flight per partition (1: strict order)."),
    _inbox("POIMEN_INBOX_BATCH_MAX", int, 100, INBOX,
           "Messages of one partition per `POST /v1/runs/batch` (also kept under the API's "
           "1 MiB body; `1`: one message per call)."),
    _inbox("POIMEN_INBOX_BATCH_LINGER_MS", float, 5.0, INBOX,
           "Milliseconds a batch that is not full waits from its oldest message for more; "
           "`0`: post what waits at once."),
    _inbox("POIMEN_INBOX_HTTP_TIMEOUT", float, 15.0, INBOX, "Seconds to wait for the API's answer."),
    _inbox("POIMEN_INBOX_BACKOFF_INITIAL", float, 0.5, INBOX, "First retry backoff, seconds."),
    _inbox("POIMEN_INBOX_BACKOFF_MAX", float, 30.0, INBOX, "Retry backoff cap, seconds."),
    _inbox("POIMEN_INBOX_MAX_BUFFERED", int, 1000, INBOX,
           "Fetched messages held per partition before it is paused."),
    _inbox("POIMEN_INBOX_BUFFER_BYTES", int, 64 * 1024 * 1024, INBOX,
           "Bytes of fetched messages held across partitions."),
    _inbox("POIMEN_INBOX_METADATA_REFRESH_MS", int, 2000, INBOX, "How soon new tenant topics are seen."),
    _inbox("POIMEN_INBOX_SESSION_TIMEOUT_MS", int, 10000, INBOX, "Consumer group session timeout; at least 6000 (brokers refuse shorter)."),
    _inbox("POIMEN_INBOX_DLQ_PARTITIONS", int, 1, INBOX,
           "Partitions of a dead-letter topic the relay creates."),
    _inbox("POIMEN_INBOX_LAG_INTERVAL", float, 5.0, INBOX, "Seconds between lag measurements."),
    _inbox("POIMEN_INBOX_PROGRESS_INTERVAL", float, 30.0, INBOX, "Seconds between progress log lines."),
    _inbox("POIMEN_INBOX_TEST_RAISE_ON", str, None, INBOX,
           "**Test only, never in production**: a message containing this string makes the "
           "relay's own code raise."),
    # -- outbox
    _outbox("POIMEN_OUTBOX_BATCH_SIZE", int, 1000, OUTBOX, "Rows read and published per batch."),
    _outbox("POIMEN_OUTBOX_POLL_INTERVAL", float, 0.2, OUTBOX, "Seconds between reads when idle."),
    _outbox("POIMEN_OUTBOX_BATCH_LINGER_MS", float, 20.0, OUTBOX,
            "Milliseconds the relay waits after a batch that was not full before it reads "
            "again, so a steady trickle is published in batches; `0`: read again at once."),
    _outbox("POIMEN_OUTBOX_STANDBY_INTERVAL", float, 1.0, OUTBOX,
            "Seconds between a standby relay's tries for the lock."),
    _outbox("POIMEN_OUTBOX_LOCK_CHECK_INTERVAL", float, 1.0, OUTBOX,
            "Seconds between the active relay's checks that it still holds the lock."),
    _outbox("POIMEN_OUTBOX_TOPIC_PARTITIONS", int, 4, OUTBOX,
            "Partitions of an events topic the relay creates."),
    _outbox("POIMEN_OUTBOX_RETENTION", str, "7d", OUTBOX,
            "How long published rows are kept: seconds, or `7d`, `36h`; `never`."),
    _outbox("POIMEN_OUTBOX_PRUNE_INTERVAL", float, 60.0, OUTBOX, "Seconds between prunes."),
    _outbox("POIMEN_OUTBOX_PRUNE_BATCH", int, 1000, OUTBOX, "Rows deleted per prune statement."),
    _outbox("POIMEN_OUTBOX_LAG_INTERVAL", float, 5.0, OUTBOX, "Seconds between lag measurements."),
    _outbox("POIMEN_OUTBOX_BACKOFF_MAX", float, 10.0, OUTBOX, "Retry backoff cap, seconds."),
    _outbox("POIMEN_OUTBOX_PROGRESS_INTERVAL", float, 30.0, OUTBOX, "Seconds between progress log lines."),
    # -- observability
    _obs("LOG_FORMAT", str, "text", ALL, "`json`: one JSON object per line (tracebacks inside it)."),
    _obs("LOG_LEVEL", str, "INFO", ALL, "Log level of every process (a name or a number)."),
    _obs("POIMEN_METRICS_TOKEN", str, None, WEB,
         "Bearer token `web`'s `/metrics` requires; unset, `web` does not serve `/metrics` (404)."),
    _obs("POIMEN_METRICS_CACHE_SECONDS", float, 5.0, (BEAT, WEB),
         "How long `beat` reuses the global gauges (runs by status, live boots, outbox lag, "
         "queue depth, the backlog) between scrapes, and a `web` process a tenant's backlog "
         "for the console's Backlog page."),
    _obs("PROMETHEUS_MULTIPROC_DIR", str, None, (WEB, WORKER),
         "prometheus_client's multiprocess directory for gunicorn's workers; when set it is "
         "emptied at start. The worker always uses a private one.",
          shown="a private temporary directory"),
    _obs("POIMEN_GUNICORN_METRICS_DIR", str, None, WEB,
         "Internal: set by `app/gunicorn_conf.py` to the directory it made; do not set."),
    _obs("POIMEN_CONSOLE_SECRET", str, None, WEB,
         "Signs the console's session cookie (`/console`); 32 characters or more, the same in "
         "every `web` process. Unset or shorter: the console answers 503 and the API is "
         "unaffected. `make run` keeps one in `.poimen/console-secret`. Changing it signs "
         "everyone out. See docs/guide/console.md."),
    # -- tracing and error reporting (app/telemetry.py)
    _trace("OTEL_EXPORTER_OTLP_ENDPOINT", str, None, (WEB, WORKER, BEAT),
           "OpenTelemetry collector, OTLP/HTTP base URL (`http://collector:4318`); spans are "
           "POSTed to its `/v1/traces`. Unset: tracing is off and OpenTelemetry is not "
           "imported. Needs the `otel` extra (`pip install 'poimen[otel]'`); without it, one "
           "warning and the process runs on. The SDK's other `OTEL_*` variables (headers, "
           "sampler, resource attributes) apply as the SDK documents them."),
    _trace("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", str, None, (WEB, WORKER, BEAT),
           "The traces endpoint of its own (`http://collector:4318/v1/traces`), used as it "
           "is, ahead of `OTEL_EXPORTER_OTLP_ENDPOINT`'s `/v1/traces`; either one turns "
           "tracing on."),
    _trace("OTEL_TRACES_EXPORTER", str, None, WEB,
           "The SDK's own (`opentelemetry-instrument`'s exporter); read here only to keep "
           "the admission fast path out: set to anything but `none`, OpenTelemetry is "
           "meant to be on, as with an OTLP endpoint of any signal "
           "(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, ...)."),
    _trace("OTEL_METRICS_EXPORTER", str, None, WEB,
           "The SDK's own; read like `OTEL_TRACES_EXPORTER` (its `http.server.*` metrics "
           "count only what Flask serves)."),
    _trace("OTEL_SERVICE_NAME", str, None, (WEB, WORKER, BEAT),
           "The `service.name` of the process's spans.",
          shown="poimen-web, poimen-worker, poimen-beat"),
    _trace("SENTRY_DSN", str, None, (WEB, WORKER, BEAT),
           "Sentry project DSN. Unset: error reporting is off and `sentry_sdk` is not imported. "
           "Needs the `sentry` extra (`pip install 'poimen[sentry]'`). Events are scrubbed: no "
           "run input or result, request body, local variable, exception message, SQL "
           "parameter or token (docs/operations/metrics.md)."),
    _trace("SENTRY_ENVIRONMENT", str, None, (WEB, WORKER, BEAT),
           "Sentry's `environment` of the events (`production`, `staging`)."),
    _trace("SENTRY_RELEASE", str, None, (WEB, WORKER, BEAT),
           "Sentry's `release` of the events (e.g. the deployed commit)."),
    # -- dev
    _dev("POIMEN_DEV_DIR", str, ".poimen", DEV, "Where `poimen-dev` keeps the embedded services' state."),
    _dev("POIMEN_TEST_AMQP_URL", str, "amqp://guest:guest@127.0.0.1:5672//", DEV,
         "Tests only: the RabbitMQ `tests/rabbitmq` uses (the default only if its port answers; "
         "otherwise those tests are skipped, loudly)."),
    _dev("POIMEN_CONSOLE_SCREENSHOT", str, None, DEV,
         "Tests only: where `tests/console` copies its screenshot of a run's page "
         "(`docs/img/console-run.png` refreshes the README's picture)."),
)

BY_NAME: Final[dict[str, Setting]] = {s.name: s for s in SETTINGS}
if len(BY_NAME) != len(SETTINGS):
    raise ValueError("a variable is in SETTINGS twice")

# The accessors below: a call of one of these names with a literal variable is a read of it
# (the reference test scans for them).
ACCESSORS: Final = frozenset({"raw", "get_str", "get_int", "get_float"})


def setting(name: str) -> Setting:
    """The table's entry of ``name`` (KeyError: not a variable Poimen reads)."""
    return BY_NAME[name]


def raw(env: Mapping[str, str], name: str) -> str | None:
    """``name``'s value in ``env`` as set (None: unset), for a reader that parses it itself."""
    return env.get(setting(name).name)


def get_str(env: Mapping[str, str], name: str) -> str:
    """``name``'s value in ``env``, else its default ("" when it has none)."""
    entry = _of_kind(name, str)
    value = env.get(name)
    if value is not None:
        return value
    return "" if entry.default is None else str(entry.default)


def get_int(env: Mapping[str, str], name: str) -> int:
    """``name``'s value in ``env`` as an integer, else its default."""
    _of_kind(name, int)
    value = env.get(name)
    return int(value) if value is not None else default_int(name)


def get_float(env: Mapping[str, str], name: str) -> float:
    """``name``'s value in ``env`` as a number, else its default."""
    _of_kind(name, float)
    value = env.get(name)
    return float(value) if value is not None else default_float(name)


def default_str(name: str) -> str:
    """``name``'s default text (a dataclass field's default, say)."""
    default = _of_kind(name, str).default
    return "" if default is None else str(default)


def default_int(name: str) -> int:
    default = _of_kind(name, int).default
    if not isinstance(default, int):
        raise TypeError(f"{name} has no default")
    return default


def default_float(name: str) -> float:
    default = _of_kind(name, float).default
    if not isinstance(default, float):
        raise TypeError(f"{name} has no default")
    return default


def _of_kind(name: str, kind: Kind) -> Setting:
    entry = setting(name)
    if entry.kind is not kind:
        raise TypeError(f"{name} is a {entry.kind.__name__} setting, read as {kind.__name__}")
    return entry
