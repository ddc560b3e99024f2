"""The ``/v1`` HTTP API."""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from datetime import datetime
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request
from sqlalchemy import event
from sqlalchemy import exc as sa_exc

from . import logs, metrics, run_service, tracecontext
from .admission import (
    Admission,
    AdmissionConflict,
    RunRequest,
    admit_many,
    admit_run,
    dumps,
    read_numbers_exactly,
)
from .admission_handler import (
    API_PREFIX,
    JSON,
    REFUSALS,
    admit_request,
    parse_json,
    refusal,
    serialize_run,
    unstorable_reason,
    validate_run_request,
)
from .auth import ADMIT, require_token
from .enqueue import send_pending
from .errors import ApiError
from .extensions import autocommit_next, db
from .models import TERMINAL_STATUSES, AdmissionOrigin, Run, RunStatus
from .openapi import openapi_document
from .state.direct import single_statements
from .state.executor import on_session
from .waiter import waiter

bp = Blueprint("v1", __name__, url_prefix=API_PREFIX)
log = logging.getLogger(__name__)

# A batch item is a POST /v1/runs body plus that item's W3C Trace Context.
TRACE_FIELDS = ("traceparent", "tracestate")
DEFAULT_PAGE = 50
MAX_PAGE = 200
# A cursor this API issues is about 90 characters; anything far longer is not one
# (and decoding it would only cost CPU: 3 KB of '[' once made the parser recurse).
MAX_CURSOR_LEN = 512
READ, CANCEL = "read", "cancel"


@bp.record_once
def _read_numbers_exactly(state) -> None:
    # Every connection reads json/jsonb numbers with the digits they were stored
    # with, so a run reads back with the input it was admitted with. Other code
    # (workers included) still sees floats: ExactNumber is one.
    with state.app.app_context():
        for engine in db.engines.values():
            event.listen(engine, "connect", read_numbers_exactly)


def _json(body: Any, status: int = 200) -> Response:
    """A JSON response whose numbers keep their digits (``jsonify`` rounds them to doubles)."""
    return current_app.response_class(dumps(body, ascii=True) + "\n", status=status,
                                      mimetype="application/json")


def _require_json() -> None:
    if not request.is_json:
        raise ApiError(
            415, "unsupported_media_type", "send the body as application/json",
            {"content_type": request.content_type},
        )


def _json_body() -> dict[str, Any]:
    _require_json()
    body = parse_json(request.get_data(cache=True))
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_body", "the request body must be a JSON object",
                       {"type": type(body).__name__})
    return body


@bp.post("/runs")
@require_token(ADMIT)
def create_run():
    """``admission_handler.admit_request``'s answer as a werkzeug ``Response``."""
    started = time.perf_counter()
    _require_json()
    answer = admit_request(g.principal, request.get_data(cache=True), request.headers, started,
                           single_statements(db.session, send_pending),
                           script_root=request.script_root, note=logs.note)
    if answer.run_id is not None:
        logs.note(run_id=answer.run_id)
    return current_app.response_class(answer.body, status=answer.status,
                                      headers=list(answer.headers), mimetype=JSON)


def _item_error(err: ApiError) -> dict[str, Any]:
    return {"status": err.status,
            "error": {"code": err.code, "message": err.message, "details": err.details}}


def _batch_item(item: Any) -> tuple[dict[str, Any], tracecontext.TraceContext | None]:
    """The cleaned fields and trace context of one batch item, or raise its 400/422."""
    if not isinstance(item, dict):
        raise ApiError(400, "invalid_body", "each item of runs must be a JSON object",
                       {"type": type(item).__name__})
    run_body = {name: value for name, value in item.items() if name not in TRACE_FIELDS}
    fields = validate_run_request(run_body)
    # Like the single endpoint's headers: kept when valid, ignored (never an error) if not.
    trace = tracecontext.from_headers(
        {name: item[name] for name in TRACE_FIELDS if isinstance(item.get(name), str)})
    return fields, trace


