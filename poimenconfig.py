"""Every process's settings, read from the environment when the process starts.

This module is the one reader of the environment: the Flask config
(``load_config``, for ``web``, ``worker``, ``beat``, ``flower``, the CLI), the
lease (``lease_settings``), Kafka's client settings and topic names, and the
relays' settings (``inbox_settings``, ``outbox_settings``). Every other module
receives values from here; ``tests/test_wiring.py`` fails when one reads the
environment itself. The framework entry points ``celeryconfig.py``,
``app/gunicorn_conf.py`` and ``logconfig.py`` are the exceptions (Celery, gunicorn
and the relays' logging read them before any factory runs).

Nothing is read at import: each function reads ``env`` (``os.environ`` by
default) when called. Each variable's type, default and documentation are its
entry in ``settings_table.py`` (which generates ``docs/operations/configuration.md``);
the readers here take them from there, and the ``DEFAULT_*`` names below are the
table's values.

This module imports only the standard library (and ``settings_table``, which does
too), so the relays (``bridge/``,
which import nothing else of ``app/``) pay nothing for it, and importing it
imports no Flask or Celery (``app/__init__.py`` imports those when called).
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final

from settings_table import (
    INBOX_METRICS_PORT,
    OUTBOX_METRICS_PORT,
    default_float,
    default_int,
    default_str,
    get_float,
    get_int,
    get_str,
    raw,
)

# -- the table's defaults that other modules name -----------------------------------------------

# Seconds a process may take to stop on SIGTERM: Heroku sends SIGKILL 30 s after it.
DEFAULT_SHUTDOWN_GRACE: Final = default_float("POIMEN_SHUTDOWN_GRACE")
# The lease (lease.py): probe interval, T_c, T_s, and the takeover delay beat's repair uses.
DEFAULT_PROBE_INTERVAL: Final = default_float("POIMEN_BOOT_PROBE_INTERVAL")
DEFAULT_CLIENT_SECONDS: Final = default_float("POIMEN_LEASE_CLIENT_SECONDS")
DEFAULT_SERVER_SECONDS: Final = default_float("POIMEN_LEASE_SERVER_SECONDS")
DEFAULT_TAKEOVER_DELAY: Final = default_float("POIMEN_TAKEOVER_DELAY")
DEFAULT_RECORD_RETRY_SECONDS: Final = default_float("POIMEN_RECORD_RETRY_SECONDS")
# Bytes of an error's message (its head) and traceback (its tail) kept in runs.error, the
# ledger and events (workers/actions.py bound_error): a message quoting a large input
# must not make an event too large to publish.
DEFAULT_ERROR_TEXT_MAX_BYTES: Final = default_int("POIMEN_ERROR_TEXT_MAX_BYTES")
DEFAULT_TOPIC_PREFIX: Final = default_str("POIMEN_TOPIC_PREFIX")
DEFAULT_QUEUE: Final = default_str("POIMEN_QUEUE")  # the Celery queue (celeryconfig.py)
DEFAULT_TOPIC_PARTITIONS: Final = default_int("POIMEN_OUTBOX_TOPIC_PARTITIONS")
# Seconds between a worker's publishes of its buffered Celery task events (workers/task_events.py).
DEFAULT_EVENT_FLUSH_INTERVAL: Final = default_float("POIMEN_EVENT_FLUSH_INTERVAL")

MAX_BODY_BYTES: Final = 1024 * 1024
# The most items one POST /v1/runs/batch may carry (more is a 413, nothing admitted).
DEFAULT_BATCH_MAX: Final = default_int("POIMEN_BATCH_MAX")
REDIS_CERT_REQS: Final = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
                          "none": ssl.CERT_NONE}


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


# -- URLs -------------------------------------------------------------------------------------

def database_url(raw: str) -> str:
    """Return a SQLAlchemy URL for psycopg 3, accepting Heroku's ``postgres://``."""
    for prefix in ("postgres://", "postgresql://", "postgresql+psycopg2://"):
        if raw.startswith(prefix):
            return "postgresql+psycopg://" + raw[len(prefix):]
    return raw


def libpq_url(raw: str) -> str:
    """Return a URL psycopg/libpq can connect to, from a Postgres or SQLAlchemy URL."""
    url = database_url(raw)
    return "postgresql://" + url[len("postgresql+psycopg://"):] if url.startswith(
        "postgresql+psycopg://") else url


def broker_url(env: Mapping[str, str]) -> str:
    """Return the Celery broker URL: ``CELERY_BROKER_URL`` wins over ``REDIS_URL``."""
    return (raw(env, "CELERY_BROKER_URL") or raw(env, "REDIS_URL")
            or default_str("REDIS_URL"))


