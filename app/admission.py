"""Admission: the one function that creates runs.

The HTTP view, a parent run's fan-out and the tests all call ``admit_run`` (or,
for many runs at once, ``admit_many``: the same rule, one multi-row statement);
nothing else creates runs. Its statements are the store's (``app/state/runs.py``:
``ADMIT``, ``ADMIT_MANY``). Exactly-once is decided by the partial unique index on ``(tenant_id, dispatch_key)``: the insert is ``ON CONFLICT DO
NOTHING RETURNING id`` and a miss reads the row that won, compared with the
request by Postgres. There is no check-then-insert, so concurrent callers with
one key cannot both create.

Numbers survive admission exactly: ``loads`` reads a JSON number with a
fraction or an exponent as an ``ExactNumber`` (a float that keeps its digits)
and ``dumps`` writes those digits back, so what is stored is what was sent.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from json.encoder import (  # the C string encoders the json module uses itself
    encode_basestring,
    encode_basestring_ascii,
)
from typing import Any

from psycopg.types.json import set_json_loads

from workers import registry

from .models import AdmissionOrigin, RunStatus
from .state import runs
from .state.compose import send_row_after_commit
from .state.executor import Executor
from .state.runs import NO_TIMING, AdmittedRun, KeyHolder, Timing
from .tracecontext import TraceContext

_COMPARED = ("workflow_ref", "input", "goal_id", "not_before", "expires_at")

# Keys Poimen derives name one run forever: a schedule's tick (``schedule:``), an inbox
# message's place in its log and so every DLQ replay of it (``kafka:``), a fan-out child
# (admitted with origin ``fanout``). A workflow's ``key_reuse`` is the caller's policy over
# the caller's own keys: applied to a derived key it would run a tick again whenever a beat
# re-admits it, and make a redelivered message a second run.
DERIVED_KEY_PREFIXES = ("schedule:", "kafka:")
_DERIVING_ORIGINS = frozenset({AdmissionOrigin.SCHEDULE.value, AdmissionOrigin.FANOUT.value})

# How often one admission goes round when a key changes hands between its statements (key
# reuse: another caller released the ended holder and had not inserted yet when this one
# read): each round is decided by the index again, and a round ends only on a run.
_KEY_ROUNDS = 8


def key_is_derived(dispatch_key: str, origin: str) -> bool:
    """True if ``dispatch_key`` is one Poimen derived (no key_reuse policy applies to it)."""
    return origin in _DERIVING_ORIGINS or dispatch_key.startswith(DERIVED_KEY_PREFIXES)


def reusable_statuses(workflow: registry.Workflow, dispatch_key: str,
                      origin: str) -> tuple[str, ...]:
    """The ended statuses whose run's key this request may take (none for a derived key)."""
    if key_is_derived(dispatch_key, origin):
        return ()
    return registry.KEY_REUSE_POLICIES[workflow.key_reuse]


class ExactNumber(float):
    """A JSON number with a fraction or an exponent, keeping the digits it was written with.

    Python reads ``0.1000000000000000055511151231257827`` as the nearest double,
    and writing that double back sends a different number. jsonb stores numbers
    as ``numeric``, exactly, so admission reads such numbers as this float
    subclass: code computing with it gets ordinary float arithmetic (workflows
    see floats, as before), and ``dumps`` writes ``text``, the digits as sent.
    """

    __slots__ = ("text",)

    def __new__(cls, text: str) -> ExactNumber:
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __reduce__(self):
        return ExactNumber, (self.text,)


def _not_json(name: str):
    # NaN and Infinity are Python's extensions: not JSON, and jsonb refuses them.
    raise ValueError(f"{name} is not valid JSON")


# One decoder and one encoder per shape, made once: ``json.loads``/``json.dumps`` with
# arguments make a new one per call (more than half of a small document's CPU).
_DECODER = json.JSONDecoder(parse_float=ExactNumber, parse_constant=_not_json)
_ENCODERS: dict[tuple[bool, int | None], json.JSONEncoder] = {}


