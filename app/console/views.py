"""The console's pages: sign-in, the runs list, a run's page, cancel and re-drive.

Views hold no SQL: runs, steps and children come from ``app/run_service.py``,
cancel is ``app.state.runs.cancel_run`` (the API's), re-drive is ``admission.admit_run``
with a key derived from the failed run, and the rest is ``reads.py``.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

from flask import (
    Blueprint,
    current_app,
    flash,
    g,
    jsonify,
    redirect,
    render_template,
    request,
    url_for,
)
from werkzeug.exceptions import HTTPException

from workers import registry

from .. import backlog, run_service
from ..admission import AdmissionConflict, admit_run, dumps
from ..admission_handler import MAX_KEY_LEN, unstorable_reason
from ..api import _decode_cursor, _encode_cursor
from ..auth import ADMIT, REPLAY_DLQ
from ..errors import ApiError
from ..extensions import db
from ..models import TERMINAL_STATUSES, AdmissionOrigin, Run, RunStatus, WaitReason
from ..state.executor import on_session
from . import reads
from .session import (
    CSRF_FIELD,
    ConsoleError,
    check_csrf,
    csrf_token,
    safe_next,
    signed_in,
)
from .session import (
    sign_in as start_session,
)

log = logging.getLogger(__name__)

bp = Blueprint("console", __name__, url_prefix="/console",
               static_folder="../static/console", static_url_path="/static")

PAGE = 50
MAX_CHILDREN = 500
FILTERS = ("status", "workflow_ref", "goal_id", "dispatch_key", "parent_run_id")

# Every page and asset comes from this app: the browser is told to load nothing
# else, so a template that slips in an external URL breaks visibly.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def redrive_key(run_id: uuid.UUID) -> str:
    """The dispatch key of the re-drive of failed run ``run_id``: one new run per failed run.

    Derived from the failed run alone, so a double-click, a resubmitted form or
    two people re-driving at once are one admission (the unique index decides);
    a re-drive that fails too is re-driven under its own id.
    """
    return f"redrive:{run_id}"


@bp.before_request
def _csrf_on_every_post():
    if request.method == "POST":
        check_csrf()


@bp.after_request
def _headers(response):
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "same-origin"
    if request.endpoint != "console.static":
        # Pages show a tenant's runs: no shared or back-button cache keeps them.
        response.headers["Cache-Control"] = "no-store"
    return response


@bp.app_context_processor
def _template_helpers() -> dict[str, Any]:
    return {"csrf_field": CSRF_FIELD, "csrf_token": csrf_token, "pretty": _pretty,
            "when": _when, "took": _took, "statuses": [s.value for s in RunStatus]}


def _pretty(value: Any) -> str:
    return dumps(value, indent=2)


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC" if value else "-"


def _took(start: datetime | None, end: datetime | None) -> str:
    if not start or not end:
        return "-"
    seconds = (end - start).total_seconds()
    return f"{seconds:.3f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


# -- errors: an HTML page, or the API's JSON shape for a client that asks for JSON --------------

def _error(status: int, code: str, message: str, details: dict | None = None):
    if request.accept_mimetypes.best_match(["text/html", "application/json"]) \
            == "application/json":
        response = jsonify({"error": {"code": code, "message": message,
                                      "details": details or {}}})
        response.status_code = status
        return response
    return render_template("console/error.html", status=status, code=code,
                           message=message, details=details or {}), status


@bp.errorhandler(ConsoleError)
def _console_error(err: ConsoleError):
    return _error(err.status, err.code, err.message, err.details)


@bp.errorhandler(ApiError)
def _api_error(err: ApiError):
    return _error(err.status, err.code, err.message, err.details)


@bp.errorhandler(HTTPException)
def _http_error(err: HTTPException):
    return _error(err.code or 500, "http_error", err.description or err.name)


@bp.route("/<path:unknown>")
def not_found(unknown: str):
    raise ConsoleError(404, "not_found", "no such console page")


# -- sign-in ----------------------------------------------------------------------------------

@bp.get("/")
def index():
    return redirect(url_for("console.runs"))


@bp.route("/sign-in", methods=["GET", "POST"])
def sign_in():
    if not current_app.config["POIMEN_CONSOLE_ENABLED"]:
        raise ConsoleError(503, "console_disabled",
                           "the console needs POIMEN_CONSOLE_SECRET (32 characters or more)")
    target = safe_next(request.values.get("next"))
    if request.method == "GET":
        return render_template("console/sign_in.html", next=target)
    token = request.form.get("token", "")
    try:
        principal = start_session(token)
    except (ApiError, ConsoleError) as err:
        # Which check failed is said; the token is never repeated or logged.
        return render_template("console/sign_in.html", next=target,
                               problem=err.message), err.status
    log.info("console: sign-in with token %s of tenant %s", principal.token_id,
             principal.tenant_name)
    return redirect(target)


@bp.post("/sign-out")
def sign_out():
    from flask import session

    session.clear()
    return redirect(url_for("console.sign_in"))


# -- runs -------------------------------------------------------------------------------------

def _filters() -> tuple[dict[str, str], run_service.RunFilter]:
    args = {name: request.args.get(name, "").strip() for name in FILTERS}
    args = {name: value for name, value in args.items() if value}
    problems = {}
    for name, value in args.items():
        if len(value) > MAX_KEY_LEN:
            problems[name] = f"at most {MAX_KEY_LEN} characters"
        elif reason := unstorable_reason(value):
            problems[name] = reason
    status = args.get("status")
    if status and status not in {s.value for s in RunStatus}:
        problems["status"] = "unknown status"
    parent = None
    if "parent_run_id" in args and "parent_run_id" not in problems:
        try:
            parent = uuid.UUID(args["parent_run_id"])
        except ValueError:
            problems["parent_run_id"] = "must be a run id (a UUID)"
    if problems:
        raise ConsoleError(400, "invalid_filter", "the filter is invalid", {"fields": problems})
    cursor = request.args.get("cursor")
    return args, run_service.RunFilter(
        statuses=[status] if status else None,
        goal_id=args.get("goal_id"),
        workflow_ref=args.get("workflow_ref"),
        dispatch_key=args.get("dispatch_key"),
        parent_run_id=parent,
        before=_decode_cursor(cursor) if cursor else None,
    )


@bp.get("/runs", endpoint="runs")
@signed_in
def run_list():
    args, where = _filters()
    tenant_id = g.principal.tenant_id
    rows = run_service.list_runs(db.session, tenant_id, where, PAGE + 1)
    page = rows[:PAGE]
    next_url = None
    if len(rows) > PAGE:
        next_url = url_for("console.runs", **args, cursor=_encode_cursor(page[-1]))
    return render_template(
        "console/runs.html", runs=page, filters=args, next_url=next_url,
        counts=reads.status_counts(db.session, tenant_id), paged="cursor" in request.args)


# -- backlog ----------------------------------------------------------------------------------

_backlog_cache = backlog.TenantBacklogCache()


@bp.get("/backlog")
@signed_in
def backlog_page():
    """The tenant's runs queued, waiting and delayed, by queue, and the oldest's age."""
    tenant_id = g.principal.tenant_id
    ttl = current_app.config.get("POIMEN_METRICS_CACHE_SECONDS", 5.0)
    read = _backlog_cache.get(ttl, tenant_id, lambda: backlog.read_backlog(
        db.session, current_app.extensions["celery"], tenant_id))
    rows = read.rows(g.principal.tenant_name)
    return render_template("console/backlog.html", rows=rows, totals=backlog.totals(rows),
                           states=backlog.STATES, reasons=[str(r) for r in WaitReason],
                           read_at=datetime.fromtimestamp(read.read_at, UTC), ttl=ttl)


def _load_run(run_id: str) -> Run:
    return run_service.load_run(db.session, g.principal.tenant_id, run_id, ConsoleError)


@bp.get("/runs/<run_id>")
@signed_in
def run(run_id: str):
    run = _load_run(run_id)
    tenant_id = g.principal.tenant_id
    children = run_service.list_runs(
        db.session, tenant_id, run_service.RunFilter(parent_run_id=run.id), MAX_CHILDREN)
    redrives = run_service.list_runs(
        db.session, tenant_id, run_service.RunFilter(dispatch_key=redrive_key(run.id)), 1)
    events = reads.run_events(db.session, tenant_id, run.id)
    return render_template(
        "console/run.html", run=run, steps=run_service.run_steps(db.session, run.id),
        children=list(reversed(children)), children_capped=len(children) >= MAX_CHILDREN,
        events=events, events_capped=len(events) >= reads.MAX_EVENTS,
        holder=reads.run_holder(db.session, run), redrive=redrives[0] if redrives else None,
        live=run.status not in TERMINAL_STATUSES,
        can_cancel=run.status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING)
        and not (run.status == RunStatus.RUNNING and run.cancel_requested),
        can_redrive=run.status == RunStatus.FAILED and not redrives)


@bp.post("/runs/<run_id>/cancel")
@signed_in
def cancel(run_id: str):
    principal = g.principal
    if not principal.allows("cancel"):
        raise ConsoleError(403, "forbidden", "this token may not cancel runs")
    run = _load_run(run_id)
    # The API's cancel, cascading: the run and its descendants, each with its event.
    changed = run_service.cancel_run(db.session, run.tenant_id, run.id)
    reached = run_service.cancel_descendants(db.session, run.tenant_id, run.id)
    below = f" {reached} descendant run(s) cancelled or asked to stop." if reached else ""
    if changed is None:
        flash("The run had already finished; nothing to cancel." + below, "info")
    elif changed.status == RunStatus.CANCELLED:
        flash("Cancelled." + below, "ok")
    else:
        flash("Cancel requested: the run stops at its workflow's next checkpoint." + below,
              "ok")
    log.info("console: cancel of run %s by token %s", run.id, principal.token_id)
    return redirect(url_for("console.run", run_id=run.id), 303)


@bp.post("/runs/<run_id>/redrive")
@signed_in
def redrive(run_id: str):
    principal = g.principal
    if not principal.allows(ADMIT):
        raise ConsoleError(403, "forbidden", "this token may not create runs")
    run = _load_run(run_id)
    if run.status != RunStatus.FAILED:
        raise ConsoleError(409, "not_failed", "only a failed run can be re-driven",
                           {"run_id": str(run.id), "status": run.status})
    try:
        admission = admit_run(
            on_session(db.session), tenant_id=run.tenant_id, workflow_ref=run.workflow_ref,
            input=run.input, goal_id=run.goal_id, dispatch_key=redrive_key(run.id),
            origin=AdmissionOrigin.HTTP, origin_detail=f"console re-drive of {run.id}")
    except registry.UnknownWorkflow as err:
        db.session.rollback()
        raise ConsoleError(422, "unknown_workflow", str(err),
                           {"workflow_ref": run.workflow_ref}) from err
    except AdmissionConflict as err:
        db.session.rollback()
        raise ConsoleError(409, "dispatch_key_conflict", str(err),
                           {"run_id": str(err.existing.id)}) from err
    new_id = admission.run.id
    db.session.commit()
    flash(f"Re-driven as a new run (was failed run {run.id})." if admission.created
          else f"Already re-driven as this run (from failed run {run.id}).", "ok")
    log.info("console: re-drive of run %s as %s by token %s (%s)", run.id, new_id,
             principal.token_id, "created" if admission.created else "replayed")
    return redirect(url_for("console.run", run_id=new_id), 303)


# -- the inbox's dead letters ------------------------------------------------------------------

# Dead letters a page reads at most (a web request must end within gunicorn's
# timeout); a bigger DLQ is replayed with `flask topics replay-dlq`.
MAX_LETTERS = 1000
KAFKA_ERRORS_NOTE = "Kafka did not answer; try again (or use `flask --app app topics replay-dlq`)"


def _kafka() -> dict:
    kafka = current_app.config["POIMEN_CONSOLE_KAFKA"]
    if kafka is None:
        raise ConsoleError(503, "kafka_not_configured",
                           "this web process has no KAFKA_BOOTSTRAP_SERVERS (or KAFKA_URL)")
    return kafka


@bp.get("/schedules")
@signed_in
def schedules():
    """This tenant's schedules: each workflow beat admits on a tick, its next tick, its last run."""
    now = datetime.now(UTC)
    rows = []
    for wf in registry.scheduled():
        if wf.schedule_tenant != g.principal.tenant_name:
            continue
        rows.append({"workflow": wf.name, "schedule": wf.schedule_description(),
                     "catch_up": wf.catch_up, "next": wf.next_tick(now),
                     "last": run_service.last_run_keyed(db.session, wf.schedule_tenant,
                                                        wf.schedule_key_prefix)})
    return render_template("console/schedules.html", schedules=rows)