def redis_ssl_options(url: str, env: Mapping[str, str]) -> dict[str, Any] | None:
    """Return the TLS options of a ``rediss://`` URL (None for ``redis://``).

    The same dict is Celery's ``broker_use_ssl`` and redis-py's keyword
    arguments (``redis.Redis.from_url(url, **options)``). Certificates are
    verified unless ``POIMEN_REDIS_SSL_CERT_REQS`` says otherwise: Heroku Data for
    Redis serves a self-signed certificate, so a Heroku app sets it to ``none``
    (app.json does); ``POIMEN_REDIS_SSL_CA_CERTS`` names a CA bundle file instead.
    """
    if not url.startswith("rediss://"):
        return None
    reqs = ((raw(env, "POIMEN_REDIS_SSL_CERT_REQS") or "").strip().lower()
            or default_str("POIMEN_REDIS_SSL_CERT_REQS"))
    if reqs not in REDIS_CERT_REQS:
        raise ValueError(f"POIMEN_REDIS_SSL_CERT_REQS={reqs!r}: use required, optional or none")
    options: dict[str, Any] = {"ssl_cert_reqs": REDIS_CERT_REQS[reqs]}
    ca_certs = (raw(env, "POIMEN_REDIS_SSL_CA_CERTS") or "").strip()
    if ca_certs:
        options["ssl_ca_certs"] = ca_certs
    return options


# What ``auto`` turns on, where it may: psycopg's own default threshold.
AUTO_PREPARE_THRESHOLD: Final = 5


def prepare_threshold(env: Mapping[str, str]) -> int | None:
    """psycopg's ``prepare_threshold`` for the app's engine: ``POIMEN_DB_PREPARE_THRESHOLD``.

    ``auto`` (the default) is off here: a process turns it on itself once it has
    seen that ``DATABASE_URL`` is direct (``prepare_auto``).
    """
    value = get_str(env, "POIMEN_DB_PREPARE_THRESHOLD").strip().lower()
    if value in ("", "auto", "off", "none", "0"):
        return None
    return int(value)


def prepare_auto(env: Mapping[str, str]) -> bool:
    """``POIMEN_DB_PREPARE_THRESHOLD`` is ``auto``: prepare where the connection is known direct.

    Direct: ``DATABASE_URL`` is the lock database too (``POIMEN_LOCK_DATABASE_URL``
    unset or the same) and a connection to it keeps its own session, which a worker
    checks before it starts (``workers.boots.check_lock_database``) and web at each
    gunicorn worker's start (``app.extensions.prepare_if_direct``). Prepared
    statements halve Postgres' CPU per run there (docs/scaling.md).
    """
    return get_str(env, "POIMEN_DB_PREPARE_THRESHOLD").strip().lower() in ("", "auto")


WORKER_MODES: Final = ("prefork", "batch")


def worker_mode(env: Mapping[str, str] | None = None) -> str:
    """``POIMEN_WORKER_MODE``: ``prefork`` or ``batch`` (anything else is refused)."""
    env = _environ(env)
    mode = get_str(env, "POIMEN_WORKER_MODE").strip().lower()
    if mode not in WORKER_MODES:
        raise ValueError(f"POIMEN_WORKER_MODE={mode!r}: use prefork or batch")
    return mode


