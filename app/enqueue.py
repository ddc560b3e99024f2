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
import base64
import contextlib
import json
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from typing import NamedTuple

from flask import current_app
from sqlalchemy import event
from sqlalchemy.orm import Session

from workers import registry

from . import telemetry
from .state.compose import tree_of as compose_tree_of
from .state.executor import Send, forget_pending, take_pending
from .task_names import EXECUTE_RUN, execute_shadow
from .tracecontext import TraceContext

log = logging.getLogger(__name__)

# Transitions leave their runs to send on their executor (``app/state/executor.py``:
# ``pending``); for a session, the hooks below send them after commit.


class Tree(NamedTuple):
    """What a run's message tells Celery (and Flower) of the run: ``retries``, the executions
    it started before this one (its ``attempt``), and its place in the run tree:
    ``parent_id``, the run that fanned it out, and ``root_id``, the tree's root (None: the
    run itself, as Celery writes for a task sent outside any task)."""

    retries: int = 0
    parent_id: str | None = None
    root_id: str | None = None


TOP = Tree()  # a top-level run's first message


def tree_of(row) -> Tree:
    """The ``Tree`` of the run ``row`` (``compose.tree_of``: attempt, parent, root columns)."""
    return Tree(*compose_tree_of(row))


def send_run(celery_app, run_id: uuid.UUID, workflow_ref: str, countdown: float | None = None,
             trace: TraceContext | None = None, tree: Tree = TOP) -> bool:
    """Publish one ``runs.execute`` message now (repair, retries); False if the broker failed."""
    try:
        _publish(celery_app, run_id, workflow_ref, countdown, trace=trace, tree=tree)
        return True
    except Exception:  # noqa: BLE001 - the broker is down; beat repairs queued runs
        log.exception("could not enqueue run %s; beat will re-send it", run_id)
        return False


def _publish(celery_app, run_id: uuid.UUID, workflow_ref: str, countdown: float | None,
             producer=None, trace: TraceContext | None = None, declare: list | None = None,
             tree: Tree = TOP) -> None:
    """One ``runs.execute`` message; task id = run id so Flower shows the run.

    The run's W3C Trace Context travels as the message headers ``traceparent``
    and ``tracestate`` (where OpenTelemetry's Celery instrumentation looks too),
    on every message of the run: admission's, a replay's, repair's, a retry's.
    Celery's ``retries``, ``parent_id`` and ``root_id`` are the run's (``tree``), never
    the task this thread runs (a worker's run that fans out or retries, beat's repair),
    which ``send_task`` would take as the parent.
    """
    # Inside the run's own trace context: OpenTelemetry's Celery instrumentation (when
    # on) replaces the message's traceparent with its publish span's, which must
    # belong to the run's trace, not to whatever this thread traces (a repair tick).
    run = str(run_id)
    with telemetry.continuing(trace), _sent_as_run(tree):
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
            retries=tree.retries,
            root_id=tree.root_id or run,
            parent_id=tree.parent_id,
            # Not a result of the task this thread runs (its request's children).
            add_to_parent=False,
            **{**_task_options(celery_app), **_routing(workflow_ref)},
        )


class _TreeParent:
    """The run tree as ``send_task`` looks for a parent: its ``current_worker_task``.

    Celery fills a message's missing ``parent_id`` (and ``root_id``) from the task the
    thread runs; a top-level run's message has no parent, so when this thread runs a
    task, this stands on top of Celery's task stack for the send: its request's ``id``
    (None) is the parent Celery writes."""

    __slots__ = ("request",)

    class _Request:
        __slots__ = ("id", "root_id", "called_directly", "delivery_info")

        def __init__(self, parent_id: str | None, root_id: str | None):
            self.id, self.root_id = parent_id, root_id
            self.called_directly = False
            self.delivery_info: dict = {}

    def __init__(self, tree: Tree):
        self.request = self._Request(tree.parent_id, tree.root_id)


@contextlib.contextmanager
def _sent_as_run(tree: Tree):
    """Make ``send_task``'s parent lookup find ``tree``, not this thread's task."""
    from celery._state import _task_stack

    if tree.parent_id is not None or _task_stack.top is None:
        yield  # a child names both, or no task runs here: Celery looks nothing up
        return
    _task_stack.push(_TreeParent(tree))
    try:
        yield
    finally:
        _task_stack.pop()


