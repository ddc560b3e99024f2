"""The worker's queues on RabbitMQ, checked at start against what the broker holds.

A queue's arguments (``x-max-priority``: ``POIMEN_QUEUE_MAX_PRIORITY`` or Celery's
``task_queue_max_priority``) are fixed when RabbitMQ creates it: declaring an existing
queue with other arguments fails with ``PRECONDITION_FAILED - inequivalent arg``.
Celery would stop on it too, with a traceback; this says which queue, what was asked
and what to do (docs/operations/rabbitmq.md, "Priorities").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celeryconfig import AMQP_SCHEMES, broker_scheme

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)


class QueueArgumentsRefused(RuntimeError):
    """RabbitMQ holds a queue of this name with other arguments than this process declares."""


def check_queue_arguments(celery_app: Celery, queues: Sequence[Any] | None = None) -> None:
    """Declare ``queues`` (kombu ``Queue``s; default: those the worker consumes) as Celery
    will; raise :class:`QueueArgumentsRefused` if RabbitMQ refuses one's arguments. Does nothing on
    another broker, or when the broker does not answer (the worker's own retries wait)."""
    if broker_scheme(celery_app.conf.broker_url) not in AMQP_SCHEMES:
        return
    from amqp.exceptions import PreconditionFailed

    if queues is None:
        queues = list(celery_app.amqp.queues.consume_from.values())
    with celery_app.connection_for_write() as connection:
        try:
            connection.ensure_connection(max_retries=1)
        except Exception:  # noqa: BLE001 - unreachable now: the consumer's retries handle it
            return
        for queue in queues:
            channel = connection.channel()  # a refused declare closes its channel
            try:
                queue(channel).declare()
            except PreconditionFailed as err:
                raise QueueArgumentsRefused(
                    f"RabbitMQ refuses to declare queue {queue.name!r} with the arguments "
                    f"{dict(queue.queue_arguments or {})}: it exists with others ({err.reply_text}). "
                    "A queue's arguments cannot change; POIMEN_QUEUE_MAX_PRIORITY (or Celery's "
                    "task_queue_max_priority) must match the queue, or the queue must be "
                    "drained and deleted, or a new POIMEN_QUEUE used "
                    "(docs/operations/rabbitmq.md, Priorities)") from None
            finally:
                try:
                    channel.close()
                except Exception:  # noqa: BLE001 - already closed by the broker
                    pass