def load_config(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Build the Flask config from ``env`` (default: ``os.environ``)."""
    env = _environ(env)
    raw_db = raw(env, "DATABASE_URL")
    web = get_str(env, "POIMEN_WEB_PROCESS") == "1"
    return {
        "SQLALCHEMY_DATABASE_URI": database_url(raw_db) if raw_db else None,
        "SQLALCHEMY_ENGINE_OPTIONS": {
            # Pooled connections are pinged at checkout only when the server wrote
            # to their socket since (it cut them) or they sat idle for
            # POIMEN_DB_PING_IDLE_SECONDS (extensions.ping_idle_connections): that
            # replaces connections a database restart or failover cut before a
            # request uses one (docs/internals/reliability.md, row 9) without a round trip
            # per transaction under load. POIMEN_DB_PRE_PING=0 turns pinging off.
            "pool_pre_ping": False,
            "pool_recycle": get_int(env, "POIMEN_DB_POOL_RECYCLE"),
            # A gunicorn worker (app/gunicorn_conf.py marks it) holds WEB_DB_CONNECTIONS at
            # most, whatever its threads: the threads beyond them serve requests that wait
            # on a run holding no connection (?wait=), and the plan's connection budget
            # (docs/operations/deploy.md) stays the same.
            "pool_size": (get_int(env, "WEB_DB_CONNECTIONS") if web
                          else get_int(env, "POIMEN_DB_POOL_SIZE")),
            "max_overflow": 0 if web else get_int(env, "POIMEN_DB_MAX_OVERFLOW"),
            # Statement parameters (whole run inputs) stay out of exception messages.
            "hide_parameters": True,
            # Admission's miss path reads the row a conflicting transaction just
            # committed, which only READ COMMITTED sees; never inherit a database
            # default of repeatable read.
            "isolation_level": "READ COMMITTED",
            # A path that goes silent (no RST, no FIN) must fail a pooled statement
            # within seconds, not when TCP gives up (~15 min): then a worker's
            # record-retry budget (POIMEN_RECORD_RETRY_SECONDS) starts and ends.
            # libpq ignores these on unix sockets.
            "connect_args": {
                # No server-side prepared statements by default: behind a
                # transaction-mode pooler (Heroku's connection pooling, PgBouncer)
                # a statement psycopg prepared on one server connection is run on
                # another ("prepared statement _pg3_N does not exist", another
                # client's statement with other parameters). A direct connection
                # may turn them on with POIMEN_DB_PREPARE_THRESHOLD=5; under the
                # default, auto, web and worker turn them on themselves where they
                # have checked that DATABASE_URL is direct (POIMEN_DB_PREPARE_AUTO).
                "prepare_threshold": prepare_threshold(env),
                "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                "keepalives_count": 3,
                "tcp_user_timeout": int(get_float(env, "POIMEN_DB_TCP_USER_TIMEOUT") * 1000),
            },
        },
        "POIMEN_DB_PREPARE_AUTO": prepare_auto(env),
        "POIMEN_DB_PING_IDLE_SECONDS": (get_float(env, "POIMEN_DB_PING_IDLE_SECONDS")
                                        if get_str(env, "POIMEN_DB_PRE_PING") == "1" else None),
        "CELERY_BROKER_URL": broker_url(env),
        "CELERY_BROKER_USE_SSL": redis_ssl_options(broker_url(env), env),
        "POIMEN_WORKFLOW_MODULES": [
            m.strip() for m in get_str(env, "POIMEN_WORKFLOW_MODULES").split(",") if m.strip()
        ],
        "POIMEN_TOPIC_PREFIX": get_str(env, "POIMEN_TOPIC_PREFIX"),
        "KAFKA_BOOTSTRAP_SERVERS": get_str(env, "KAFKA_BOOTSTRAP_SERVERS"),
        "POIMEN_REPAIR_INTERVAL": get_float(env, "POIMEN_REPAIR_INTERVAL"),
        "POIMEN_REPAIR_MIN_AGE": get_float(env, "POIMEN_REPAIR_MIN_AGE"),
        # Beat's timer thread (workers/timers.py): delayed runs sent when due, expiry.
        "POIMEN_RELEASE_INTERVAL": get_float(env, "POIMEN_RELEASE_INTERVAL"),
        "POIMEN_RELEASE_PAGE": get_int(env, "POIMEN_RELEASE_PAGE"),
        # A worker publishes its buffered Celery task events this often (0: at every turn
        # of its event loop, Celery's own way); workers/task_events.py.
        "POIMEN_EVENT_FLUSH_INTERVAL": get_float(env, "POIMEN_EVENT_FLUSH_INTERVAL"),
        # A dead boot's run is re-sent at once but delivered this many seconds later:
        # time for a process that lost its lock to a Postgres restart, and is still
        # executing the run, to adopt it (docs/internals/execution.md). Who runs it is still
        # decided by liveness at the claim; this only orders the contenders.
        "POIMEN_TAKEOVER_DELAY": get_float(env, "POIMEN_TAKEOVER_DELAY"),
        "POIMEN_TOKEN_CACHE_SECONDS": get_float(env, "POIMEN_TOKEN_CACHE_SECONDS"),
        # POST /v1/runs answered in front of Flask when plain (app/fastpath.py); 0: off.
        "POIMEN_ADMISSION_FAST_PATH": get_str(env, "POIMEN_ADMISSION_FAST_PATH") != "0",
        # The most runs one POST /v1/runs/batch may admit.
        "POIMEN_BATCH_MAX": get_int(env, "POIMEN_BATCH_MAX"),
        "POIMEN_WORKER_MODE": worker_mode(env),
        "POIMEN_WORKER_BATCH_WINDOW_MS": get_float(env, "POIMEN_WORKER_BATCH_WINDOW_MS"),
        "POIMEN_WORKER_BATCH_LINGER_MS": get_float(env, "POIMEN_WORKER_BATCH_LINGER_MS"),
        "POIMEN_WORKER_BATCH_MAX": get_int(env, "POIMEN_WORKER_BATCH_MAX"),
        # GET /v1/runs/<id>?wait= (app/waiter.py).
        "POIMEN_WAIT_MAX": get_int(env, "POIMEN_WAIT_MAX"),
        "POIMEN_WAIT_MAX_SECONDS": get_float(env, "POIMEN_WAIT_MAX_SECONDS"),
        "POIMEN_WAIT_POLL_SECONDS": get_float(env, "POIMEN_WAIT_POLL_SECONDS"),
        # Seconds a run in flight may take after SIGTERM (Heroku kills at 30).
        "POIMEN_SHUTDOWN_GRACE": shutdown_grace(env),
        # How long a worker retries recording a run's outcome while the database is away.
        "POIMEN_RECORD_RETRY_SECONDS": get_float(env, "POIMEN_RECORD_RETRY_SECONDS"),
        # Bytes of a failure's message and traceback stored with the run and its events.
        "POIMEN_ERROR_TEXT_MAX_BYTES": error_text_max_bytes(env),
        # The boot's lock connection: direct, never pooled (None: the app's database,
        # SQLALCHEMY_DATABASE_URI, so an override of that one moves both).
        "POIMEN_LOCK_DATABASE_URL": raw(env, "POIMEN_LOCK_DATABASE_URL") or None,
        # worker's and beat's Prometheus port (None: not served).
        "METRICS_PORT": metrics_port(env),
        "POIMEN_METRICS_TOKEN": raw(env, "POIMEN_METRICS_TOKEN") or None,
        "POIMEN_METRICS_CACHE_SECONDS": get_float(env, "POIMEN_METRICS_CACHE_SECONDS"),
        "POIMEN_CONSOLE_SECRET": get_str(env, "POIMEN_CONSOLE_SECRET"),
        "MAX_CONTENT_LENGTH": MAX_BODY_BYTES,
    }


def error_text_max_bytes(env: Mapping[str, str] | None = None) -> int:
    """``POIMEN_ERROR_TEXT_MAX_BYTES``: bytes of an error's message and of its traceback kept."""
    env = _environ(env)
    limit = get_int(env, "POIMEN_ERROR_TEXT_MAX_BYTES")
    if limit < 256:
        raise SystemExit("POIMEN_ERROR_TEXT_MAX_BYTES must be at least 256")
    return limit


def shutdown_grace(env: Mapping[str, str] | None = None) -> float:
    """``POIMEN_SHUTDOWN_GRACE``: seconds a process may take to stop on SIGTERM."""
    env = _environ(env)
    return get_float(env, "POIMEN_SHUTDOWN_GRACE")


def metrics_port(env: Mapping[str, str] | None = None) -> int | None:
    """The Prometheus port of ``worker`` and ``beat``: ``METRICS_PORT``, else ``PORT``; 0 is off."""
    env = _environ(env)
    port = raw(env, "METRICS_PORT") or raw(env, "PORT")
    return int(port) if port and port != "0" else None


def prometheus_multiproc_dir(env: Mapping[str, str] | None = None) -> str | None:
    """prometheus_client's ``PROMETHEUS_MULTIPROC_DIR``, as set now (None: single process).

    Read when asked, not at start: ``app/gunicorn_conf.py`` and ``workers/metrics.py``
    set it for prometheus_client (the only writes to the environment).
    """
    env = _environ(env)
    return raw(env, "PROMETHEUS_MULTIPROC_DIR") or None


# -- poisoned runs (workers/registry.py) --------------------------------------------------------

DEFAULT_MAX_TAKEOVERS: Final = default_int("POIMEN_MAX_TAKEOVERS")


def max_takeovers_setting(env: Mapping[str, str] | None = None) -> int:
    """``POIMEN_MAX_TAKEOVERS``: how many lost workers a run may outlive unless its workflow
    says (``@workflow(max_takeovers=...)``); one more and the run ends ``poisoned``. Read
    where workflows are declared (worker, beat, web) and for a version the process does
    not have."""
    env = _environ(env)
    given = (raw(env, "POIMEN_MAX_TAKEOVERS") or "").strip()
    if not given:
        return DEFAULT_MAX_TAKEOVERS
    try:
        value = int(given)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"POIMEN_MAX_TAKEOVERS must be a whole number >= 0, not {given!r}")
    return value