def _task_options(celery_app) -> dict:
    """``runs.execute``'s own send options (its serializer, priority, time limits, ... from
    Celery's ``task_*`` settings and ``task_annotations``), which ``send_task`` adds only in
    a process that has the task: a worker's retries and repairs. Passed by every send, so
    the web process, which has no task, sends the same message; a workflow's own options
    (``_routing``) win over them, as ``send_task``'s explicit options do."""
    task = celery_app._tasks.get(EXECUTE_RUN)  # not .tasks: that would finalize the app
    if task is None:
        task = _stand_ins.get(celery_app)
        if task is None:
            # The worker's task as Celery binds it (from_config, annotate), without its code.
            stand_in = type("execute", (celery_app.Task,), {
                "name": EXECUTE_RUN, "__module__": __name__, "run": staticmethod(_never)})
            stand_in.bind(celery_app)
            task = _stand_ins[celery_app] = stand_in()
    return {key: value for key, value in task._get_exec_options().items() if value is not None}


def _never(*_args, **_kwargs):
    raise RuntimeError("runs.execute runs in a worker")


_stand_ins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


class RedisWire:
    """``runs.execute`` messages written to Redis as kombu's Redis transport writes them.

    A ``send_task`` costs about 0.18 ms of CPU per message even in a pipelined batch
    (Celery's routing, result object and parent lookups, kombu's ``Producer.publish``
    and ``basic_publish``), most of an admission's send. This writes the same
    message: its headers, properties and body come from Celery's own
    ``create_task_message`` (protocol 2, what ``send_task`` calls), wrapped in the
    envelope kombu's Redis channel writes (``prepare_message``, base64 body,
    ``delivery_info``, a ``delivery_tag``) and ``LPUSH``ed to the queue's list in the
    batch's one pipeline. ``tests/app/test_redis_wire.py`` keeps it equal to
    ``send_task``'s message field by field.

    Only where that is the whole of what ``send_task`` would do: a Redis broker, a
    direct queue without an expiry or key prefix, priority 0, no "sent" events and no
    receiver of Celery's publish signals (OpenTelemetry's instrumentation is one), and
    a message equal to the one ``send_task`` writes under the live configuration (a
    workflow module may set a serializer, compression, routes, annotations, a default
    priority, message signing: ``_unlike_send_task`` compares the two at a workflow's
    first message). Everything else is sent by ``send_task`` (``usable`` and
    ``_template`` say which, and the log says why, once).
    """

    def __init__(self, celery_app, channel):
        self.celery_app = celery_app
        self.channel = channel
        self.amqp = celery_app.amqp
        from kombu.entity import maybe_delivery_mode

        self.delivery_mode = maybe_delivery_mode(celery_app.conf.task_default_delivery_mode)
        # The channel's own connection pool and settings (kombu's conn_or_acquire builds a
        # client per call: a tenth of a millisecond for each batch).
        self.client = channel._create_client()
        # (workflow ref, trace header names) -> _Template, or None / _COMPOSE.
        self._templates: dict[tuple[str, tuple[str, ...]], object] = {}
        self._connection = None  # taken from the client's pool at the first write, kept
        self._lock = threading.Lock()

    def write(self, commands: list[tuple]) -> None:
        """Send ``commands`` in one write and read their replies; raise the first error.

        On a connection of the channel's pool that the wire keeps. As the pool's checkout
        does, one the server has spoken on since (closed it: a restart, a CLIENT KILL, an
        idle timeout) is connected afresh before the write; a write that fails gets the
        connection's own retry (the channel's setting), then the caller's. redis-py's
        ``execute_command`` and pipelines around the same write (a pool checkout and
        release, metrics, response callbacks) cost as much CPU again as the write."""
        from redis import exceptions as redis_exceptions  # not at import: it loads OpenTelemetry

        with self._lock:
            if self._connection is None:
                self._connection = self.client.connection_pool.get_connection()
            connection = self._connection
            if _spoke(connection):
                connection.disconnect()  # send_packed_command connects again
            try:
                connection.retry.call_with_retry(lambda: _write(connection, commands),
                                                 lambda _error: connection.disconnect())
            except redis_exceptions.ResponseError:
                raise  # every reply was read: the connection is in step
            except BaseException:
                connection.disconnect()  # replies may be left unread: start afresh
                raise

    @staticmethod
    def usable(celery_app, channel) -> bool:
        """Whether a batch on ``channel`` may be written as wire messages (why not is
        logged once per process)."""
        if getattr(channel, "_q_for_pri", None) is None:
            return False  # not kombu's Redis transport: no wire at all
        why = _steps_aside(celery_app, channel)
        if why is not None:
            _tell_once(None, why)
            return False
        return True

    def message(self, run_id: uuid.UUID, workflow_ref: str, trace: TraceContext | None,
                tree: Tree = TOP) -> tuple[str, str] | None:
        """``(list key, payload)`` of the run's message, or None where ``send_task`` must send it."""
        extra = trace.headers() if trace is not None else {}
        key = (workflow_ref, tuple(extra))
        template = self._templates.get(key, _UNKNOWN)
        if template is _UNKNOWN:
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.clear()
            template = self._templates[key] = self._template(workflow_ref, tuple(extra))
        run = str(run_id)
        if template is None:  # not a wire message: send_task sends it
            return None
        if template is _COMPOSE:  # no template could be made: every field composed
            return self._compose(run, workflow_ref, extra, self.celery_app.thread_oid,
                                 str(uuid.uuid4()), tree)
        return template.render(run, extra, self.celery_app.thread_oid, str(uuid.uuid4()), tree)

    def _template(self, workflow_ref: str, extra_names: tuple[str, ...]):
        """The message of ``workflow_ref``'s runs with its per-message values left out,
        None if they are not wire messages, ``_COMPOSE`` if no template matches what
        ``_compose`` writes (then every message is composed)."""
        values = {name: _PLACEHOLDER_VALUE + name for name in extra_names}
        composed = self._compose(_PLACEHOLDER_RUN, workflow_ref, values, _PLACEHOLDER_REPLY,
                                 _PLACEHOLDER_TAG, _PLACEHOLDER_TREE)
        if composed is None:
            return None
        why = self._unlike_send_task(workflow_ref, extra_names)
        if why is not None:
            _tell_once(workflow_ref, why)
            return None
        template = _Template(*composed, extra_names)
        # The template must write what composing writes, byte for byte: tried once
        # with other values (a field that transformed the run id would differ here).
        run, reply, tag = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
        sample = {name: f"v-{name}-{uuid.uuid4().hex}" for name in extra_names}
        tree = Tree(3, str(uuid.uuid4()), str(uuid.uuid4()))
        if template.render(run, sample, reply, tag, tree) != self._compose(
                run, workflow_ref, sample, reply, tag, tree):
            log.warning("the wire message of %s has no template; composing each", workflow_ref)
            return _COMPOSE
        return template

    def _unlike_send_task(self, workflow_ref: str, extra_names: tuple[str, ...]) -> str | None:
        """Why ``send_task`` under the live configuration writes another message than the
        wire for ``workflow_ref``'s runs (the settings that differ), or None if it writes
        the same.

        The reference is ``_publish`` itself (what the fallback sends) run into a
        ``_Capture`` of the wire's channel: Celery's routing, annotations, priority,
        serializer, compression and signing, then kombu's ``Producer.publish`` and the
        channel's envelope, everything but the write. Compared field by field with the
        wire's message of the same run, trace headers and reply-to; only the delivery tag,
        a fresh id per message, is left out."""
        from celery.app.routes import MapRoute
        from kombu import Producer
        from kombu.utils.json import dumps

        if any(not isinstance(route, MapRoute) for route in self.amqp.router.routes):
            # A router may route each message by its arguments (the run id): one
            # sample does not show where the next one goes.
            return "task_routes has a router function"
        run = uuid.uuid4()
        trace = _sample_trace(extra_names)
        extra = trace.headers() if trace is not None else {}
        reply_to = self.celery_app.thread_oid
        wire = self._compose(str(run), workflow_ref, extra, reply_to, _PLACEHOLDER_TAG)
        capture = _Capture(self.channel)
        try:
            _publish(self.celery_app, run, workflow_ref, None,
                     Producer(capture, auto_declare=False), trace, declare=[])
        except Exception as err:  # noqa: BLE001 - send_task sends, and says so itself
            return f"send_task raised {type(err).__name__} composing its message"
        if len(capture.published) != 1:
            return f"send_task publishes {len(capture.published)} messages"
        message, exchange, routing_key = capture.published[0]
        if exchange:
            return f"send_task publishes to exchange {exchange!r}, not to the queue's list"
        if routing_key in self.channel._expires:
            return f"queue {routing_key!r} has an expiry"
        key = self.channel._q_for_pri(
            routing_key, self.channel._get_message_priority(message, reverse=False))
        reference = json.loads(dumps(message))
        reference["properties"].pop("delivery_tag", None)
        ours = json.loads(wire[1])
        ours["properties"].pop("delivery_tag", None)
        fields = _differing((), reference, ours)
        if key != wire[0]:
            fields.insert(0, "the list key")
        if not fields:
            return None
        hints = sorted({hint for field in fields for hint in _HINTS.get(field, ())})
        return (f"send_task's message differs in {', '.join(fields)}"
                + (f" (set by {', '.join(hints)})" if hints else ""))

    def _compose(self, run: str, workflow_ref: str, extra: dict[str, str], reply_to: str,
                 delivery_tag: str, tree: Tree = TOP) -> tuple[str, str] | None:
        """The message, every field composed: Celery's ``create_task_message`` in kombu's
        envelope. ``extra``: the trace headers; ``tree``: retries, parent and root."""
        options = _routing(workflow_ref)
        if options.get("priority"):
            return None
        qname = options.get("queue") or self.celery_app.conf.task_default_queue
        declared = self.amqp.queues[qname]
        if declared.exchange.type != "direct" or qname in self.channel._expires:
            return None
        argsrepr = f"['{run}']"
        headers, properties, body, _ = self.amqp.create_task_message(
            run, EXECUTE_RUN, [run], None, reply_to=reply_to,
            time_limit=options.get("time_limit"),
            soft_time_limit=options.get("soft_time_limit"),
            shadow=execute_shadow(workflow_ref), argsrepr=argsrepr, kwargsrepr="{}",
            ignore_result=None, retries=tree.retries, root_id=tree.root_id or run,
            parent_id=tree.parent_id)
        headers.update(extra)
        delivery_mode = (self.delivery_mode if declared.exchange.delivery_mode is None
                         else declared.exchange.delivery_mode)
        envelope = {
            "body": base64.b64encode(json.dumps(body).encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                **properties, "argsrepr": argsrepr, "kwargsrepr": "{}",
                "delivery_mode": delivery_mode,
                # send_task's "anonymous exchange" for a direct queue: straight to its list.
                "delivery_info": {"exchange": "", "routing_key": qname},
                "priority": 0, "body_encoding": "base64",
                "delivery_tag": delivery_tag,
            },
        }
        return self.channel._q_for_pri(qname, 0), json.dumps(envelope)


