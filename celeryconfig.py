"""Celery settings, from the environment only (read when the app is created)."""

from __future__ import annotations

import os
from collections.abc import Mapping


def celery_settings(broker_url: str, env: Mapping[str, str] | None = None) -> dict:
    """Return Celery's settings for ``broker_url``."""
    env = os.environ if env is None else env
    visibility = float(env.get("POIMEN_VISIBILITY_TIMEOUT", "3600"))
    return {
        "broker_url": broker_url,
        # Runs report through Postgres; no result backend to fill up.
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_default_queue": env.get("POIMEN_QUEUE", "poimen"),
        # At-least-once delivery: ack after the task body returns, redeliver when a
        # worker dies. Claims in Postgres make the duplicates harmless.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": int(env.get("CELERY_PREFETCH_MULTIPLIER", "1")),
        # Redis redelivers a message not acked within visibility_timeout (even one
        # still running); the sweep that does it runs every interval * throttle s.
        "broker_transport_options": {
            "visibility_timeout": visibility,
            "unacked_restore_interval": int(env.get("POIMEN_UNACKED_RESTORE_INTERVAL", "10")),
            "unacked_restore_throttle": int(env.get("POIMEN_UNACKED_RESTORE_THROTTLE", "10")),
            # A hung or black-holed Redis must fail a publish, not hang it forever
            # (redis-py waits without limit by default).
            "socket_timeout": float(env.get("POIMEN_BROKER_SOCKET_TIMEOUT", "5")),
            "socket_connect_timeout": float(env.get("POIMEN_BROKER_SOCKET_TIMEOUT", "5")),
        },
        "broker_connection_retry_on_startup": True,
        # Flower shows received/started/succeeded only if workers send events.
        "worker_send_task_events": True,
        # A "sent" event is a second Redis publish on every admission (about a
        # third of the enqueue's cost); Flower does not need it. Opt in here.
        "task_send_sent_event": env.get("POIMEN_SEND_SENT_EVENTS", "0") == "1",
        # SIGTERM: Celery's soft shutdown (with REMAP_SIGTERM=SIGQUIT) also keeps
        # a 5 s run from restarting, but sleeps its whole timeout whatever runs
        # finish sooner; pool processes survive SIGTERM by workers/shutdown.py
        # instead (measured in docs/reliability.md, row 5).
        "worker_soft_shutdown_timeout": 0.0,
        "worker_hijack_root_logger": False,
        "timezone": "UTC",
        "enable_utc": True,
    }