# -- optional tracing and error reporting (app/telemetry.py) ---------------------------------

@dataclass(frozen=True)
class TelemetrySettings:
    """OpenTelemetry and Sentry, each off unless its variable is set (``app/telemetry.py``)."""

    otlp_endpoint: str | None = None     # OTEL_EXPORTER_OTLP_ENDPOINT: tracing on
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: tracing on; the spans' URL as it is (the spec's rule
    # for a signal's own endpoint), ahead of the base URL's /v1/traces.
    otlp_traces_endpoint: str | None = None
    service_name: str | None = None      # OTEL_SERVICE_NAME: else poimen-<process>
    sentry_dsn: str | None = None        # SENTRY_DSN: error reporting on
    sentry_environment: str | None = None  # SENTRY_ENVIRONMENT
    sentry_release: str | None = None    # SENTRY_RELEASE
    # OpenTelemetry configured for this process by any of its own variables (an OTLP
    # endpoint of any signal, OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER): the names set.
    otel_variables: tuple[str, ...] = ()

    @property
    def tracing(self) -> bool:
        """Whether this process exports spans (either endpoint set)."""
        return bool(self.otlp_traces_endpoint or self.otlp_endpoint)

    @property
    def otlp_traces_url(self) -> str | None:
        """Where spans are POSTed: the traces endpoint as set, else the OTLP/HTTP base
        URL's ``/v1/traces``."""
        if self.otlp_traces_endpoint:
            return self.otlp_traces_endpoint
        if not self.otlp_endpoint:
            return None
        return self.otlp_endpoint.rstrip("/") + "/v1/traces"