def _steps_aside(celery_app, channel) -> str | None:
    """Why no message on ``channel`` may be a wire message (what ``send_task`` does that
    the wire cannot), or None: a key prefix, "sent" events, a publish signal's receiver
    (OpenTelemetry's Celery instrumentation is one)."""
    from celery import signals

    if getattr(channel, "global_keyprefix", ""):
        return "the Redis transport has a global_keyprefix"
    if celery_app.conf.task_send_sent_event:
        return "task_send_sent_event is on"
    for signal in (signals.before_task_publish, signals.after_task_publish, signals.task_sent):
        if signal.receivers:
            return f"a {signal.name} receiver is connected"
    return None


_told: set[tuple[str | None, str]] = set()
_told_lock = threading.Lock()


def _tell_once(workflow_ref: str | None, why: str) -> None:
    """Log once per process (per workflow route and reason) that ``send_task`` sends
    instead of the wire. Names settings and the workflow, no run's data."""
    with _told_lock:
        if (workflow_ref, why) in _told or len(_told) >= _MAX_TEMPLATES:
            return
        _told.add((workflow_ref, why))
    if workflow_ref is None:
        log.info("the sender publishes every run with send_task: %s", why)
    else:
        log.info("the sender publishes the runs of %s with send_task: %s", workflow_ref, why)


