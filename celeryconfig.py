"""Celery settings, from the environment only (read when the app is created).

A framework entry point, so it reads its own variables (``tests/test_wiring.py``
allows it); their types and defaults come from ``settings_table``, as everyone's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from poimenconfig import worker_mode
from settings_table import get_float, get_int, get_str

REDIS_SCHEMES = frozenset({"redis", "rediss", "redis+socket"})
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
# RabbitMQ closes the channel of a consumer that holds a message unacknowledged longer
# than its consumer_timeout (30 min by default); with acks_late that is every run longer
# than that. Poimen's liveness is the boot's advisory lock, not this timer, so by
# default the consumer asks for a day (docs/operations/rabbitmq.md):
# POIMEN_AMQP_CONSUMER_TIMEOUT's default in settings_table.


def broker_scheme(broker_url: str) -> str:
    """Return the scheme of ``broker_url`` (``redis``, ``amqp``, ...), lower-cased."""
    return broker_url.split("://", 1)[0].lower() if "://" in broker_url else ""


def celery_settings(broker_url: str, env: Mapping[str, str] | None = None) -> dict:
    """Return Celery's settings for ``broker_url``: common ones, then its broker's own."""
    env = os.environ if env is None else env
    return {**_common_settings(broker_url, env), **broker_settings(broker_url, env)}


def broker_settings(broker_url: str, env: Mapping[str, str]) -> dict:
    """Return the settings that only mean something on ``broker_url``'s kind of broker."""
    scheme = broker_scheme(broker_url)
    if scheme in REDIS_SCHEMES:
        return _redis_settings(env)
    if scheme in AMQP_SCHEMES:
        return _amqp_settings(env)
    return {}


def _redis_settings(env: Mapping[str, str]) -> dict:
    visibility = get_float(env, "POIMEN_VISIBILITY_TIMEOUT")
    return {
        # Redis redelivers a message not acked within visibility_timeout (even one
        # still running); the sweep that does it runs every interval * throttle s.
        "broker_transport_options": {
            "visibility_timeout": visibility,
            "unacked_restore_interval": get_int(env, "POIMEN_UNACKED_RESTORE_INTERVAL"),
            "unacked_restore_throttle": get_int(env, "POIMEN_UNACKED_RESTORE_THROTTLE"),
            # A hung or black-holed Redis must fail a publish, not hang it forever
            # (redis-py waits without limit by default).
            "socket_timeout": get_float(env, "POIMEN_BROKER_SOCKET_TIMEOUT"),
            "socket_connect_timeout": get_float(env, "POIMEN_BROKER_SOCKET_TIMEOUT"),
            # The worker's transport defers removing acknowledged messages from the
            # unacked hash (workers/broker.py); these bound how many, and for how long.
            "ack_pending_max": get_int(env, "POIMEN_ACK_PENDING_MAX"),
            "ack_pending_max_age": get_float(env, "POIMEN_ACK_PENDING_MAX_AGE"),
            # After a BRPOP, how many more messages one fetch may take (workers/broker.py).
            "fetch_max": get_int(env, "POIMEN_DELIVERY_FETCH_MAX"),
        },
    }


def amqp_consumer_arguments(env: Mapping[str, str]) -> dict:
    """Return the ``basic.consume`` arguments of a worker's consumer on RabbitMQ."""
    raw = get_str(env, "POIMEN_AMQP_CONSUMER_TIMEOUT").strip().lower()
    if raw in ("", "0", "off", "server"):
        return {}  # the server's consumer_timeout (or its queue policy) decides
    return {"x-consumer-timeout": int(float(raw) * 1000)}


def queue_max_priority(env: Mapping[str, str]) -> int | None:
    """``POIMEN_QUEUE_MAX_PRIORITY``: the ``x-max-priority`` of the queues Celery declares
    on RabbitMQ (1-255), or None (unset, empty or 0: queues without priorities)."""
    raw = get_str(env, "POIMEN_QUEUE_MAX_PRIORITY").strip()
    if raw in ("", "0"):
        return None
    value = int(raw)
    if not 1 <= value <= 255:
        raise ValueError(f"POIMEN_QUEUE_MAX_PRIORITY must be from 1 to 255, not {value}")
    return value


def _amqp_settings(env: Mapping[str, str]) -> dict:
    from kombu import Exchange, Queue

    queue = get_str(env, "POIMEN_QUEUE")
    max_priority = queue_max_priority(env)
    return {
        # Priority queues: Celery gives every queue it declares (the default queue and
        # each workflow's own) this x-max-priority, unless the queue names its own. A
        # queue argument: an existing queue declared without it refuses the declare
        # (PRECONDITION_FAILED; workers.queues.check_queue_arguments says so at start).
        **({"task_queue_max_priority": max_priority} if max_priority is not None else {}),
        # RabbitMQ confirms each publish: a send that returns is in the broker, so an
        # admitted run's message is not lost silently between commit and repair.
        "broker_transport_options": {"confirm_publish": True},
        # The default queue as Celery would declare it (a direct exchange of its own
        # name), plus the consumer timeout runs need under acks_late. The argument is a
        # consumer's, not the queue's: an existing queue needs no re-declaring.
        "task_queues": [Queue(queue, Exchange(queue, type="direct"), routing_key=queue,
                              consumer_arguments=amqp_consumer_arguments(env) or None)],
    }


def _common_settings(broker_url: str, env: Mapping[str, str]) -> dict:
    return {
        "broker_url": broker_url,
        # Runs report through Postgres; no result backend to fill up.
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_default_queue": get_str(env, "POIMEN_QUEUE"),
        # At-least-once delivery: ack after the task body returns, redeliver when a
        # worker dies. Claims in Postgres make the duplicates harmless.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # A lost broker connection (a broker restart; RabbitMQ's consumer_timeout closing
        # the channel under a long run) must not kill the runs in flight: the redelivered
        # message finds the run claimed by a live boot and is acknowledged as a duplicate.
        # Celery 6 plans to make cancelling them the default; pin today's behaviour.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_prefetch_multiplier": get_int(env, "CELERY_PREFETCH_MULTIPLIER"),
        "broker_connection_retry_on_startup": True,
        # Flower shows received/started/succeeded only if workers send events.
        "worker_send_task_events": True,
        # A "sent" event is a second Redis publish on every admission (about a
        # third of the enqueue's cost); Flower does not need it. Opt in here.
        "task_send_sent_event": get_str(env, "POIMEN_SEND_SENT_EVENTS") == "1",
        # SIGTERM: Celery's soft shutdown (with REMAP_SIGTERM=SIGQUIT) also keeps
        # a 5 s run from restarting, but sleeps its whole timeout whatever runs
        # finish sooner; pool processes survive SIGTERM by workers/shutdown.py
        # instead (docs/internals/reliability.md, row 5; measured in bench/RESULTS.md).
        "worker_soft_shutdown_timeout": 0.0,
        # POIMEN_WORKER_MODE=batch: Celery's threads pool, whose runs' claims and finishes
        # the store batcher sends many at once (docs/internals/batching.md).
        "worker_pool": "threads" if worker_mode(env) == "batch" else "prefork",
        "worker_hijack_root_logger": False,
        "timezone": "UTC",
        "enable_utc": True,
    }