def telemetry_settings(env: Mapping[str, str] | None = None) -> TelemetrySettings:
    """Read the optional OpenTelemetry and Sentry settings (web, worker and beat, at start)."""
    env = _environ(env)
    return TelemetrySettings(
        otlp_endpoint=_stripped(raw(env, "OTEL_EXPORTER_OTLP_ENDPOINT")),
        otlp_traces_endpoint=_stripped(raw(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")),
        service_name=_stripped(raw(env, "OTEL_SERVICE_NAME")),
        sentry_dsn=_stripped(raw(env, "SENTRY_DSN")),
        sentry_environment=_stripped(raw(env, "SENTRY_ENVIRONMENT")),
        sentry_release=_stripped(raw(env, "SENTRY_RELEASE")),
        otel_variables=_otel_variables(env),
    )


def _stripped(value: str | None) -> str | None:
    """A variable's value without surrounding blanks, None when unset or blank."""
    return (value or "").strip() or None


def _otel_variables(env: Mapping[str, str]) -> tuple[str, ...]:
    """The OpenTelemetry variables set that configure an exporter: whoever starts the SDK
    (``app/telemetry.py``, ``opentelemetry-instrument``), OpenTelemetry is meant to be on."""
    endpoints = [name for name, value in env.items() if value.strip()
                 and name.startswith("OTEL_EXPORTER_OTLP_") and name.endswith("ENDPOINT")]
    exporters = [name for name, value in (
        ("OTEL_TRACES_EXPORTER", get_str(env, "OTEL_TRACES_EXPORTER")),
        ("OTEL_METRICS_EXPORTER", get_str(env, "OTEL_METRICS_EXPORTER")))
        if value.strip().lower() not in ("", "none")]
    return tuple(sorted(endpoints) + exporters)


# -- the lease (lease.py applies it and checks its ordering) ---------------------------------

@dataclass(frozen=True)
class LeaseSettings:
    """The lease's numbers, seconds; ``lease.problems`` says whether their order is safe."""

    probe_interval: float = DEFAULT_PROBE_INTERVAL  # POIMEN_BOOT_PROBE_INTERVAL
    client_seconds: float = DEFAULT_CLIENT_SECONDS  # T_c, POIMEN_LEASE_CLIENT_SECONDS
    server_seconds: float = DEFAULT_SERVER_SECONDS  # T_s, POIMEN_LEASE_SERVER_SECONDS
    takeover_delay: float = DEFAULT_TAKEOVER_DELAY  # POIMEN_TAKEOVER_DELAY

    @property
    def probe_timeout(self) -> float:
        """A probe's deadline: unanswered by then, the lock is not confirmed."""
        return max(0.2, min(5.0, self.client_seconds / 3))


def lease_settings(env: Mapping[str, str] | None = None) -> LeaseSettings:
    """Read the lease's numbers (worker, beat and the outbox read them when they start)."""
    env = _environ(env)
    return LeaseSettings(
        probe_interval=get_float(env, "POIMEN_BOOT_PROBE_INTERVAL"),
        client_seconds=get_float(env, "POIMEN_LEASE_CLIENT_SECONDS"),
        server_seconds=get_float(env, "POIMEN_LEASE_SERVER_SECONDS"),
        takeover_delay=get_float(env, "POIMEN_TAKEOVER_DELAY"),
    )


# -- Kafka: client settings and names ----------------------------------------------------------
#
# ``KAFKA_BOOTSTRAP_SERVERS`` names the brokers. Any other ``KAFKA_*`` variable is a
# librdkafka setting: ``KAFKA_SECURITY_PROTOCOL=SASL_SSL`` becomes
# ``security.protocol=SASL_SSL``. Apache Kafka on Heroku sets other names, translated
# here: ``KAFKA_URL`` (``kafka+ssl://host:port,...``) gives the brokers and
# ``security.protocol=SSL`` when ``KAFKA_BOOTSTRAP_SERVERS`` is unset;
# ``KAFKA_TRUSTED_CERT``, ``KAFKA_CLIENT_CERT`` and ``KAFKA_CLIENT_CERT_KEY`` (PEM
# contents) become ``ssl.ca.pem``, ``ssl.certificate.pem`` and ``ssl.key.pem``. An
# explicit ``KAFKA_*`` setting always wins over a translated one. ``KAFKA_PREFIX``
# goes in front of topic and group names.

# Variables that look like client settings but are not: Heroku's Kafka add-on
# sets these, and librdkafka refuses unknown properties at client creation.
KAFKA_NOT_CLIENT_SETTINGS: Final = frozenset({
    "KAFKA_BOOTSTRAP_SERVERS", "KAFKA_URL", "KAFKA_PREFIX", "KAFKA_TRUSTED_CERT",
    "KAFKA_CLIENT_CERT", "KAFKA_CLIENT_CERT_KEY",
})
# Heroku's PEM variables and the librdkafka settings that take their contents.
HEROKU_KAFKA_PEMS: Final = {
    "KAFKA_TRUSTED_CERT": "ssl.ca.pem",
    "KAFKA_CLIENT_CERT": "ssl.certificate.pem",
    "KAFKA_CLIENT_CERT_KEY": "ssl.key.pem",
}


def _url_hosts(url: str) -> list[tuple[str, str]]:
    """Split ``kafka+ssl://h1:9096,kafka+ssl://h2:9096`` into ``(scheme, host:port)`` pairs."""
    pairs: list[tuple[str, str]] = []
    for item in url.split(","):
        scheme, sep, rest = item.strip().partition("://")
        if not sep:
            scheme, rest = "", scheme
        if rest.strip("/"):
            pairs.append((scheme.lower(), rest.strip("/")))
    return pairs


def kafka_bootstrap_servers(env: Mapping[str, str] | None = None) -> str:
    """Return ``KAFKA_BOOTSTRAP_SERVERS`` (else Heroku's ``KAFKA_URL`` as ``host:port,...``)."""
    env = _environ(env)
    servers = get_str(env, "KAFKA_BOOTSTRAP_SERVERS").strip()
    if not servers:
        servers = ",".join(host for _, host in _url_hosts(get_str(env, "KAFKA_URL")))
    if not servers:
        raise SystemExit("KAFKA_BOOTSTRAP_SERVERS is not set (e.g. 127.0.0.1:9092), "
                         "nor Heroku's KAFKA_URL")
    return servers


def heroku_kafka_settings(env: Mapping[str, str]) -> dict[str, str]:
    """Return the librdkafka settings Heroku's ``KAFKA_URL`` and PEM variables stand for."""
    settings: dict[str, str] = {}
    if not get_str(env, "KAFKA_BOOTSTRAP_SERVERS").strip():
        schemes = {scheme for scheme, _ in _url_hosts(get_str(env, "KAFKA_URL"))}
        if "kafka+ssl" in schemes:
            settings["security.protocol"] = "SSL"
    for variable, setting in HEROKU_KAFKA_PEMS.items():
        pem = raw(env, variable)
        if pem is not None and pem.strip():
            settings[setting] = pem
    if "ssl.ca.pem" in settings:
        # Heroku's broker certificates are signed by the trusted CA but do not name
        # the broker hosts: verify the chain, not the host name.
        settings["ssl.endpoint.identification.algorithm"] = "none"
    return settings


def kafka_client_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return librdkafka settings: bootstrap servers plus every extra ``KAFKA_*`` variable."""
    env = _environ(env)
    settings = {"bootstrap.servers": kafka_bootstrap_servers(env), **heroku_kafka_settings(env)}
    for name, value in env.items():
        if name.startswith("KAFKA_") and name not in KAFKA_NOT_CLIENT_SETTINGS:
            settings[name[len("KAFKA_"):].lower().replace("_", ".")] = value
    return settings


def topic_prefix(env: Mapping[str, str] | None = None) -> str:
    """Return the topic prefix: ``POIMEN_TOPIC_PREFIX`` (``poimen``) after Heroku's ``KAFKA_PREFIX``.

    On Heroku's multi-tenant Kafka plans every topic name must start with
    ``KAFKA_PREFIX`` (e.g. ``acme-42.``), so ``poimen.<tenant>.dispatch`` becomes
    ``acme-42.poimen.<tenant>.dispatch``.
    """
    env = _environ(env)
    return (get_str(env, "KAFKA_PREFIX").strip()
            + (get_str(env, "POIMEN_TOPIC_PREFIX").strip() or DEFAULT_TOPIC_PREFIX))


# The dead-letter replay's consumer group (``bridge/dlq.py``, ``flask replay-dlq``, the
# console's inbox page), named here so the app knows it without loading the Kafka client.
REPLAY_GROUP: Final = "poimen-dlq-replay"


def consumer_group(name: str, env: Mapping[str, str] | None = None) -> str:
    """Return the consumer group ``name`` with Heroku's ``KAFKA_PREFIX`` in front (if set)."""
    env = _environ(env)
    prefix = get_str(env, "KAFKA_PREFIX").strip()
    return name if not prefix or name.startswith(prefix) else prefix + name


def topic_replication(env: Mapping[str, str] | None = None) -> int:
    """``POIMEN_TOPIC_REPLICATION``: replication factor of declared topics (-1: the broker's)."""
    env = _environ(env)
    return get_int(env, "POIMEN_TOPIC_REPLICATION")


# -- the inbox relay (bridge/inbox/) ------------------------------------------------------------

@dataclass(frozen=True)
class InboxSettings:
    """The inbox relay's settings; each default is its variable's in ``settings_table``.

    ``INBOX_VARIABLES`` names the environment variable behind each field.
    """

    api_url: str
    api_token: str
    kafka: Mapping[str, str]
    prefix: str = DEFAULT_TOPIC_PREFIX
    group: str = default_str("POIMEN_INBOX_GROUP")
    # parallel partitions, and so HTTP sessions (one per thread)
    concurrency: int = default_int("POIMEN_INBOX_CONCURRENCY")
    # calls in flight per partition; 1 is strict order
    partition_window: int = default_int("POIMEN_INBOX_PARTITION_WINDOW")
    # One POST /v1/runs/batch carries up to batch_max of a partition's messages (and
    # under the API's 1 MiB body); a batch that is not full waits batch_linger_ms
    # from its oldest message for more, so a lone message waits at most that long.
    batch_max: int = default_int("POIMEN_INBOX_BATCH_MAX")
    batch_linger_ms: float = default_float("POIMEN_INBOX_BATCH_LINGER_MS")
    http_timeout: float = default_float("POIMEN_INBOX_HTTP_TIMEOUT")
    backoff_initial: float = default_float("POIMEN_INBOX_BACKOFF_INITIAL")
    backoff_max: float = default_float("POIMEN_INBOX_BACKOFF_MAX")
    # fetched, uncommitted messages per partition, and their bytes across all partitions
    max_buffered: int = default_int("POIMEN_INBOX_MAX_BUFFERED")
    buffer_bytes: int = default_int("POIMEN_INBOX_BUFFER_BYTES")
    metadata_refresh_ms: int = default_int("POIMEN_INBOX_METADATA_REFRESH_MS")
    session_timeout_ms: int = default_int("POIMEN_INBOX_SESSION_TIMEOUT_MS")
    dlq_partitions: int = default_int("POIMEN_INBOX_DLQ_PARTITIONS")
    metrics_port: int = INBOX_METRICS_PORT
    lag_interval: float = default_float("POIMEN_INBOX_LAG_INTERVAL")
    progress_interval: float = default_float("POIMEN_INBOX_PROGRESS_INTERVAL")
    commit_interval: float = 0.2      # seconds between offset commits (no variable)
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    # Test only: a message whose value contains these bytes makes the relay's own
    # code raise, to prove that a bug cannot strand a partition. Never set it in
    # production; empty (the default) disables the check.
    test_raise_on: bytes = default_str("POIMEN_INBOX_TEST_RAISE_ON").encode()

    @property
    def subscription(self) -> str:
        return rf"^{re.escape(self.prefix)}\..+\.dispatch$"


# The broker's default group.min.session.timeout.ms (Apache Kafka, Redpanda).
MIN_SESSION_TIMEOUT_MS: Final = 6000

INBOX_VARIABLES: Final = {
    "group": "POIMEN_INBOX_GROUP",
    "concurrency": "POIMEN_INBOX_CONCURRENCY",
    "partition_window": "POIMEN_INBOX_PARTITION_WINDOW",
    "batch_max": "POIMEN_INBOX_BATCH_MAX",
    "batch_linger_ms": "POIMEN_INBOX_BATCH_LINGER_MS",
    "http_timeout": "POIMEN_INBOX_HTTP_TIMEOUT",
    "backoff_initial": "POIMEN_INBOX_BACKOFF_INITIAL",
    "backoff_max": "POIMEN_INBOX_BACKOFF_MAX",
    "max_buffered": "POIMEN_INBOX_MAX_BUFFERED",
    "buffer_bytes": "POIMEN_INBOX_BUFFER_BYTES",
    "metadata_refresh_ms": "POIMEN_INBOX_METADATA_REFRESH_MS",
    "session_timeout_ms": "POIMEN_INBOX_SESSION_TIMEOUT_MS",
    "dlq_partitions": "POIMEN_INBOX_DLQ_PARTITIONS",
    "metrics_port": "METRICS_PORT",  # else PORT
    "lag_interval": "POIMEN_INBOX_LAG_INTERVAL",
    "progress_interval": "POIMEN_INBOX_PROGRESS_INTERVAL",
    "shutdown_grace": "POIMEN_SHUTDOWN_GRACE",
    "test_raise_on": "POIMEN_INBOX_TEST_RAISE_ON",
}


def inbox_settings(env: Mapping[str, str] | None = None) -> InboxSettings:
    """Read the inbox relay's settings from ``env`` (default: ``os.environ``)."""
    env = _environ(env)
    api_url, api_token = raw(env, "POIMEN_API_URL"), raw(env, "POIMEN_API_TOKEN")
    if not api_url or not api_token:
        missing = [n for n, v in (("POIMEN_API_URL", api_url), ("POIMEN_API_TOKEN", api_token))
                   if not v]
        raise SystemExit(f"{' and '.join(missing)} must be set: the inbox POSTs runs to the "
                         "API with a service token (flask --app app tokens create --service)")
    defaults: dict[str, Any] = {f.name: f.default for f in fields(InboxSettings)}
    values: dict[str, Any] = {}
    for name, variable in INBOX_VARIABLES.items():
        given = (raw(env, variable) or "").strip()
        if not given:
            continue
        kind = type(defaults[name])
        try:
            values[name] = given.encode() if kind is bytes else kind(given)
        except ValueError:
            raise SystemExit(f"{variable}={given!r} is not a valid {kind.__name__}") from None
    port = raw(env, "PORT")
    if "metrics_port" not in values and port:
        values["metrics_port"] = int(port)
    values["group"] = consumer_group(values.get("group", defaults["group"]), env)
    if values.get("batch_max", defaults["batch_max"]) < 1:
        raise SystemExit("POIMEN_INBOX_BATCH_MAX must be at least 1")
    if values.get("batch_linger_ms", defaults["batch_linger_ms"]) < 0:
        raise SystemExit("POIMEN_INBOX_BATCH_LINGER_MS must not be negative")
    if values.get("session_timeout_ms", defaults["session_timeout_ms"]) < MIN_SESSION_TIMEOUT_MS:
        # Kafka's group.min.session.timeout.ms (6 s) refuses a shorter one at JoinGroup,
        # and the relay would never get a partition.
        raise SystemExit(f"POIMEN_INBOX_SESSION_TIMEOUT_MS must be at least "
                         f"{MIN_SESSION_TIMEOUT_MS} (brokers refuse shorter sessions)")
    return InboxSettings(api_url=api_url.rstrip("/"), api_token=api_token,
                         kafka=kafka_client_settings(env), prefix=topic_prefix(env), **values)


# -- the outbox relay (bridge/outbox.py) -------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)
_UNIT: Final = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _retention_seconds(value: str) -> float | None:
    """A retention as written (``7d``, ``36h``, seconds; ``never``) in seconds, None: keep."""
    if value.strip().lower() in ("never", "off", "none"):
        return None
    match = _DURATION.match(value)
    if match is None:
        raise SystemExit(f"POIMEN_OUTBOX_RETENTION={value!r}: use seconds or e.g. 7d, 36h, never")
    seconds = float(match.group(1)) * _UNIT[match.group(2).lower()]
    return seconds or None


# Published outbox rows are kept this long by default (the table's ``7d``).
DEFAULT_OUTBOX_RETENTION: Final = _retention_seconds(default_str("POIMEN_OUTBOX_RETENTION"))


def parse_retention(value: str | None) -> float | None:
    """Return ``POIMEN_OUTBOX_RETENTION`` in seconds, or ``None`` to keep published rows.

    A plain number is seconds; ``s``, ``m``, ``h`` and ``d`` suffixes name the unit
    (``7d``, ``36h``). ``0``, ``never`` and ``off`` disable pruning.
    """
    if value is None or not value.strip():
        return DEFAULT_OUTBOX_RETENTION
    return _retention_seconds(value)


@dataclass(frozen=True)
class OutboxSettings:
    """The outbox relay's settings; each default is its variable's in ``settings_table``."""

    database_url: str
    lock_database_url: str
    kafka: Mapping[str, str]
    prefix: str = DEFAULT_TOPIC_PREFIX
    batch_size: int = default_int("POIMEN_OUTBOX_BATCH_SIZE")
    poll_interval: float = default_float("POIMEN_OUTBOX_POLL_INTERVAL")
    # After a batch that was not full: milliseconds before the next read, so a steady
    # trickle of events is read, produced and marked in batches, not a few at a time.
    batch_linger_ms: float = default_float("POIMEN_OUTBOX_BATCH_LINGER_MS")
    standby_interval: float = default_float("POIMEN_OUTBOX_STANDBY_INTERVAL")
    lock_check_interval: float = default_float("POIMEN_OUTBOX_LOCK_CHECK_INTERVAL")
    topic_partitions: int = DEFAULT_TOPIC_PARTITIONS
    retention: float | None = DEFAULT_OUTBOX_RETENTION
    prune_interval: float = default_float("POIMEN_OUTBOX_PRUNE_INTERVAL")
    prune_batch: int = default_int("POIMEN_OUTBOX_PRUNE_BATCH")
    lag_interval: float = default_float("POIMEN_OUTBOX_LAG_INTERVAL")
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    backoff_max: float = default_float("POIMEN_OUTBOX_BACKOFF_MAX")
    metrics_port: int = OUTBOX_METRICS_PORT
    progress_interval: float = default_float("POIMEN_OUTBOX_PROGRESS_INTERVAL")
    lease: LeaseSettings = field(default_factory=LeaseSettings)


def outbox_settings(env: Mapping[str, str] | None = None) -> OutboxSettings:
    """Read the outbox relay's settings from ``env`` (default: ``os.environ``)."""
    env = _environ(env)
    raw_database = raw(env, "DATABASE_URL")
    if not raw_database:
        raise SystemExit("DATABASE_URL is not set: the outbox relay reads the outbox table")
    database = libpq_url(raw_database)
    linger_ms = get_float(env, "POIMEN_OUTBOX_BATCH_LINGER_MS")
    if linger_ms < 0:
        raise SystemExit("POIMEN_OUTBOX_BATCH_LINGER_MS must not be negative")
    port = raw(env, "METRICS_PORT") or raw(env, "PORT")
    return OutboxSettings(
        database_url=database,
        # Session advisory locks need a direct connection: a transaction-mode
        # pooler would hand the lock's session to someone else.
        lock_database_url=libpq_url(raw(env, "POIMEN_LOCK_DATABASE_URL") or database),
        kafka=kafka_client_settings(env),
        prefix=topic_prefix(env),
        batch_size=get_int(env, "POIMEN_OUTBOX_BATCH_SIZE"),
        poll_interval=get_float(env, "POIMEN_OUTBOX_POLL_INTERVAL"),
        batch_linger_ms=linger_ms,
        standby_interval=get_float(env, "POIMEN_OUTBOX_STANDBY_INTERVAL"),
        lock_check_interval=get_float(env, "POIMEN_OUTBOX_LOCK_CHECK_INTERVAL"),
        topic_partitions=get_int(env, "POIMEN_OUTBOX_TOPIC_PARTITIONS"),
        retention=parse_retention(raw(env, "POIMEN_OUTBOX_RETENTION")),
        prune_interval=get_float(env, "POIMEN_OUTBOX_PRUNE_INTERVAL"),
        prune_batch=get_int(env, "POIMEN_OUTBOX_PRUNE_BATCH"),
        lag_interval=get_float(env, "POIMEN_OUTBOX_LAG_INTERVAL"),
        shutdown_grace=shutdown_grace(env),
        backoff_max=get_float(env, "POIMEN_OUTBOX_BACKOFF_MAX"),
        metrics_port=int(port) if port else OUTBOX_METRICS_PORT,
        progress_interval=get_float(env, "POIMEN_OUTBOX_PROGRESS_INTERVAL"),
        lease=lease_settings(env),
    )