@bp.post("/runs/batch")
@require_token(ADMIT)
def create_runs():
    """Admit many runs in one request: each item as ``POST /v1/runs`` would alone, answered
    in order; a bad item never fails its neighbours (docs/guide/api.md#batch-admission)."""
    started = time.perf_counter()
    if request.headers.get("Idempotency-Key") is not None:
        raise ApiError(422, "validation_failed", "the batch request is invalid", {"fields": {
            "Idempotency-Key": "not accepted on a batch: send dispatch_key per item"}})
    body = _json_body()
    items = body.get("runs")
    problems = {name: "unknown field" for name in sorted(set(body) - {"runs"})}
    if not isinstance(items, list):
        problems["runs"] = "required: an array of run requests"
    if problems:
        raise ApiError(422, "validation_failed", "the batch request is invalid",
                       {"fields": problems})
    limit = current_app.config["POIMEN_BATCH_MAX"]
    if len(items) > limit:
        raise ApiError(413, "batch_too_large", f"a batch holds at most {limit} runs",
                       {"max": limit, "given": len(items)})
    principal = g.principal
    results: list[dict[str, Any] | None] = [None] * len(items)
    valid: list[tuple[int, dict[str, Any], RunRequest]] = []
    for position, item in enumerate(items):
        try:
            fields, trace = _batch_item(item)
        except ApiError as err:
            results[position] = _item_error(err)
            continue
        valid.append((position, fields, RunRequest(trace=trace, **fields)))
    common = dict(tenant_id=principal.tenant_id, origin=AdmissionOrigin.HTTP,
                  origin_detail=(request.headers.get("User-Agent") or "")[:255] or None)
    # Two statements, each whole on its own (the insert with its events; the read of the
    # keys it found taken): autocommit, as the single endpoint's admission.
    autocommit_next(db.session)  # a batch: ADMIT_MANY, then HOLDERS if a key was taken
    try:
        outcomes: list[Any] = admit_many(on_session(db.session),
                                         [req for _, _, req in valid], **common)
    except sa_exc.DataError:
        # Postgres refused a value of some item, which failed the whole statement (nothing
        # was admitted): admit each alone, in a savepoint, so only that item is refused.
        db.session.rollback()
        outcomes = [_admit_in_savepoint(req, common) for _, _, req in valid]
    counts = {"created": 0, "replayed": 0, "conflict": 0}
    for (position, fields, _), outcome in zip(valid, outcomes, strict=True):
        if isinstance(outcome, Admission):
            counts["created" if outcome.created else "replayed"] += 1
            results[position] = {"status": 201 if outcome.created else 200,
                                 "run": serialize_run(outcome.run, principal.tenant_name)}
        else:
            counts["conflict"] += isinstance(outcome, AdmissionConflict)
            results[position] = _item_error(refusal(outcome, fields))
    db.session.commit()
    for outcome, count in counts.items():
        if count:
            metrics.ADMISSIONS.labels("batch", outcome).inc(count)
    metrics.ADMISSION_SECONDS.labels("batch").observe(time.perf_counter() - started)
    # One line per batch: counts only (no input, no key: a line must not carry a request's data).
    log.info("batch admission: %d item(s), %d created, %d replayed, %d refused",
             len(items), counts["created"], counts["replayed"],
             len(items) - counts["created"] - counts["replayed"])
    return _json({"results": results})


def _admit_in_savepoint(req: RunRequest, common: dict[str, Any]) -> Any:
    """One batch item admitted alone (``admit_run``), its refusal returned, not raised."""
    try:
        with db.session.begin_nested():
            return admit_run(on_session(db.session), **req.fields(), **common)
    except REFUSALS as err:
        return err


def _load_run(run_id: str) -> Run:
    return run_service.load_run(db.session, g.principal.tenant_id, run_id, ApiError)


@bp.get("/runs/<run_id>")
@require_token(READ)
def get_run(run_id: str):
    """The run; with ``?wait=N`` (seconds, up to ``POIMEN_WAIT_MAX_SECONDS``), once it
    has ended or after N seconds, whichever comes first (``app/waiter.py``)."""
    unknown = sorted(set(request.args) - {"wait"})
    if unknown:
        raise ApiError(400, "invalid_parameter", "invalid query parameters",
                       {"names": {name: "unknown parameter" for name in unknown}})
    wait = _wait_seconds(request.args.get("wait"))
    run = _load_run(run_id)
    waited = None
    if wait and run.status not in TERMINAL_STATUSES:
        run_uuid = run.id
        # The request waits holding no connection: the transaction ends here.
        db.session.commit()
        config = current_app.config
        waited = waiter(db.engine, interval=config["POIMEN_WAIT_POLL_SECONDS"],
                        max_waiters=config["POIMEN_WAIT_MAX"]).wait(run_uuid, wait)
        db.session.expire_all()  # read it again, not the session's copy
        run = _load_run(str(run_uuid))
    body = serialize_run(run, g.principal.tenant_name)
    body["steps"] = serialize_steps(run_service.run_steps(db.session, run.id))
    response = _json(body)
    if waited is None and wait and run.status not in TERMINAL_STATUSES:
        response.headers["Poimen-Wait"] = "full"  # this process's waiters are at their bound
    return response


