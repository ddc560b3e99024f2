"""Settings, read from the environment when the factory runs (never at import)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping

from lease import DEFAULT_TAKEOVER_DELAY

MAX_BODY_BYTES = 1024 * 1024
REDIS_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
                   "none": ssl.CERT_NONE}


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
    return env.get("CELERY_BROKER_URL") or env.get("REDIS_URL") or "redis://127.0.0.1:6379/0"


def redis_ssl_options(url: str, env: Mapping[str, str]) -> dict | None:
    """Return the TLS options of a ``rediss://`` URL (None for ``redis://``).

    The same dict is Celery's ``broker_use_ssl`` and redis-py's keyword
    arguments (``redis.Redis.from_url(url, **options)``). Certificates are
    verified unless ``POIMEN_REDIS_SSL_CERT_REQS`` says otherwise: Heroku Data for
    Redis serves a self-signed certificate, so a Heroku app sets it to ``none``
    (app.json does); ``POIMEN_REDIS_SSL_CA_CERTS`` names a CA bundle file instead.
    """
    if not url.startswith("rediss://"):
        return None
    reqs = env.get("POIMEN_REDIS_SSL_CERT_REQS", "").strip().lower() or "required"
    if reqs not in REDIS_CERT_REQS:
        raise ValueError(f"POIMEN_REDIS_SSL_CERT_REQS={reqs!r}: use required, optional or none")
    options: dict = {"ssl_cert_reqs": REDIS_CERT_REQS[reqs]}
    if env.get("POIMEN_REDIS_SSL_CA_CERTS", "").strip():
        options["ssl_ca_certs"] = env["POIMEN_REDIS_SSL_CA_CERTS"].strip()
    return options


def prepare_threshold(env: Mapping[str, str]) -> int | None:
    """psycopg's ``prepare_threshold``: ``POIMEN_DB_PREPARE_THRESHOLD`` (off by default)."""
    raw = env.get("POIMEN_DB_PREPARE_THRESHOLD", "off").strip().lower()
    if raw in ("", "off", "none", "0"):
        return None
    return int(raw)


def load_config(env: Mapping[str, str] | None = None) -> dict:
    """Build the Flask config from ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    raw_db = env.get("DATABASE_URL")
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
            "pool_recycle": int(env.get("POIMEN_DB_POOL_RECYCLE", "300")),
            "pool_size": int(env.get("POIMEN_DB_POOL_SIZE", "5")),
            "max_overflow": int(env.get("POIMEN_DB_MAX_OVERFLOW", "10")),
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
                # may turn them on with POIMEN_DB_PREPARE_THRESHOLD=5.
                "prepare_threshold": prepare_threshold(env),
                "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                "keepalives_count": 3,
                "tcp_user_timeout": int(float(env.get("POIMEN_DB_TCP_USER_TIMEOUT", "10"))
                                        * 1000),
            },
        },
        "POIMEN_DB_PING_IDLE_SECONDS": (float(env.get("POIMEN_DB_PING_IDLE_SECONDS", "1"))
                                        if env.get("POIMEN_DB_PRE_PING", "1") == "1" else None),
        "CELERY_BROKER_URL": broker_url(env),
        "CELERY_BROKER_USE_SSL": redis_ssl_options(broker_url(env), env),
        "POIMEN_WORKFLOW_MODULES": [
            m.strip() for m in env.get("POIMEN_WORKFLOW_MODULES", "").split(",") if m.strip()
        ],
        "POIMEN_TOPIC_PREFIX": env.get("POIMEN_TOPIC_PREFIX", "poimen"),
        "KAFKA_BOOTSTRAP_SERVERS": env.get("KAFKA_BOOTSTRAP_SERVERS", ""),
        "POIMEN_REPAIR_INTERVAL": float(env.get("POIMEN_REPAIR_INTERVAL", "10")),
        "POIMEN_REPAIR_MIN_AGE": float(env.get("POIMEN_REPAIR_MIN_AGE", "10")),
        # A dead boot's run is re-sent at once but delivered this many seconds later:
        # time for a process that lost its lock to a Postgres restart, and is still
        # executing the run, to adopt it (docs/internals/execution.md). Who runs it is still
        # decided by liveness at the claim; this only orders the contenders.
        "POIMEN_TAKEOVER_DELAY": float(env.get("POIMEN_TAKEOVER_DELAY",
                                               DEFAULT_TAKEOVER_DELAY)),
        "POIMEN_TOKEN_CACHE_SECONDS": float(env.get("POIMEN_TOKEN_CACHE_SECONDS", "10")),
        # Seconds a run in flight may take after SIGTERM (Heroku kills at 30).
        "POIMEN_SHUTDOWN_GRACE": float(env.get("POIMEN_SHUTDOWN_GRACE", "25")),
        "MAX_CONTENT_LENGTH": MAX_BODY_BYTES,
    }