# A differing field of the message -> the settings that set it.
_HINTS = {
    "the list key": ("task_routes", "the workflow's queue", "a priority"),
    "content-type": ("task_serializer",),
    "content-encoding": ("task_serializer",),
    "body": ("task_serializer", "task_compression", "message signing"),
    "headers.compression": ("task_compression",),
    "properties.priority": ("task_default_priority", "task_routes", "task_annotations"),
    "properties.delivery_info.exchange": ("task_routes",),
    "properties.delivery_info.routing_key": ("task_routes",),
    "properties.delivery_mode": ("task_default_delivery_mode",),
}


def _differing(path: tuple[str, ...], reference, ours) -> list[str]:
    """The dotted names of the fields where ``ours`` is not ``reference`` (names only: a
    value may be a run's)."""
    if isinstance(reference, dict) and isinstance(ours, dict):
        fields = []
        for name in sorted(set(reference) | set(ours)):
            if name not in reference or name not in ours:
                fields.append(".".join((*path, name)))
            else:
                fields.extend(_differing((*path, name), reference[name], ours[name]))
        return fields
    return [] if reference == ours else [".".join(path)]


def _sample_trace(names: tuple[str, ...]) -> TraceContext | None:
    """A made-up trace context carrying the headers ``names``."""
    if not names:
        return None
    return TraceContext(f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01",
                        "poimen=check" if "tracestate" in names else None)


