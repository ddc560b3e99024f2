"""``POST /v1/runs``: the one handler, whoever serves the request.

Two HTTP layers serve it: the Flask view (``app/api.py``) and the fast path in front of
Flask (``app/fastpath.py``). Each takes what is its own -- the principal of the bearer
token, the body's bytes, the headers, the moment the request started, a store -- and
calls ``admit_request``, which returns an ``Answer``: the status, the headers besides
``Content-Type`` and ``Content-Length``, and the JSON body, a run or a refusal
(``{"error": {"code", "message", "details"}}``, the bytes Flask's ``jsonify`` writes).
The layer then only translates: a werkzeug ``Response``, or ``start_response``; each adds
what belongs to the request rather than the admission (``X-Request-ID``, the HTTP
metrics series, the access line's fields). An exception other than a refusal (a database
outage) propagates, to the layer's error handling.

No Flask import here: validation, the statement's refusals, replays and the answer's
shape are decided once, and ``tests/app`` runs the admission tests through both layers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import exc as sa_exc

from workers import registry

from . import metrics, tracecontext
from .admission import Admission, AdmissionConflict, admit_run, dumps, loads, unstorable_number
from .apierror import ApiError, error_body
from .models import AdmissionOrigin, Run
from .state.executor import Executor
from .state.runs import AdmittedRun

API_PREFIX = "/v1"
RUN_FIELDS = {"workflow_ref", "input", "goal_id", "dispatch_key", "concurrency_key",
              "not_before", "delay_seconds", "expires_at", "expires_in_seconds"}
# The longest delay or expiry a request may ask for, in seconds (a year): a run parked in
# Postgres costs a row, but a typo of a few zeros should be an error, not a run in 2080.
MAX_WAIT_SECONDS = 366 * 24 * 3600
MAX_KEY_LEN = 255
MAX_REF_LEN = 200
JSON = "application/json"

# Adds fields to the request's log records (``logs.note``).
Note = Callable[..., None]


class Headers(Protocol):
    """A request's headers as the handler reads them (werkzeug's, or a plain dict)."""

    def get(self, key: str, /) -> str | None: ...


@dataclass(frozen=True)
class Answer:
    """What ``POST /v1/runs`` answers: ``status``, ``headers`` (besides the content type,
    ``application/json``, and the length) and ``body``; ``run_id`` is the run's when the
    answer names one (a refusal names none)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    run_id: str | None = None


def admit_request(principal: Any, body: bytes, headers: Headers, started: float, store: Executor,
                  *, script_root: str = "", note: Note | None = None) -> Answer:
    """Answer one ``POST /v1/runs`` whose JSON body is ``body`` (its content type checked
    by the caller). ``started`` is ``time.perf_counter()`` at the request's start;
    ``script_root`` goes in front of ``Location``; ``store`` and ``note`` as ``admit_one``."""
    try:
        admission = admit_one(principal, parse_json(body), headers, started, store, note=note)
    except ApiError as err:
        return refused(err)
    run = admission.run
    payload = (dumps(serialize_run(run, principal.tenant_name), ascii=True) + "\n").encode()
    return Answer(201 if admission.created else 200,
                  tuple(answer_headers(admission, script_root)), payload, str(run.id))


def refused(err: ApiError) -> Answer:
    """The answer of a refused request: its status, headers and error body."""
    return Answer(err.status, tuple(err.headers.items()),
                  error_body(err.code, err.message, err.details))


def serialize_run(run: Run | AdmittedRun, tenant_name: str) -> dict[str, Any]:
    def ts(value: datetime | None) -> str | None:
        return value.isoformat() if value else None

    return {
        "id": str(run.id),
        "tenant": tenant_name,
        "workflow_ref": run.workflow_ref,
        "workflow": {"name": run.workflow_name, "version": run.workflow_version},
        "input": run.input,
        "goal_id": run.goal_id,
        "dispatch_key": run.dispatch_key or run.released_key,
        # True once a newer run of the same key took it over (the workflow's key_reuse).
        "key_released": run.released_key is not None,
        "status": run.status,
        # What a waiting run waits for: 'join', 'concurrency' or 'tenant_cap'.
        "wait_reason": run.wait_reason,
        "concurrency_key": run.concurrency_key,
        "attempt": run.attempt,
        "cancel_requested": run.cancel_requested,
        "result": run.result,
        "error": run.error,
        "origin": run.origin,
        "parent_run_id": str(run.parent_run_id) if run.parent_run_id else None,
        "traceparent": run.traceparent,
        "created_at": ts(run.created_at),
        "updated_at": ts(run.updated_at),
        "started_at": ts(run.started_at),
        "finished_at": ts(run.finished_at),
        # Not before this time (a delayed admission's, or a retry's), and when a run no
        # worker started by then ends expired.
        "not_before": ts(run.not_before),
        "expires_at": ts(run.expires_at),
    }