def loads(data: str | bytes) -> Any:
    """Parse strict JSON, reading non-integer numbers as ``ExactNumber``."""
    if isinstance(data, (bytes, bytearray)):  # as json.loads reads bytes
        data = data.decode(json.detect_encoding(data), "surrogatepass")
    elif not isinstance(data, str):
        raise TypeError(f"the JSON object must be str, bytes or bytearray, not "
                        f"{type(data).__name__}")
    return _DECODER.decode(data)


def _number_text(number: float) -> str:
    if type(number) is ExactNumber:
        return number.text
    if not math.isfinite(number):
        raise ValueError(f"{number!r} is not a JSON number")
    return float.__repr__(number)


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _holds_exact_number(value: Any) -> bool:
    """Whether ``value`` holds an ``ExactNumber`` anywhere (keys included)."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            stack.extend(item.keys())
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            stack.extend(item)
        elif kind is ExactNumber:
            return True
    return False


def dumps(value: Any, *, ascii: bool = False, indent: int | None = None) -> str:
    """Write ``value`` as JSON; an ``ExactNumber`` is written with the digits it was read with.

    The C encoder writes every float subclass through ``float.__repr__``, so a
    value holding one goes through the json module's own pure-Python iteration
    with its C string encoders (five times the CPU); any other value through the
    C encoder, with the same separators and the same refusals (NaN, Infinity and
    non-JSON types raise).
    """
    if not _holds_exact_number(value):
        encoder = _ENCODERS.get((ascii, indent))
        if encoder is None:
            encoder = _ENCODERS[(ascii, indent)] = json.JSONEncoder(
                ensure_ascii=ascii, indent=indent, allow_nan=False,
                separators=(",", ": " if indent is not None else ":"))
        return encoder.encode(value)
    chunks: Iterator[str] = json.encoder._make_iterencode(  # noqa: SLF001 - stable since 2.7
        {},
        _refuse,
        encode_basestring_ascii if ascii else encode_basestring,
        None if indent is None else " " * indent,
        _number_text,
        ": " if indent is not None else ":",
        ",",
        False,
        False,
        True,
    )(value, 0)
    return "".join(chunks)


def read_numbers_exactly(dbapi_connection, _record=None) -> None:
    """Make ``dbapi_connection`` read json/jsonb numbers as ``loads`` does (a ``connect`` hook).

    Runs read back through the API then show the numbers they were admitted with.
    """
    set_json_loads(loads, dbapi_connection)


def unstorable_number(value: float) -> str | None:
    """Return why a parsed JSON number cannot be admitted, or None.

    jsonb could hold 1e400, but every reader that turns JSON numbers into
    doubles (Python's json, psycopg, a worker, JavaScript) reads it as infinity;
    the run would not mean what was sent.
    """
    if not math.isfinite(value):
        return f"{getattr(value, 'text', value)} is outside the range of a double"
    return None


@dataclass(frozen=True)
class Admission:
    """The outcome: the run (every column of ``runs``; a replay's is the ``KeyHolder``, with
    the ``same_*`` comparison columns), and whether this call created it (else a replay)."""

    run: AdmittedRun
    created: bool


class AdmissionConflict(Exception):
    """``dispatch_key`` is taken by a run admitted with a different request."""

    def __init__(self, existing: KeyHolder, fields: list[str]):
        self.existing = existing
        self.fields = fields
        super().__init__(
            f"dispatch_key {existing.dispatch_key!r} already admitted run {existing.id} "
            f"with a different {', '.join(fields)}"
        )


def admit_run(
    session: Executor,
    *,
    tenant_id: int,
    workflow_ref: str,
    input: dict[str, Any],
    goal_id: str | None = None,
    dispatch_key: str | None = None,
    origin: AdmissionOrigin = AdmissionOrigin.INTERNAL,
    origin_detail: str | None = None,
    parent_run_id: uuid.UUID | None = None,
    concurrency_key: str | None = None,
    trace: TraceContext | None = None,
    not_before: datetime | None = None,
    delay_seconds: float | None = None,
    expires_at: datetime | None = None,
    expires_in_seconds: float | None = None,
) -> Admission:
    """Admit one run in ``session``'s transaction; the caller commits.

    Without ``dispatch_key`` every call creates a run. With one, the first call
    creates and later identical calls return the same run (re-sending it to
    the workers if it is still queued); a call that differs raises
    ``AdmissionConflict``. Raises ``registry.UnknownWorkflow`` for a bad ref,
    ``registry.InvalidConcurrencyKey`` for a key that cannot be stored or derived (its
    ``InvalidRateKey`` for a workflow's ``rate_key``).
    ``concurrency_key`` (else the workflow's ``concurrency_key(input)``) names the
    run's concurrency group; a replay keeps the stored run's.
    The run is sent to Celery only after the caller's commit succeeds.
    ``trace`` (W3C Trace Context) is kept on a new run; it is not part of the
    request a replay is compared with, and a replay keeps the first run's.
    ``not_before`` or ``delay_seconds`` (counted by Postgres) delays the run: it is sent
    when due, by beat, never as a Celery ETA. ``expires_at`` or ``expires_in_seconds``: a
    run no worker started by then ends ``expired``. A replay compares an instant with the
    one stored, and a relative time only by its presence (it counts from the first
    admission).
    """
    input_json = dumps(input)
    timing = Timing(not_before, delay_seconds, expires_at, expires_in_seconds)
    try:
        workflow = registry.resolve(workflow_ref)
    except registry.UnknownWorkflow:
        # A replay of a run whose pinned version has since left this process's
        # registry (a rolling deploy, a retired version) is still a replay: the
        # key decides, then the registry.
        replay = None if dispatch_key is None else _replay(
            session, tenant_id, dispatch_key, workflow_ref, input_json, goal_id, timing)
        if replay is None:
            raise
        return replay
    key, limit = registry.concurrency_of(workflow, input, concurrency_key)
    rate_key, rate_interval = registry.rate_of(workflow, input)
    run_id = uuid.uuid4()
    origin_value = AdmissionOrigin(origin).value
    values = dict(
        id=run_id,
        tenant_id=tenant_id,
        workflow_ref=workflow_ref,
        workflow_name=workflow.name,
        workflow_version=workflow.version,
        goal_id=goal_id,
        dispatch_key=dispatch_key,
        origin=origin_value,
        origin_detail=origin_detail,
        parent_run_id=parent_run_id,
        # The resolved definition is pinned with the version: a worker that
        # resolves another one for this version refuses the run (definition_changed).
        definition_hash=workflow.definition_hash,
        concurrency_key=key,
        concurrency_limit=limit,
        rate_key=rate_key,
        rate_interval=rate_interval,
        traceparent=trace.traceparent if trace is not None else None,
        tracestate=trace.tracestate if trace is not None else None,
        **timing.insert(),
    )
    event_fields = {
        "workflow_ref": workflow.ref, "goal_id": goal_id, "dispatch_key": dispatch_key,
        "origin": origin_value,
    }
    # One statement, one round trip: the insert that the index may refuse, and
    # the run.admitted outbox event only for a row that was really inserted.
    # (Plain SQL: building this through the ORM cost more CPU than the database.)
    event_json = json.dumps(event_fields)
    reusable = () if dispatch_key is None else reusable_statuses(workflow, dispatch_key,
                                                                  origin_value)
    for _ in range(_KEY_ROUNDS):
        inserted = runs.admit(session, values, input_json=input_json,
                                    event_json=event_json)
        if inserted is not None:
            return Admission(run=inserted, created=True)
        # The key is taken. A workflow whose policy lets a new request take an ended run's
        # key (key_reuse, caller keys only) tries that first; the index still decides.
        if reusable and runs.release_key(
                session, tenant_id=tenant_id, dispatch_key=dispatch_key,
                workflow_name=workflow.name, reusable=reusable, ttl=workflow.key_ttl or 0):
            continue
        # Under READ COMMITTED this statement sees the row the conflicting transaction
        # committed (ON CONFLICT waited for it).
        replay = _replay(session, tenant_id, dispatch_key, workflow_ref, input_json, goal_id,
                         timing)
        if replay is not None:
            return replay
        # Nobody holds the key: between this request's statements another one released
        # it (key reuse) and has not inserted yet -- possible where each statement commits
        # on its own (the single-request path). Go round: the index decides again.
    raise RuntimeError(f"dispatch_key changed hands {_KEY_ROUNDS} times during one admission")


def _replay(session: Executor, tenant_id: int, dispatch_key: str, workflow_ref: str,
            input_json: str, goal_id: str | None,
            timing: Timing = NO_TIMING) -> Admission | None:
    """Return the run ``dispatch_key`` already names as a replay, None if there is none.

    Raises ``AdmissionConflict`` when the stored request differs (compared by Postgres).
    """
    existing = runs.holder_of_key(
        session, tenant_id=tenant_id, dispatch_key=dispatch_key, workflow_ref=workflow_ref,
        input_json=input_json, goal_id=goal_id, timing=timing)
    if existing is None:
        return None
    outcome = _replay_of(session, existing)
    if isinstance(outcome, AdmissionConflict):
        raise outcome
    return outcome


@dataclass(frozen=True)
class RunRequest:
    """One run ``admit_many`` is asked for: what ``admit_run`` takes per run."""

    workflow_ref: str
    input: dict[str, Any]
    goal_id: str | None = None
    dispatch_key: str | None = None
    concurrency_key: str | None = None
    trace: TraceContext | None = None
    not_before: datetime | None = None
    delay_seconds: float | None = None
    expires_at: datetime | None = None
    expires_in_seconds: float | None = None

    @property
    def timing(self) -> Timing:
        return Timing(self.not_before, self.delay_seconds, self.expires_at,
                      self.expires_in_seconds)

    def fields(self) -> dict[str, Any]:
        """This request as ``admit_run``'s per-run arguments (its fields, by name)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# What admit_many answers per request: the admission, or what admit_run would have raised.
Outcome = Admission | AdmissionConflict | registry.UnknownWorkflow | registry.InvalidConcurrencyKey


def admit_many(
    session: Executor,
    requests: Sequence[RunRequest],
    *,
    tenant_id: int,
    origin: AdmissionOrigin = AdmissionOrigin.INTERNAL,
    origin_detail: str | None = None,
    parent_run_id: uuid.UUID | None = None,
) -> list[Outcome]:
    """Admit ``requests`` in ``session``'s transaction, as ``admit_run`` would one by one,
    in one insert (``ADMIT_MANY``) and one read of the keys it found taken (``HOLDERS``).

    Return one outcome per request, in order: an ``Admission``, or the exception
    ``admit_run`` would have raised for that request alone (``AdmissionConflict``,
    ``registry.UnknownWorkflow``, ``registry.InvalidConcurrencyKey``). A request
    repeating an earlier request's ``dispatch_key`` is a replay of that run (or a
    conflict). A value Postgres refuses (``DataError``) fails the whole statement:
    the caller decides (the API admits each request alone to find the bad one).
    Sends follow the caller's commit, as ``admit_run``'s do.
    """
    outcomes: list[Outcome | None] = [None] * len(requests)
    inserts: list[dict[str, Any]] = []
    workflows: dict[int, registry.Workflow] = {}
    taken: list[int] = []  # requests whose key must be read back: ON CONFLICT skipped them
    for ordinal, req in enumerate(requests):
        try:
            workflow = registry.resolve(req.workflow_ref)
        except registry.UnknownWorkflow as err:
            # As in admit_run: a replay of a run whose version left the registry is a replay.
            outcomes[ordinal] = err
            if req.dispatch_key is not None:
                taken.append(ordinal)
            continue
        try:
            key, limit = registry.concurrency_of(workflow, req.input, req.concurrency_key)
            rate_key, rate_interval = registry.rate_of(workflow, req.input)
        except registry.InvalidConcurrencyKey as err:  # or its InvalidRateKey
            outcomes[ordinal] = err
            continue
        workflows[ordinal] = workflow
        inserts.append(dict(
            ord=ordinal, id=str(uuid.uuid4()), workflow_ref=req.workflow_ref,
            workflow_name=workflow.name, workflow_version=workflow.version, input=req.input,
            goal_id=req.goal_id, dispatch_key=req.dispatch_key,
            definition_hash=workflow.definition_hash, concurrency_key=key,
            concurrency_limit=limit, rate_key=rate_key, rate_interval=rate_interval,
            traceparent=req.trace.traceparent if req.trace is not None else None,
            tracestate=req.trace.tracestate if req.trace is not None else None,
            **req.timing.insert(),
        ))
    origin_value = AdmissionOrigin(origin).value
    if inserts:
        rows = runs.admit_many(session, tenant_id=tenant_id, runs_json=dumps(inserts),
                                     origin=origin_value, origin_detail=origin_detail,
                                     parent_run_id=parent_run_id)
        by_id = {str(row.id): row for row in rows}
        for values in inserts:
            row = by_id.get(values["id"])
            if row is not None:
                outcomes[values["ord"]] = Admission(run=row, created=True)
            elif reusable_statuses(workflows[values["ord"]], values["dispatch_key"],
                                   origin_value):
                # Rare: a policy may let this request take an ended run's key. The single
                # path decides that (RELEASE_KEY, then ADMIT; else a replay or a conflict).
                outcomes[values["ord"]] = _admit_alone(
                    session, requests[values["ord"]], tenant_id=tenant_id, origin=origin,
                    origin_detail=origin_detail, parent_run_id=parent_run_id)
            else:
                taken.append(values["ord"])
    if taken:
        # Under READ COMMITTED this statement sees the rows ON CONFLICT waited for (and
        # those this batch inserted itself); Postgres compares them with each request.
        holders = {row.request_ord: row for row in runs.holders_of_keys(
            session, tenant_id=tenant_id, requests_json=dumps([
                {"ord": i, "dispatch_key": requests[i].dispatch_key,
                 "workflow_ref": requests[i].workflow_ref, "input": requests[i].input,
                 "goal_id": requests[i].goal_id, **requests[i].timing.compared()}
                for i in sorted(taken)]))}
        for ordinal in taken:
            existing = holders.get(ordinal)
            if existing is None:
                if outcomes[ordinal] is None:
                    # The key's holder moved on between the two statements (key reuse by
                    # another caller): decide this one alone, as admit_run does.
                    outcomes[ordinal] = _admit_alone(
                        session, requests[ordinal], tenant_id=tenant_id, origin=origin,
                        origin_detail=origin_detail, parent_run_id=parent_run_id)
                continue  # an unknown workflow and no run holds its key: stays UnknownWorkflow
            outcomes[ordinal] = _replay_of(session, existing)
    return outcomes  # type: ignore[return-value]


def _admit_alone(session: Executor, req: RunRequest, **common: Any) -> Outcome:
    try:
        return admit_run(session, **req.fields(), **common)
    except (AdmissionConflict, registry.UnknownWorkflow, registry.InvalidConcurrencyKey) as err:
        return err


def _replay_of(session: Executor, existing: KeyHolder) -> Admission | AdmissionConflict:
    """The outcome of a request whose key ``existing`` holds (with its ``same_*`` columns)."""
    diffs = [name for name in _COMPARED if not getattr(existing, f"same_{name}")]
    if diffs:
        return AdmissionConflict(existing, diffs)
    if existing.status == RunStatus.QUEUED and existing.due:
        # Its first message may have been lost; a duplicate is absorbed by claims. (A run
        # not due yet is beat's to send: a retry's delayed message, a delayed admission.)
        send_row_after_commit(session, existing)
    return Admission(run=existing, created=False)