class _Capture:
    """A kombu channel that keeps what is published on it instead of writing it: every
    attribute is the wrapped channel's but ``basic_publish``, which puts kombu's envelope
    on the message (``_inplace_augment_message``, as the channel's own publish does) and
    stops there. Nothing reaches Redis, nor the wrapped channel's state."""

    def __init__(self, channel):
        self._channel = channel
        self.published: list[tuple[dict, str, str]] = []

    def __getattr__(self, name):
        return getattr(self._channel, name)

    def basic_publish(self, message, exchange, routing_key, **_kwargs):
        self._channel._inplace_augment_message(message, exchange, routing_key)
        self.published.append((message, exchange, routing_key))


# Stand-ins for a message's own values in a template (JSON strings needing no escape,
# found nowhere else in a message).
_PLACEHOLDER_RUN = "00000000-poimen-run-0000"
_PLACEHOLDER_REPLY = "00000000-poimen-reply-0000"
_PLACEHOLDER_TAG = "00000000-poimen-tag-0000"
_PLACEHOLDER_BODY = "00000000-poimen-body-0000"
_PLACEHOLDER_VALUE = "00000000-poimen-header-"
# A tree's: written by _compose as JSON strings, the retries and parent in place of a number
# and a null-or-string (the template puts each in with its quotes).
_PLACEHOLDER_TREE = Tree("00000000-poimen-retries-0000",  # type: ignore[arg-type]
                         "00000000-poimen-parent-0000", "00000000-poimen-root-0000")
_RETRIES = f'"{_PLACEHOLDER_TREE.retries}"'
_PARENT = f'"{_PLACEHOLDER_TREE.parent_id}"'
_UNKNOWN = object()
_COMPOSE = object()
_MAX_TEMPLATES = 256  # workflow refs x trace header sets; past it the cache starts over