def _wait_seconds(value: str | None) -> float:
    if value is None:
        return 0.0
    limit = current_app.config["POIMEN_WAIT_MAX_SECONDS"]
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= limit:  # NaN fails both comparisons
        raise ApiError(400, "invalid_parameter", "invalid query parameters", {"names": {
            "wait": f"seconds to wait for the run to end, from 0 to {limit:g}"}})
    return seconds


def serialize_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's step entries (``runs.run_steps``), timestamps as ISO 8601."""
    return [{**entry, **{name: entry[name].isoformat() if entry[name] else None
                         for name in ("started_at", "finished_at")}} for entry in steps]


def _encode_cursor(run: Run) -> str:
    raw = json.dumps([run.created_at.isoformat(), str(run.id)]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    if len(cursor) > MAX_CURSOR_LEN:
        raise ApiError(400, "invalid_cursor", "the cursor is not one this API issued",
                       {"max_length": MAX_CURSOR_LEN})
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, run_id = json.loads(raw)
        return datetime.fromisoformat(created), uuid.UUID(run_id)
    except (ValueError, TypeError, RecursionError) as err:
        raise ApiError(400, "invalid_cursor", "the cursor is not one this API issued") from err


@bp.get("/runs")
@require_token(READ)
def list_runs():
    args = request.args
    unknown = sorted(set(args) - {"status", "goal_id", "workflow_ref", "dispatch_key", "limit",
                                  "cursor", "parent_run_id"})
    if unknown:
        raise ApiError(400, "unknown_parameter", "unknown query parameters", {"names": unknown})
    bad = {name: reason for name, value in args.items() if (reason := unstorable_reason(value))}
    if bad:
        raise ApiError(400, "invalid_parameter", "invalid query parameters", {"names": bad})
    try:
        limit = int(args.get("limit", DEFAULT_PAGE))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise ApiError(400, "invalid_limit", f"limit must be an integer from 1 to {MAX_PAGE}")
    statuses = None
    if "status" in args:
        statuses = args["status"].split(",")
        valid = {s.value for s in RunStatus}
        if not set(statuses) <= valid:
            raise ApiError(400, "invalid_status", "unknown status",
                           {"allowed": sorted(valid), "given": statuses})
    where = run_service.RunFilter(
        statuses=statuses,
        goal_id=args.get("goal_id"),
        workflow_ref=args.get("workflow_ref"),
        dispatch_key=args.get("dispatch_key"),
        parent_run_id=_parent_run_id(args.get("parent_run_id")),
        before=_decode_cursor(args["cursor"]) if "cursor" in args else None,
    )
    rows = run_service.list_runs(db.session, g.principal.tenant_id, where, limit + 1)
    page = rows[:limit]
    return _json(
        {
            "runs": [serialize_run(r, g.principal.tenant_name) for r in page],
            "next_cursor": _encode_cursor(page[-1]) if len(rows) > limit else None,
        }
    )


def _parent_run_id(value: str | None) -> uuid.UUID | None:
    """``?parent_run_id=``: the children of that run (the runs its fan-outs admitted)."""
    if value is None:
        return None
    try:
        return uuid.UUID(value)
    except ValueError as err:
        raise ApiError(400, "invalid_parameter", "invalid query parameters",
                       {"names": {"parent_run_id": "must be a run id (a UUID)"}}) from err


@bp.post("/runs/<run_id>/cancel")
@require_token(CANCEL)
def cancel_run(run_id: str):
    unknown = sorted(set(request.args) - {"cascade"})
    cascade = request.args.get("cascade", "true").lower()
    if unknown or cascade not in ("true", "false"):
        raise ApiError(400, "invalid_parameter", "invalid query parameters", {"names": {
            **{name: "unknown parameter" for name in unknown},
            **({} if cascade in ("true", "false") else {"cascade": "true or false"})}})
    run = _load_run(run_id)
    # A queued run is cancelled outright; a running one is flagged and its
    # workflow sees ctx.cancelled at its next checkpoint. A finished run is
    # left as it is. With the cascade (the default), so are its descendants. The answer
    # is the run as its own cancel left it.
    run_service.cancel_run(db.session, run.tenant_id, run.id, cascade=cascade == "true")
    db.session.refresh(run)
    response = _json(serialize_run(run, g.principal.tenant_name),
                     202 if run.status == RunStatus.RUNNING else 200)
    reached = (run_service.cancel_descendants(db.session, run.tenant_id, run.id)
               if cascade == "true" else 0)
    response.headers["Poimen-Cancelled-Descendants"] = str(reached)
    return response


@bp.get("/openapi.json")
def openapi():
    return jsonify(openapi_document())