def parse_json(data: bytes) -> Any:
    """A request body as JSON, or raise a 400 ``malformed_json``."""
    try:
        # Strict JSON (no NaN or Infinity), numbers kept as written (see admission.loads).
        return loads(data)
    except (ValueError, RecursionError) as err:
        raise ApiError(400, "malformed_json", "the request body is not valid JSON",
                       {"reason": str(err)[:200]}) from err


def unstorable_reason(value: Any) -> str | None:
    """Return why ``value`` cannot be stored as sent (NUL, lone surrogates, 1e400), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            if "\x00" in item:
                return "contains U+0000, which Postgres text cannot hold"
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "contains an unpaired surrogate (not valid Unicode)"
        elif isinstance(item, float) and (reason := unstorable_number(item)):
            return f"contains a number that cannot be stored: {reason}"
    return None


def _optional_string(body: dict, name: str, problems: dict) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_KEY_LEN:
        problems[name] = f"must be a string of 1 to {MAX_KEY_LEN} characters"
        return None
    return value


def _parsed(body: dict, name: str, problems: dict, parse: Callable[[Any], Any]) -> Any:
    """``parse`` of the field ``name`` (None when absent); a ``ValueError`` it raises is the
    field's problem."""
    value = body.get(name)
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError as err:
        problems[name] = str(err)
        return None


def _instant(value: Any) -> datetime:
    """An RFC 3339 timestamp with its offset (``YYYY-MM-DDTHH:MM:SSZ``), within a year."""
    problem = "must be an RFC 3339 timestamp with a UTC offset (YYYY-MM-DDTHH:MM:SSZ)"
    if not isinstance(value, str) or len(value) > 64 or "T" not in value.upper():
        raise ValueError(problem)
    try:
        instant = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(problem) from None
    if instant.tzinfo is None:
        raise ValueError(problem)
    if abs((instant - datetime.now(UTC)).total_seconds()) > MAX_WAIT_SECONDS:
        raise ValueError(f"must be within {MAX_WAIT_SECONDS // 86400} days of now")
    return instant


