"""Celery task events in batches: a publish every ``POIMEN_EVENT_FLUSH_INTERVAL``, not per event.

Celery's worker buffers its task events (``task-received``, ``-started``,
``-succeeded`` ...) and asks its event loop to flush the buffer at the loop's
next turn. Under load a turn holds about one event, and on Redis each flush is
a ``PUBLISH`` round trip (with a new redis-py client), so every run cost the
worker's main process three round trips for monitoring alone: 45 % of its
samples under ``bench/execution.py`` (py-spy; bench/RESULTS.md), while the pool
processes waited for it to hand them their next run.

This consumer step takes that per-event flush away and flushes on the
consumer's timer instead, every ``POIMEN_EVENT_FLUSH_INTERVAL`` seconds (0.1),
and at once whenever Celery's buffer limit (24 events) is reached. Flower and
``celery events`` receive the same events, in the same order, with the
timestamps of the moment they happened, at most an interval later. What is
buffered when the consumer stops is published before Celery closes the
dispatcher (this step stops before the ``Events`` step it requires). Events are
monitoring, not state: a run's state and its events on Kafka come from
Postgres and the outbox, never from these.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps


class TaskEventBatches(bootsteps.StartStopStep):  # type: ignore[misc]  # celery: untyped
    """Flush the worker's buffered task events on a timer instead of at every loop turn."""

    requires = {"celery.worker.consumer.events:Events"}

    # parent, c: Celery's worker consumer (untyped).
    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None  # kombu's timer entry

    def start(self, c: Any) -> None:
        interval = c.app.flask_app.config["POIMEN_EVENT_FLUSH_INTERVAL"]
        dispatcher = c.event_dispatcher
        # Celery buffers task events only under its event loop (the hub); elsewhere it
        # publishes each at once and there is nothing to batch.
        if interval <= 0 or dispatcher is None or c.hub is None:
            return
        # Events (re)creates the dispatcher at every consumer start, with the per-event
        # flush; this step starts after it, every time.
        dispatcher.on_send_buffered = None
        self._timer = c.timer.call_repeatedly(interval, self._flush, (c,))

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._flush(c)

    shutdown = stop

    @staticmethod
    def _flush(c: Any) -> None:
        # The consumer's current dispatcher: a reconnect replaces it.
        dispatcher = c.event_dispatcher
        if dispatcher is not None:
            dispatcher.flush()