class _Template:
    """A wire message of one workflow (and set of trace headers) with its per-message
    values (run id, reply-to, delivery tag, trace headers, retries, parent and root, the
    base64 body) as placeholders: a message is the template's text with the values put in.

    Composing costs ~57 us per message (Celery's ``create_task_message``, the workflow's
    routing, the envelope's ``json.dumps``); putting eight values in a text, a few."""

    __slots__ = ("key", "text", "body_prefix", "body_suffix", "extra_names")

    def __init__(self, key: str, payload: str, extra_names: tuple[str, ...]):
        self.key = key
        envelope = json.loads(payload)
        body = base64.b64decode(envelope["body"]).decode()
        self.body_prefix, self.body_suffix = body.split(_PLACEHOLDER_RUN)
        self.text = payload.replace(envelope["body"], _PLACEHOLDER_BODY, 1)
        self.extra_names = extra_names

    def render(self, run: str, extra: dict[str, str], reply_to: str, delivery_tag: str,
               tree: Tree = TOP) -> tuple[str, str]:
        body = base64.b64encode(
            f"{self.body_prefix}{run}{self.body_suffix}".encode()).decode()
        text = (self.text.replace(_PLACEHOLDER_BODY, body, 1).replace(_PLACEHOLDER_RUN, run)
                .replace(_PLACEHOLDER_REPLY, reply_to).replace(_PLACEHOLDER_TAG, delivery_tag)
                .replace(_RETRIES, str(int(tree.retries)), 1)
                .replace(_PARENT, json.dumps(tree.parent_id), 1)
                .replace(_PLACEHOLDER_TREE.root_id, tree.root_id or run, 1))
        for name in self.extra_names:
            # JSON-escaped as json.dumps writes it (a trace header is ASCII already).
            text = text.replace(_PLACEHOLDER_VALUE + name, json.dumps(extra[name])[1:-1], 1)
        return self.key, text


class Sender:
    """One thread per process that publishes committed runs, in batches, off the request path."""

    # Sends that wait longer than this are dropped to beat's repair; a broker outage
    # must not grow the process's memory without bound.
    MAX_BACKLOG = 10_000

    def __init__(self, celery_app):
        self.celery_app = celery_app
        self.queue: queue.Queue[tuple[uuid.UUID, str, TraceContext | None, Tree]] = queue.Queue()
        self.pid = os.getpid()
        self.pending = 0  # handed over, not yet published or given up
        self.changed = threading.Condition()
        self.declared: set[str] = set()  # queues declared since the last error
        # One wire (and its Redis client) per producer channel; a channel kombu drops
        # takes its wire with it.
        self.wires: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.wire: RedisWire | None = None  # the last batch's, for ``_write_direct``
        threading.Thread(target=self._run, name="poimen-sender", daemon=True).start()

    def put(self, run_id: uuid.UUID, workflow_ref: str, trace: TraceContext | None = None,
            tree: Tree = TOP) -> None:
        if self.queue.qsize() >= self.MAX_BACKLOG:
            log.warning("sender backlog full; run %s is left to beat's repair", run_id)
            return
        with self.changed:
            self.pending += 1
        self.queue.put((run_id, workflow_ref, trace, tree))

    def wait_idle(self, timeout: float) -> bool:
        """Wait until everything handed over so far was published or given up (tests, shutdown)."""
        with self.changed:
            return self.changed.wait_for(lambda: self.pending == 0, timeout)

    def _done(self, count: int) -> None:
        with self.changed:
            self.pending -= count
            self.changed.notify_all()

    def _send(self, producer, batch: list[tuple[uuid.UUID, str, TraceContext | None, Tree]]) -> None:
        # Each queue declared once while sends succeed, not at every send or batch (kombu's
        # maybe_declare re-binds the queue each time: a fifth of a send's CPU). An error
        # forgets them all (``_run``), so a broker that lost its state is declared again.
        queues = self.celery_app.amqp.queues
        for name in {queue_of(self.celery_app, item[1]) for item in batch} - self.declared:
            producer.maybe_declare(queues[name])
            self.declared.add(name)
        rest = batch
        channel = producer.channel
        if RedisWire.usable(self.celery_app, channel):
            wire = self.wires.get(channel)
            if wire is None:
                wire = self.wires[channel] = RedisWire(self.celery_app, channel)
            written, rest = [], []
            for item in batch:
                message = wire.message(*item)
                if message is None:
                    rest.append(item)
                else:
                    written.append(message)
            if written:
                _lpush(wire, written)
                self.wire = wire
        if not rest:
            return
        # One pipelined write for the batch on Redis (kombu's Producer.batch; a transport
        # without it, RabbitMQ, publishes each at once). It is all or nothing as far as we
        # know: after an error the whole batch is sent again, and a message that did go
        # is a duplicate the claim absorbs.
        # max_size counts Redis commands: a publish may add a PEXPIRE to its LPUSH.
        with producer.batch(max_size=len(rest) * 2):
            for run_id, ref, trace, tree in rest:
                _publish(self.celery_app, run_id, ref, None, producer, trace, declare=[],
                         tree=tree)

    def _write_direct(self, batch: list[tuple[uuid.UUID, str, TraceContext | None, Tree]]) -> bool:
        """Write ``batch`` with the wire of the last batch, without a producer; False
        (nothing written) unless every run goes out as a wire message to a queue declared
        since the last error. A producer's checkout from kombu's pool (and its release)
        costs more than a small batch's write."""
        wire = self.wire
        if wire is None or not RedisWire.usable(self.celery_app, wire.channel):
            return False
        written = []
        for item in batch:
            message = wire.message(*item)
            # A priority-0 message's list is its queue's name (kombu's ``_q_for_pri``).
            if message is None or message[0] not in self.declared:
                return False
            written.append(message)
        _lpush(wire, written)
        return True

    def _run(self) -> None:
        backoff = 0.1
        batch: list[tuple[uuid.UUID, str, TraceContext | None, Tree]] = []
        while True:
            if not batch:
                batch.append(self.queue.get())
            while len(batch) < 500:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if not self._write_direct(batch):
                    with self.celery_app.producer_or_acquire() as producer:
                        self._send(producer, batch)
                self._done(len(batch))
                batch.clear()
                backoff = 0.1
            except Exception as err:  # noqa: BLE001 - the broker is away: keep the batch, retry
                self.declared.clear()
                self.wire = None
                log.warning("could not send %d run(s) to the broker (%s); retrying in %.1fs",
                            len(batch), type(err).__name__, backoff)
                time.sleep(backoff)
                backoff = min(5.0, backoff * 2)
                if self.queue.qsize() + len(batch) > self.MAX_BACKLOG:
                    log.error("sender backlog over %d; %d run(s) left to beat's repair",
                              self.MAX_BACKLOG, len(batch))
                    self._done(len(batch))
                    batch.clear()