def _seconds(value: Any) -> float:
    """A non-negative number of seconds up to ``MAX_WAIT_SECONDS``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= MAX_WAIT_SECONDS:
        raise ValueError(f"must be a number of seconds from 0 to {MAX_WAIT_SECONDS}")
    return float(value)


def _one_of(body: dict, first: str, second: str, problems: dict) -> None:
    if body.get(first) is not None and body.get(second) is not None:
        problems[second] = f"give {first} or {second}, not both"


def validate_run_request(body: dict[str, Any]) -> dict[str, Any]:
    """Return the cleaned fields of a ``POST /v1/runs`` body or raise a 422."""
    problems: dict[str, str] = {}
    unknown = sorted(set(body) - RUN_FIELDS)
    for name in unknown:
        problems[name] = "unknown field"
    ref = body.get("workflow_ref")
    if not isinstance(ref, str) or not ref.strip():
        problems["workflow_ref"] = "required: a non-empty string ('name' or 'name@version')"
    elif len(ref) > MAX_REF_LEN:
        problems["workflow_ref"] = f"must be at most {MAX_REF_LEN} characters"
    input_ = body.get("input", {})
    if not isinstance(input_, dict):
        problems["input"] = "must be a JSON object"
    goal_id = _optional_string(body, "goal_id", problems)
    dispatch_key = _optional_string(body, "dispatch_key", problems)
    concurrency_key = _optional_string(body, "concurrency_key", problems)
    for name in ("workflow_ref", "input", "goal_id", "dispatch_key", "concurrency_key"):
        if name not in problems and (reason := unstorable_reason(body.get(name))):
            problems[name] = reason
    timing = {"not_before": _parsed(body, "not_before", problems, _instant),
              "delay_seconds": _parsed(body, "delay_seconds", problems, _seconds),
              "expires_at": _parsed(body, "expires_at", problems, _instant),
              "expires_in_seconds": _parsed(body, "expires_in_seconds", problems, _seconds)}
    _one_of(body, "not_before", "delay_seconds", problems)
    _one_of(body, "expires_at", "expires_in_seconds", problems)
    if problems:
        raise ApiError(422, "validation_failed", "the run request is invalid", {"fields": problems})
    return {"workflow_ref": ref, "input": input_, "goal_id": goal_id, "dispatch_key": dispatch_key,
            "concurrency_key": concurrency_key, **timing}


def idempotency_key(fields: dict[str, Any], header: str | None) -> str | None:
    """The dispatch key of a request: the body's, or the ``Idempotency-Key`` header's.

    The header (IETF draft "The Idempotency-Key HTTP Header Field") is the same
    thing as ``dispatch_key``; its value is a structured-field string, so one
    pair of surrounding double quotes is taken off. Both present and different
    is a 422: two keys for one request would collapse two intents or split one.
    """
    if header is None:
        return fields.get("dispatch_key")
    key = header[1:-1] if len(header) >= 2 and header[0] == header[-1] == '"' else header
    if not 1 <= len(key) <= MAX_KEY_LEN:
        raise ApiError(422, "validation_failed", "the run request is invalid", {"fields": {
            "Idempotency-Key": f"must be a string of 1 to {MAX_KEY_LEN} characters"}})
    body_key = fields.get("dispatch_key")
    if body_key is not None and body_key != key:
        raise ApiError(422, "validation_failed", "the run request is invalid", {"fields": {
            "Idempotency-Key": "differs from the body's dispatch_key (send one, or both equal)"}})
    return key



# The exceptions with which ``admit_run`` refuses a request (``refusal`` answers them).
REFUSALS = (registry.UnknownWorkflow, registry.InvalidConcurrencyKey, sa_exc.DataError,
            AdmissionConflict)


def admit_one(principal: Any, body: Any, headers: Headers, started: float, store: Executor,
              note: Note | None = None) -> Admission:
    """``POST /v1/runs``'s work on a parsed body (``admit_request`` is the whole request).
    Raises ``ApiError`` for a refusal.

    ``headers`` is the request's (any mapping with ``get``, werkzeug's among them); ``store`` is
    ``single_statements(...)``, whose ``commit()`` hands a new run to the sender;
    ``note`` adds fields to the request's log records.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_body", "the request body must be a JSON object",
                       {"type": type(body).__name__})
    fields = validate_run_request(body)
    fields["dispatch_key"] = idempotency_key(fields, headers.get("Idempotency-Key"))
    if note is not None:
        note(dispatch_key=fields.get("dispatch_key"))
    # Admission is one statement (run and event together), so it needs no
    # transaction around it: in autocommit it is one round trip, not BEGIN,
    # statement, COMMIT. A replay's read is another statement, which sees the
    # winner ON CONFLICT waited for. Both run on psycopg directly
    # (app/state/direct.py); the run is handed to the sender only by
    # store.commit(), after the row is committed.
    try:
        admission = admit_run(
            store,
            tenant_id=principal.tenant_id,
            origin=AdmissionOrigin.HTTP,
            origin_detail=(headers.get("User-Agent") or "")[:255] or None,
            # W3C Trace Context: kept on the run when valid, ignored (never an error) if not.
            trace=tracecontext.from_headers(headers),
            **fields,
        )
    except REFUSALS as err:
        store.rollback()
        if isinstance(err, AdmissionConflict):
            metrics.ADMISSIONS.labels("http", "conflict").inc()
        raise refusal(err, fields) from err
    store.commit()
    metrics.ADMISSION_SECONDS.labels("http").observe(time.perf_counter() - started)
    metrics.ADMISSIONS.labels("http", "created" if admission.created else "replayed").inc()
    return admission


def answer_headers(admission: Admission, script_root: str) -> list[tuple[str, str]]:
    """The headers of ``POST /v1/runs``'s answer besides the JSON body's own."""
    # get_run's URL without url_for (its rule building is a twentieth of the view).
    headers = [("Location", f"{script_root}{API_PREFIX}/runs/{admission.run.id}")]
    if not admission.created:
        headers.append(("Idempotent-Replayed", "true"))
    return headers


def refusal(err: Exception, fields: dict[str, Any]) -> ApiError:
    """The API's answer to an admission refusing a request (``admit_run`` raised ``err``)."""
    if isinstance(err, registry.UnknownWorkflow):
        return ApiError(422, "unknown_workflow", str(err), {"workflow_ref": fields["workflow_ref"]})
    if isinstance(err, registry.InvalidConcurrencyKey):
        # The message names the workflow and the exception type, never the input.
        return ApiError(422, "validation_failed", "the run request is invalid",
                        {"fields": {err.field: str(err)}})
    if isinstance(err, sa_exc.DataError):
        # Every value in the statement came from the request, so Postgres refusing
        # one (a number beyond numeric's range, say) is the request's fault: a 422,
        # never a 500. The database's message is not repeated: it quotes the value.
        reason = type(err.orig).__name__
        return ApiError(422, "validation_failed", "the run request cannot be stored",
                        {"fields": {"input": f"refused by the database ({reason})"}})
    if isinstance(err, AdmissionConflict):
        return ApiError(409, "dispatch_key_conflict", str(err),
                        {"run_id": str(err.existing.id),
                         "dispatch_key": err.existing.dispatch_key, "differs": err.fields})
    raise TypeError(f"not an admission refusal: {type(err).__name__}") from err
