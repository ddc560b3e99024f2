"""Optional OpenTelemetry tracing and Sentry error reporting, for teams that use them.

Each is off, and its package never imported, unless its variable is set
(``poimenconfig.telemetry_settings``): ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` turns on tracing (the ``otel`` extra), ``SENTRY_DSN`` error reporting (the ``sentry``
extra). A variable set without its package installed is one log line, and the
process runs on without it: telemetry must never stop a run.

* ``init_web`` (gunicorn's ``post_worker_init``, ``app/gunicorn_conf.py``): Flask
  instrumentation, service ``poimen-web``.
* ``connect_celery`` (``workers/celery.py``): Celery instrumentation and
  integration in the worker (``poimen-worker``) and beat (``poimen-beat``),
  set up when each starts.
* ``continuing``: every ``runs.execute`` message is published inside the run's
  own trace context (``app/enqueue.py``), so the Celery instrumentation's
  ``traceparent`` header, which replaces the one the message carries, keeps
  the run's trace id: a run admitted with trace id T produces worker spans with
  trace id T, whoever (re-)sends its message.
* ``report_exception``: a run's failing workflow exception goes to Sentry
  (``workers/execution.py``), tagged with the run and tenant.

What leaves the process: span attributes are the instrumentations' (HTTP method,
route, status; the Celery task name and id, which is the run id), never a run's
input or result. A Sentry event passes ``scrub_event``, an allow-list: exception
types and stack frames without their messages or local variables, request method,
URL and a few headers without body, cookies or query string, log templates
without their arguments, breadcrumbs without data; the log context's ids
(``run_id``, ``tenant``, ``request_id``, ``trace_id``, ``task_id``) become tags.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import logconfig
from poimenconfig import TelemetrySettings, telemetry_settings

if TYPE_CHECKING:
    from celery import Celery
    from flask import Flask

    from .tracecontext import TraceContext

log = logging.getLogger(__name__)

WEB, WORKER, BEAT = "poimen-web", "poimen-worker", "poimen-beat"
# Never traced: probes and scrapes every few seconds.
UNTRACED_URLS = "/healthz,/metrics"


class _State:
    """What this process turned on (set once, at start)."""

    tracing = None   # the TracerProvider, when tracing is on
    sentry = False


# -- start-up ----------------------------------------------------------------------------------


def init_web(app: Flask, settings: TelemetrySettings | None = None) -> None:
    """Turn on what is configured for ``web``: Flask spans and Sentry's Flask integration."""
    settings = settings or telemetry_settings()
    if settings.tracing and _start_tracing(settings, WEB):
        try:
            from opentelemetry.instrumentation.flask import FlaskInstrumentor
        except ImportError as err:
            _missing("OTEL_EXPORTER_OTLP_ENDPOINT", "otel", err)
        else:
            FlaskInstrumentor().instrument_app(app, excluded_urls=UNTRACED_URLS,
                                               enable_commenter=False)
    if settings.sentry_dsn:
        _start_sentry(settings, WEB, ("flask",))


def init_celery_process(settings: TelemetrySettings | None = None, service: str = WORKER) -> None:
    """Turn on what is configured for a Celery process: task spans, Sentry's Celery integration."""
    settings = settings or telemetry_settings()
    if settings.tracing and _start_tracing(settings, service):
        try:
            from opentelemetry.instrumentation.celery import CeleryInstrumentor
        except ImportError as err:
            _missing("OTEL_EXPORTER_OTLP_ENDPOINT", "otel", err)
        else:
            CeleryInstrumentor().instrument()
    if settings.sentry_dsn:
        _start_sentry(settings, service, ("celery",))


def connect_celery(celery_app: Celery) -> None:
    """Set up telemetry when the worker or beat starts (not Flower, not at import)."""
    from celery import signals

    def worker_starting(**_: Any) -> None:
        # In the main process, before the pool forks: the span processor's export
        # thread is started again in each child (the SDK's at-fork hook).
        init_celery_process(service=WORKER)

    def beat_starting(**_: Any) -> None:
        init_celery_process(service=BEAT)

    signals.worker_init.connect(worker_starting, weak=False)
    signals.beat_init.connect(beat_starting, weak=False)
    # A pool process ends with os._exit (no atexit): send what it has buffered first.
    signals.worker_process_shutdown.connect(lambda **_: flush(), weak=False)