@bp.get("/inbox")
@signed_in
def inbox():
    from confluent_kafka import KafkaException

    from bridge.dlq import DeadLetterTopic, replay_request
    from bridge.topics import dead_letter_topic

    kafka = _kafka()
    reason = request.args.get("reason", "").strip() or None
    topic = dead_letter_topic(kafka["prefix"], g.principal.tenant_name)
    letters, by_reason, read = [], {}, 0
    try:
        with DeadLetterTopic(kafka["settings"], topic, kafka["group"], timeout=10) as dlq:
            # Where the next replay starts: the letters before it were replayed.
            resume = dlq.resume_offsets() if dlq.exists else {}
            for letter in dlq.read(dlq.low) if dlq.exists else ():
                read += 1
                by_reason[letter.reason or "-"] = by_reason.get(letter.reason or "-", 0) + 1
                if reason is None or letter.reason == reason:
                    verdict = replay_request(letter)
                    if letter.offset < resume.get(letter.partition, 0):
                        verdict = (None, "replayed")
                    elif letter.copy_of:
                        verdict = (None, "copy_of_a_replayed_letter")
                    letters.append(_letter_row(letter, verdict))
                if read >= MAX_LETTERS:
                    break
    except (KafkaException, TimeoutError, RuntimeError) as err:
        raise ConsoleError(503, "kafka_unavailable", KAFKA_ERRORS_NOTE,
                           {"reason": type(err).__name__}) from err
    return render_template("console/inbox.html", topic=topic, letters=letters,
                           by_reason=dict(sorted(by_reason.items())), reason=reason,
                           capped=read >= MAX_LETTERS, max_letters=MAX_LETTERS,
                           can_replay=g.principal.allows(REPLAY_DLQ))