def _spoke(connection) -> bool:
    """Whether the server sent anything on an idle connection (it closed it, or the reply
    stream is out of step): the pool's checkout test (``ConnectionPool.get_connection``)."""
    from redis import exceptions as redis_exceptions

    if connection._sock is None:
        return False
    try:
        return connection.can_read()
    except (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError):
        return True


def _write(connection, commands: list[tuple]) -> None:
    from redis import exceptions as redis_exceptions

    connection.send_packed_command(connection.pack_commands(commands))
    error = None
    for _ in commands:
        try:
            connection.read_response()
        except redis_exceptions.ResponseError as err:  # read the rest: they are in the buffer
            error = error or err
    if error is not None:
        raise error


def _lpush(wire: RedisWire, written: list[tuple[str, str]]) -> None:
    """One LPUSH of the messages per list: ``LPUSH k a b`` leaves the list as ``LPUSH k a``
    then ``LPUSH k b`` would (a worker's BRPOP takes ``a`` first), one command instead of
    one per message. Several lists: their commands in one write (``RedisWire.write``)."""
    lists: dict[str, list[str]] = {}
    for key, payload in written:
        lists.setdefault(key, []).append(payload)
    wire.write([("LPUSH", key, *payloads) for key, payloads in lists.items()])


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
    pending = take_pending(session)
    if pending:
        send_pending(pending)


def send_pending(pending: Mapping[uuid.UUID, Send], celery_app=None) -> None:
    """Hand the runs a committed write left to send (``Executor.pending``) to this
    process's sender: the session's ``after_commit``, and ``state.direct``'s statements.
    ``celery_app``: the app's (``current_app``'s when None, which needs an app context)."""
    out = sender(celery_app if celery_app is not None else current_app.extensions["celery"])
    for run_id, send in pending.items():
        out.put(run_id, send.workflow_ref,
                TraceContext(send.traceparent, send.tracestate) if send.traceparent else None,
                Tree(send.retries, send.parent_id, send.root_id))


@event.listens_for(Session, "after_rollback")
def _forget_after_rollback(session: Session) -> None:
    # Fires on the real database rollback only, not on a savepoint's.
    forget_pending(session)