def _missing(variable: str, extra: str, err: ImportError) -> None:
    log.warning("%s is set but %s is not installed (pip install 'poimen[%s]'): it stays off",
                variable, err.name or "its package", extra)


def _start_tracing(settings: TelemetrySettings, service: str) -> bool:
    if _State.tracing is not None:
        return True
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as err:
        _missing("OTEL_EXPORTER_OTLP_ENDPOINT", "otel", err)
        return False
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        # The SDK was started already (``opentelemetry-instrument``): its provider and
        # exporter stay; a second one would be refused by the API anyway.
        _State.tracing = trace.get_tracer_provider()
        log.info("OpenTelemetry: the SDK already started in this process is used")
        return True
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: settings.service_name or service}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=settings.otlp_traces_url)))
    trace.set_tracer_provider(provider)
    _State.tracing = provider
    log.info("OpenTelemetry: spans of %s go to %s", settings.service_name or service,
             settings.otlp_traces_url)
    return True


def sentry_privacy(version: str) -> dict[str, Any]:
    """The init options that keep out of Sentry's events anything of a request or a frame
    that could hold a run's input or a token, for sentry-sdk ``version``: 2.x names them
    ``send_default_pii`` and ``include_local_variables``, 3.x replaced both (it refuses
    them) with ``data_collection``, where every category is turned off here."""
    major = int(version.split(".", 1)[0])
    if major < 3:
        return {"send_default_pii": False, "include_local_variables": False}
    off = {"mode": "off"}
    return {"data_collection": {
        "user_info": False, "cookies": off, "http_headers": {"request": off},
        "http_bodies": [], "url_query_params": off,
        "graphql": {"document": False, "variables": False},
        "gen_ai": {"inputs": False, "outputs": False},
        "mcp": {"inputs": False, "outputs": False},
        "database_query_data": False, "queues": False, "stack_frame_variables": False,
    }}


def _start_sentry(settings: TelemetrySettings, service: str, frameworks: tuple[str, ...]) -> None:
    if _State.sentry:
        return
    try:
        import sentry_sdk
        from sentry_sdk.integrations.celery import CeleryIntegration
        from sentry_sdk.integrations.flask import FlaskIntegration
    except ImportError as err:
        _missing("SENTRY_DSN", "sentry", err)
        return
    integrations = {"flask": FlaskIntegration, "celery": CeleryIntegration}
    sentry_sdk.init(
        dsn=settings.sentry_dsn,
        environment=settings.sentry_environment,
        release=settings.sentry_release,
        integrations=[integrations[name]() for name in frameworks],
        max_request_body_size="never",
        before_send=scrub_event,
        before_breadcrumb=_scrub_breadcrumb,
        **sentry_privacy(sentry_sdk.VERSION),
    )
    sentry_sdk.set_tag("service", service)
    _State.sentry = True
    log.info("Sentry: errors of %s are reported", service)


def flush(timeout: float = 2.0) -> None:
    """Send what is buffered (spans, events) now: the process is about to end."""
    if _State.tracing is not None:
        _State.tracing.force_flush(int(timeout * 1000))
    if _State.sentry:
        import sentry_sdk

        sentry_sdk.flush(timeout)


# -- while running -----------------------------------------------------------------------------


@contextlib.contextmanager
def continuing(trace: TraceContext | None) -> Iterator[None]:
    """Run the block inside the run's trace context ``trace`` (when tracing is on)."""
    if _State.tracing is None or trace is None:
        yield
        return
    from opentelemetry import context, propagate

    token = context.attach(propagate.extract(trace.headers()))
    try:
        yield
    finally:
        context.detach(token)


