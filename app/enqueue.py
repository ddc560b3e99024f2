"""Send runs to Celery only after the transaction that admitted them commits.

A message sent before commit can reach a worker before the row is visible (or
for a row that is then rolled back); a message sent after a failed commit runs
nothing. So admission only *registers* the run on the session, and these hooks
hand it on ``after_commit`` and forget it on ``after_rollback``.

The broker is off the request path: ``after_commit`` puts the run on this
process's *sender*, a thread that publishes what has queued up through one
producer connection, in order, as one pipelined write on Redis. A request
never waits on Redis, and a hung or black-holed broker cannot pin request
threads or the database pool. A send
that fails, or a process that dies between commit and send, strands nothing:
the sender retries while its backlog lasts, ``beat`` re-sends queued runs whose
last send is old, and a replay of the run's key re-sends it too (workers'
claims absorb duplicates).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import uuid

from flask import current_app
from sqlalchemy import event
from sqlalchemy.orm import Session

from workers import registry

from . import telemetry
from .state.compose import PENDING_SENDS
from .task_names import EXECUTE_RUN, execute_shadow
from .tracecontext import TraceContext

log = logging.getLogger(__name__)

# Transitions leave their runs to send on the session (``app/state/compose.py``:
# ``send_after_commit``); the hooks below send them after commit.
_PENDING = PENDING_SENDS


def send_run(celery_app, run_id: uuid.UUID, workflow_ref: str, countdown: float | None = None,
             trace: TraceContext | None = None) -> bool:
    """Publish one ``runs.execute`` message now (repair, retries); False if the broker failed."""
    try:
        _publish(celery_app, run_id, workflow_ref, countdown, trace=trace)
        return True
    except Exception:  # noqa: BLE001 - the broker is down; beat repairs queued runs
        log.exception("could not enqueue run %s; beat will re-send it", run_id)
        return False


def _publish(celery_app, run_id: uuid.UUID, workflow_ref: str, countdown: float | None,
             producer=None, trace: TraceContext | None = None, declare: list | None = None
             ) -> None:
    """One ``runs.execute`` message; task id = run id so Flower shows the run.

    The run's W3C Trace Context travels as the message headers ``traceparent``
    and ``tracestate`` (where OpenTelemetry's Celery instrumentation looks too),
    on every message of the run: admission's, a replay's, repair's, a retry's.
    """
    # Inside the run's own trace context: OpenTelemetry's Celery instrumentation (when
    # on) replaces the message's traceparent with its publish span's, which must
    # belong to the run's trace, not to whatever this thread traces (a repair tick).
    run = str(run_id)
    with telemetry.continuing(trace):
        celery_app.send_task(
            EXECUTE_RUN,
            args=[run],
            task_id=run,
            # What Flower shows as the arguments, written here: Celery's saferepr of
            # the args costs a tenth of a send.
            argsrepr=f"['{run}']",
            kwargsrepr="{}",
            # None: Celery declares the queue at every send; the sender declares each
            # queue once per batch and passes [] (``Sender._run``).
            declare=declare,
            countdown=countdown,
            producer=producer,
            # Shown by Flower next to the task: which workflow this run is.
            shadow=execute_shadow(workflow_ref),
            headers=trace.headers() if trace is not None else None,
            **_routing(workflow_ref),
        )


def queue_of(celery_app, workflow_ref: str) -> str:
    """The Celery queue ``workflow_ref``'s runs are sent to (what ``send_run`` does)."""
    return _routing(workflow_ref).get("queue") or celery_app.conf.task_default_queue


def _routing(workflow_ref: str) -> dict:
    """The workflow's queue, time limits and priority (``@workflow(queue=...)``), if set.

    Every send (admission's sender, retries, repair, replays) goes through
    ``_publish``, so a run's every message goes where its workflow says. A
    version this process does not have (a rolling deploy) goes to the default queue.
    """
    try:
        return registry.resolve(workflow_ref).send_options()
    except registry.UnknownWorkflow:
        return {}


class Sender:
    """One thread per process that publishes committed runs, in batches, off the request path."""

    # Sends that wait longer than this are dropped to beat's repair; a broker outage
    # must not grow the process's memory without bound.
    MAX_BACKLOG = 10_000

    def __init__(self, celery_app):
        self.celery_app = celery_app
        self.queue: queue.Queue[tuple[uuid.UUID, str, TraceContext | None]] = queue.Queue()
        self.pid = os.getpid()
        self.pending = 0  # handed over, not yet published or given up
        self.changed = threading.Condition()
        threading.Thread(target=self._run, name="poimen-sender", daemon=True).start()

    def put(self, run_id: uuid.UUID, workflow_ref: str, trace: TraceContext | None = None
            ) -> None:
        if self.queue.qsize() >= self.MAX_BACKLOG:
            log.warning("sender backlog full; run %s is left to beat's repair", run_id)
            return
        with self.changed:
            self.pending += 1
        self.queue.put((run_id, workflow_ref, trace))

    def wait_idle(self, timeout: float) -> bool:
        """Wait until everything handed over so far was published or given up (tests, shutdown)."""
        with self.changed:
            return self.changed.wait_for(lambda: self.pending == 0, timeout)

    def _done(self, count: int) -> None:
        with self.changed:
            self.pending -= count
            self.changed.notify_all()

    def _run(self) -> None:
        backoff = 0.1
        batch: list[tuple[uuid.UUID, str, TraceContext | None]] = []
        while True:
            if not batch:
                batch.append(self.queue.get())
            while len(batch) < 500:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                with self.celery_app.producer_or_acquire() as producer:
                    # One pipelined write for the batch on Redis (kombu's Producer.batch;
                    # a transport without it, RabbitMQ, publishes each at once). It is
                    # all or nothing as far as we know: after an error the whole batch
                    # is sent again, and a message that did go is a duplicate the
                    # claim absorbs.
                    # max_size counts Redis commands: a publish may add a PEXPIRE to its LPUSH.
                    with producer.batch(max_size=len(batch) * 2):
                        # Each queue of the batch declared once, not at every send
                        # (a fifth of a send's CPU).
                        queues = self.celery_app.amqp.queues
                        for name in {queue_of(self.celery_app, ref) for _, ref, _ in batch}:
                            producer.maybe_declare(queues[name])
                        for run_id, ref, trace in batch:
                            _publish(self.celery_app, run_id, ref, None, producer, trace,
                                     declare=[])
                self._done(len(batch))
                batch.clear()
                backoff = 0.1
            except Exception as err:  # noqa: BLE001 - the broker is away: keep the batch, retry
                log.warning("could not send %d run(s) to the broker (%s); retrying in %.1fs",
                            len(batch), type(err).__name__, backoff)
                time.sleep(backoff)
                backoff = min(5.0, backoff * 2)
                if self.queue.qsize() + len(batch) > self.MAX_BACKLOG:
                    log.error("sender backlog over %d; %d run(s) left to beat's repair",
                              self.MAX_BACKLOG, len(batch))
                    self._done(len(batch))
                    batch.clear()


_sender: Sender | None = None
_sender_lock = threading.Lock()


def sender(celery_app) -> Sender:
    """This process's sender (a new one after a fork: threads do not survive it)."""
    global _sender
    with _sender_lock:
        if _sender is None or _sender.pid != os.getpid() or _sender.celery_app is not celery_app:
            _sender = Sender(celery_app)
            # On a clean exit (SIGTERM of a deploy) give what is queued a moment to go
            # out; what does not is re-sent by beat's repair.
            atexit.register(_sender.wait_idle, 2.0)
        return _sender


@event.listens_for(Session, "after_commit")
def _send_after_commit(session: Session) -> None:
    pending = session.info.pop(_PENDING, None)
    if pending:
        send_pending(pending)


def send_pending(pending: dict) -> None:
    """Hand the runs a committed write left to send (``compose.send_after_commit``) to this
    process's sender: the session's ``after_commit``, and ``state.direct``'s statements."""
    out = sender(current_app.extensions["celery"])
    for run_id, (workflow_ref, traceparent, tracestate) in pending.items():
        out.put(run_id, workflow_ref,
                TraceContext(traceparent, tracestate) if traceparent else None)


@event.listens_for(Session, "after_rollback")
def _forget_after_rollback(session: Session) -> None:
    # Fires on the real database rollback only, not on a savepoint's.
    session.info.pop(_PENDING, None)