def _letter_row(letter, replayable: tuple[bytes | None, str]) -> dict[str, Any]:
    """What the page shows of a dead letter: where, why, which run it asks for; never its input."""
    value, why = replayable
    body: dict[str, Any] = {}
    try:
        body = json.loads(value or letter.value or b"{}")
    except ValueError:
        pass
    body = body if isinstance(body, dict) else {}
    origin = letter.origin
    return {
        "partition": letter.partition, "offset": letter.offset,
        "at": datetime.fromtimestamp(letter.timestamp_ms / 1000, UTC)
        if letter.timestamp_ms > 0 else None,
        "reason": letter.reason or "-", "detail": letter.dlq.get("detail", ""),
        "origin": f"{origin[0]}[{origin[1]}]@{origin[2]}" if origin else "-",
        "workflow_ref": str(body.get("workflow_ref", "-"))[:200],
        "dispatch_key": str(body.get("dispatch_key", "-"))[:255],
        "replayable": value is not None, "why_not": why,
    }


@bp.post("/inbox/replay")
@signed_in
def replay_inbox():
    from confluent_kafka import KafkaException

    from bridge.dlq import replay_dead_letters

    principal = g.principal
    if not principal.allows(REPLAY_DLQ):
        # A replay re-publishes the tenant's whole DLQ: an operator's action, not a caller's.
        raise ConsoleError(403, "forbidden",
                           "replaying dead letters needs a token with the admin scope "
                           "(flask --app app tokens create --tenant NAME --scope admin)",
                           {"scope": principal.scope, "action": REPLAY_DLQ})
    kafka = _kafka()
    reason = request.form.get("reason", "").strip() or None
    try:
        # The operator's replay (flask topics replay-dlq): safe to repeat, a message
        # keeps its dispatch key (a keyless one gets the key of its origin).
        report = replay_dead_letters(kafka["settings"], kafka["prefix"], principal.tenant_name,
                                     group=kafka["group"], reason=reason, timeout=10)
    except (KafkaException, TimeoutError, RuntimeError) as err:
        raise ConsoleError(503, "kafka_unavailable", KAFKA_ERRORS_NOTE,
                           {"reason": type(err).__name__}) from err
    flash(report.summary(dry_run=False) + ".", "ok")
    log.info("console: DLQ replay of tenant %s (reason %s) by token %s: %d replayed",
             principal.tenant_name, reason or "any", principal.token_id, report.replayed)
    return redirect(url_for("console.inbox", **({"reason": reason} if reason else {})), 303)