def report_exception(err: BaseException) -> None:
    """Report a run's failing exception to Sentry, when it is on (scrubbed, tagged)."""
    if _State.sentry:
        import sentry_sdk

        sentry_sdk.capture_exception(err)


# -- what may reach Sentry ---------------------------------------------------------------------

# Ids only: the fields of the log context that become an event's tags.
TAGGED_FIELDS = ("run_id", "tenant", "request_id", "trace_id", "task_id")
EVENT_KEYS = frozenset({
    "event_id", "timestamp", "level", "platform", "logger", "server_name", "release",
    "environment", "sdk", "transaction", "transaction_info", "fingerprint", "tags", "type",
})
CONTEXTS = frozenset({"trace", "runtime", "os"})
FRAME_KEYS = frozenset({"filename", "abs_path", "module", "function", "lineno", "colno",
                        "in_app", "context_line", "pre_context", "post_context"})
REQUEST_HEADERS = frozenset({"host", "user-agent", "content-type", "content-length",
                             "x-request-id", "traceparent"})
SCRUBBED = "[scrubbed]"


def scrub_event(event: dict, hint: Mapping[str, Any] | None = None) -> dict:
    """Return the parts of ``event`` that cannot hold a run's input, result or a secret.

    An allow-list: anything Sentry (or an integration added later) puts elsewhere
    is dropped. Exception messages go too, since a workflow's may quote its input.
    """
    out = {key: event[key] for key in EVENT_KEYS if key in event}
    out["tags"] = {**{k: v for k, v in (event.get("tags") or {}).items()
                      if isinstance(v, str)},
                   **{k: v for k, v in logconfig.current_context().items()
                      if k in TAGGED_FIELDS}}
    if event.get("contexts"):
        out["contexts"] = {k: v for k, v in event["contexts"].items() if k in CONTEXTS}
    if event.get("exception"):
        out["exception"] = {"values": [_exception(v) for v in event["exception"].get(
            "values") or []]}
    if event.get("threads"):
        out["threads"] = {"values": [{**{k: v for k, v in t.items() if k != "stacktrace"},
                                      **({"stacktrace": _stacktrace(t["stacktrace"])}
                                         if t.get("stacktrace") else {})}
                                     for t in event["threads"].get("values") or []]}
    if event.get("logentry"):
        # The template ("run %s: failed: %s"), never its arguments.
        out["logentry"] = {"message": str(event["logentry"].get("message", ""))}
    if event.get("request"):
        request = event["request"]
        out["request"] = {
            "method": request.get("method"),
            "url": str(request.get("url", "")).split("?", 1)[0],
            "headers": {k: v for k, v in (request.get("headers") or {}).items()
                        if k.lower() in REQUEST_HEADERS},
        }
    if event.get("breadcrumbs"):
        crumbs = event["breadcrumbs"].get("values") or []
        out["breadcrumbs"] = {"values": [c for c in map(_scrub_breadcrumb, crumbs) if c]}
    return out


def _exception(value: dict) -> dict:
    out = {k: value[k] for k in ("type", "module", "mechanism") if k in value}
    out["value"] = SCRUBBED
    if value.get("stacktrace"):
        out["stacktrace"] = _stacktrace(value["stacktrace"])
    return out


def _stacktrace(stacktrace: dict) -> dict:
    return {"frames": [{k: v for k, v in frame.items() if k in FRAME_KEYS}
                       for frame in stacktrace.get("frames") or []]}


def _scrub_breadcrumb(crumb: dict, hint: Mapping[str, Any] | None = None) -> dict | None:
    """Keep a breadcrumb's kind and time; its message only for log lines and SQL text.

    Log lines carry no run input (a rule of this code base), and SQL text carries
    placeholders, never parameters; anything else (Redis commands, HTTP URLs,
    an integration's ``data``) is reduced to its category.
    """
    out = {k: crumb[k] for k in ("type", "category", "level", "timestamp") if k in crumb}
    if crumb.get("type") == "log" or crumb.get("category") == "query":
        out["message"] = crumb.get("message")
    return out
