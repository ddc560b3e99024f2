"""The workflow registry: named, versioned workflows of steps that runs execute.

A workflow is an ordered list of steps; a step is a list of actions, each at a
*declared position*; an action is a registered callable, an existing Celery
task, or a built-in (``spawn_each``, ``emit``)::

    register(Workflow("doc-review", "1", steps=[
        Step("draft", actions=[action(write_draft, position=0)], next="review"),
        Step("review", join=True, next=after_review, actions=[
            action(clear_decisions, position=0, marker=True),
            action(ensure_participant_seat, position=1),
            spawn_each("review-participant", over="input.participants", position=2),
        ]),
        Step("approve", actions=[action(approve, position=0)]),
    ]))

``@workflow("name", version="1")`` on a ``(ctx, input)`` function is sugar for
a one-step, one-action workflow. Marker-bearing actions (``marker=True``, and
the built-ins) have effects beyond the run: the ledger dispatcher
(``workers/ledger.py``) claims each one before executing it.

This module is a leaf: the web process imports it to validate and pin
``workflow_ref`` (and the definition's hash) at admission, so it holds
declarations only and imports nothing of the execution.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import poimenconfig

BUILTIN_MODULES = ("workers.examples",)
REF_PATTERN = re.compile(r"^(?P<name>[A-Za-z0-9_.:-]{1,200})(?:@(?P<version>[A-Za-z0-9_.-]{1,64}))?$")
# Step ids appear in fan-out dispatch keys, separated by '/': no '/' in them.
STEP_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
EVENT_TYPE_PATTERN = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$")
MAX_POSITION = 1_000_000
# How many dead workers a run may outlive; one more and it ends poisoned. The built-in
# default; POIMEN_MAX_TAKEOVERS sets the process's (``default_max_takeovers``).
DEFAULT_MAX_TAKEOVERS = poimenconfig.DEFAULT_MAX_TAKEOVERS
# ctx.outputs of a join entry holds its children's outcomes under this name.
RESERVED_OUTPUT_NAMES = frozenset({"children"})


class UnknownWorkflow(LookupError):
    """``workflow_ref`` names no registered workflow (or no such version)."""


class InvalidDefinition(ValueError):
    """A workflow definition that the ledger could not execute safely."""


def _callable_name(fn: Any) -> str:
    """The stable name of a callable in a definition's hash (module and qualified name)."""
    if fn is None:
        return ""
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}"


@dataclass(frozen=True)
class Action:
    """One action of a step, at a declared position.

    ``kind`` is ``call`` (``fn(ctx, input)``), ``task`` (a Celery task by its
    name, executed in the run's worker through the task's own function),
    ``spawn_each`` or ``emit`` (built-ins, always marker-bearing).
    """

    position: int
    name: str
    kind: str = "call"
    marker: bool = False
    fn: Callable[..., Any] | None = field(default=None, compare=False)
    params: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def describe(self) -> dict[str, Any]:
        """What the definition's hash covers for this action."""
        target: Any
        if self.kind == "call":
            target = _callable_name(self.fn)
        else:
            target = {k: _callable_name(v) if callable(v) else v
                      for k, v in sorted(self.params.items())}
        return {"position": self.position, "name": self.name, "kind": self.kind,
                "marker": self.marker, "target": target}


def action(fn: Callable[..., Any], *, position: int, marker: bool = False,
           name: str | None = None) -> Action:
    """Declare ``fn(ctx, input)`` at ``position``; ``marker=True`` if it has effects
    beyond the run (then it is claimed before it runs and gets ``ctx.idempotency_key``)."""
    return Action(position=position, name=name or fn.__name__, kind="call", marker=marker,
                  fn=fn)


def task(task_name: str, *, position: int, marker: bool = False, name: str | None = None,
         kwargs: Callable[..., Mapping[str, Any]] | None = None) -> Action:
    """Declare the existing Celery task ``task_name`` as an action.

    It runs in the run's worker through the task's own function (no message is
    sent), with keyword arguments ``kwargs(ctx, input)``, or the run's input.
    """
    return Action(position=position, name=name or task_name, kind="task", marker=marker,
                  params={"task": task_name, "kwargs": kwargs})


def spawn_each(workflow_ref: str, *, over: str | Callable[..., Iterable[Any]], position: int,
               key: str | Callable[[Any], Any] | None = None,
               input: Callable[..., Mapping[str, Any]] | None = None,
               name: str = "spawn_each") -> Action:
    """Admit one child run of ``workflow_ref`` per item of ``over`` (marker-bearing).

    ``over`` is a path (``input.participants``, ``outputs.<action>.<field>``)
    or ``over(ctx, input)``. Each child's ``dispatch_key`` is derived from
    (run, step, entry, position, item key): the item key is ``item[key]``
    (``key`` a field name), ``key(item)``, or the item's index. Each child's
    input is ``input(ctx, item)``, else the item itself if it is an object,
    else ``{"item": item}``.
    """
    if not REF_PATTERN.match(workflow_ref):
        raise InvalidDefinition(f"spawn_each: malformed workflow_ref {workflow_ref!r}")
    return Action(position=position, name=name, kind="spawn_each", marker=True,
                  params={"workflow_ref": workflow_ref, "over": over, "key": key,
                          "input": input})


def emit(type: str, data: Mapping[str, Any] | Callable[..., Mapping[str, Any]] | None = None, *,
         position: int, name: str = "emit") -> Action:
    """Write event ``type`` to the outbox with ``data`` (a mapping or ``data(ctx, input)``).

    Marker-bearing: the event is written in the transaction that completes
    the marker, so it exists exactly once per step entry.
    """
    if not EVENT_TYPE_PATTERN.match(type):
        raise InvalidDefinition(f"emit: event type {type!r} must look like 'domain.what'")
    return Action(position=position, name=name, kind="emit", marker=True,
                  params={"type": type, "data": data})


@dataclass(frozen=True)
class Step:
    """A step: actions executed in declared-position order by the ledger dispatcher.

    ``next`` names the following step, or is ``next(ctx)`` of the finished
    entry (``ctx.outputs``, ``ctx.children``) returning a step id or None (the
    end); a step may go back (a loop, a re-review). ``join=True``: after its
    actions, the run waits (status ``waiting``, no worker held) until every
    child this entry spawned has finished. ``on_failure``: the step to enter
    when a marker-bearing action fails or loses its claim (else the run fails).
    """

    id: str
    actions: Sequence[Action]
    next: str | Callable[..., str | None] | None = None
    join: bool = False
    on_failure: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions",
                           tuple(sorted(self.actions, key=lambda a: a.position)))

    @property
    def has_marker(self) -> bool:
        return any(a.marker for a in self.actions)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "join": self.join, "on_failure": self.on_failure,
                "next": _callable_name(self.next),
                "actions": [a.describe() for a in self.actions]}


@dataclass(frozen=True)
class Workflow:
    name: str
    version: str
    steps: Sequence[Step]
    max_attempts: int = 1
    # Lost workers (OOM, segfault, kill -9) a run may outlive; one more and it ends poisoned.
    max_takeovers: int = field(default_factory=lambda: default_max_takeovers())
    backoff_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    retry_on: tuple[type[BaseException], ...] = field(default=(Exception,))
    # result(ctx) of the final entry; default: the output of its last action.
    result: Callable[..., Any] | None = field(default=None, compare=False)
    # A loop that never ends fails the run instead of filling the ledger.
    max_entries: int = 1000
    # Routing and limits, passed to Celery's send_task with every message of a
    # run (``send_options``); not part of the definition's hash: moving a
    # workflow to another queue changes no run's meaning.
    queue: str | None = None
    time_limit: float | None = None
    soft_time_limit: float | None = None
    priority: int | None = None
    # Concurrency (docs/guide/workflows.md#concurrency): at most concurrency_limit
    # runs of one (tenant, workflow, concurrency_key) run at once. The key is the
    # admission's ``concurrency_key``, else ``concurrency_key(input)``, else none
    # (one group per tenant and workflow). Decided at admission and in the claim;
    # not part of the definition's hash (it changes no run's meaning).
    concurrency_limit: int | None = None
    concurrency_key: Callable[[Any], Any] | None = field(default=None, compare=False)
    # Rate limit (docs/guide/workflows.md#rate-limits): at most ``rate_limit`` ("100/m":
    # a count per s, m or h; a bare count is per second, as Celery's) first starts of the
    # runs of one (tenant, workflow, rate_key(input)), across every worker, decided in the
    # claim; pinned on the run at admission as the seconds between two starts. Not part of
    # the definition's hash (it changes no run's meaning).
    rate_limit: str | None = None
    rate_key: Callable[[Any], Any] | None = field(default=None, compare=False)
    # What a dispatch_key may do once its run ended (docs/guide/api.md, "Key reuse"):
    # "never" (the key names that run forever), "after_failure" (a failed or
    # cancelled run's key admits a new run), "after_end" (any ended run's); with
    # key_ttl, only key_ttl seconds after the run ended. Admission's, not the run's:
    # outside the definition's hash.
    key_reuse: str = "never"
    key_ttl: float | None = None
    # A schedule: beat admits one run per tick, keyed by the tick (workers/schedules.py).
    schedule: Any = field(default=None, compare=False)  # seconds, or a celery crontab
    schedule_tenant: str | None = None
    schedule_input: Any = field(default=None, compare=False)  # a dict, or tick -> dict
    catch_up: str = "last"
    definition_hash: str = field(default="", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "retry_on", tuple(self.retry_on))
        _validate(self)
        object.__setattr__(self, "definition_hash", _hash(self))

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def first_step(self) -> Step:
        return self.steps[0]

    def step(self, step_id: str) -> Step:
        for step in self.steps:
            if step.id == step_id:
                return step
        raise KeyError(step_id)

    def has_step(self, step_id: str) -> bool:
        return any(step.id == step_id for step in self.steps)

    @property
    def schedule_key_prefix(self) -> str:
        """What the dispatch key of every scheduled run of this workflow starts with."""
        from .ticks import KEY_PREFIX

        return f"{KEY_PREFIX}{self.name}:"

    def schedule_description(self) -> str:
        from .ticks import describe

        return describe(self.schedule)

    def next_tick(self, now: Any) -> Any:
        """The schedule's first tick after ``now`` (aware, UTC)."""
        from .ticks import next_tick

        return next_tick(self.schedule, now)

    def send_options(self) -> dict[str, Any]:
        """The ``send_task`` options of this workflow's runs (only those that are set)."""
        options = {"queue": self.queue, "time_limit": self.time_limit,
                   "soft_time_limit": self.soft_time_limit, "priority": self.priority}
        return {k: v for k, v in options.items() if v is not None}

    def retry_delay(self, attempt: int) -> float:
        """Return the delay before attempt ``attempt + 1`` (capped exponential)."""
        factor: int = 2 ** max(0, attempt - 1)
        return min(self.backoff_max_seconds, self.backoff_seconds * factor)

    def describe(self) -> dict[str, Any]:
        """The resolved definition: what the hash pinned on a run covers."""
        return {"name": self.name, "version": self.version,
                "steps": [step.describe() for step in self.steps]}


def _unique(values: list[Any], message: str) -> None:
    if len(set(values)) != len(values):
        raise InvalidDefinition(message)


def _validate(wf: Workflow) -> None:
    if not REF_PATTERN.match(f"{wf.name}@{wf.version}"):
        raise InvalidDefinition(f"invalid workflow name or version: {wf.name!r}@{wf.version!r}")
    if not wf.steps:
        raise InvalidDefinition(f"{wf.ref}: a workflow needs at least one step")
    ids = [step.id for step in wf.steps]
    _unique(ids, f"{wf.ref}: step ids must be unique: {ids}")
    for step in wf.steps:
        if not STEP_ID_PATTERN.match(step.id):
            raise InvalidDefinition(f"{wf.ref}: invalid step id {step.id!r}")
        if not step.actions:
            raise InvalidDefinition(f"{wf.ref}: step {step.id!r} has no actions")
        _unique([a.position for a in step.actions],
                f"{wf.ref}: step {step.id!r} declares a position twice")
        _unique([a.name for a in step.actions], f"{wf.ref}: step {step.id!r} names an action twice")
        for a in step.actions:
            if not isinstance(a.position, int) or not 0 <= a.position <= MAX_POSITION:
                raise InvalidDefinition(f"{wf.ref}: position {a.position!r} is not an integer "
                                        f"from 0 to {MAX_POSITION}")
            if a.name in RESERVED_OUTPUT_NAMES:
                raise InvalidDefinition(f"{wf.ref}: the action name {a.name!r} is reserved")
            if a.kind == "call" and not callable(a.fn):
                raise InvalidDefinition(f"{wf.ref}: action {a.name!r} calls no function")
        for target in (step.next if isinstance(step.next, str) else None, step.on_failure):
            if target is not None and target not in ids:
                raise InvalidDefinition(f"{wf.ref}: step {step.id!r} goes to unknown step "
                                        f"{target!r}")
    _validate_routing(wf)
    _validate_admission(wf)


KEY_REUSE_POLICIES = {
    # policy: the statuses of an ended run whose key a new admission may take
    "never": (),
    # (a poisoned run failed: it killed its workers, and its key is free like a failed run's;
    # an expired run never ran, and its key is free like a cancelled run's)
    "after_failure": ("failed", "cancelled", "poisoned", "expired"),
    "after_end": ("succeeded", "failed", "cancelled", "poisoned", "expired"),
}
CATCH_UP = ("last", "none")


def _validate_admission(wf: Workflow) -> None:
    if wf.key_reuse not in KEY_REUSE_POLICIES:
        raise InvalidDefinition(f"{wf.ref}: key_reuse must be one of "
                                f"{', '.join(KEY_REUSE_POLICIES)}, not {wf.key_reuse!r}")
    if wf.key_ttl is not None:
        if wf.key_reuse == "never":
            raise InvalidDefinition(f"{wf.ref}: key_ttl needs key_reuse after_failure or "
                                    "after_end (a key that is never reused has no ttl)")
        if isinstance(wf.key_ttl, bool) or not isinstance(wf.key_ttl, (int, float)) \
                or not wf.key_ttl >= 0:
            raise InvalidDefinition(f"{wf.ref}: key_ttl must be a number of seconds >= 0")
    if wf.schedule is None:
        if wf.schedule_tenant is not None or wf.schedule_input is not None:
            raise InvalidDefinition(f"{wf.ref}: schedule_tenant and schedule_input need a "
                                    "schedule")
        return
    from .ticks import check_schedule  # (ticks loads celery's crontab: only when scheduled)

    problem = check_schedule(wf.schedule)
    if problem:
        raise InvalidDefinition(f"{wf.ref}: {problem}")
    if not wf.schedule_tenant:
        raise InvalidDefinition(f"{wf.ref}: a schedule needs schedule_tenant (the tenant "
                                "its runs are admitted for)")
    if wf.catch_up not in CATCH_UP:
        raise InvalidDefinition(f"{wf.ref}: catch_up must be 'last' or 'none'")
    if wf.schedule_input is not None and not (callable(wf.schedule_input)
                                              or isinstance(wf.schedule_input, Mapping)):
        raise InvalidDefinition(f"{wf.ref}: schedule_input must be a dict or a function of "
                                "the tick")


QUEUE_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


def _validate_routing(wf: Workflow) -> None:
    if wf.queue is not None and not QUEUE_PATTERN.match(wf.queue):
        raise InvalidDefinition(f"{wf.ref}: invalid queue name {wf.queue!r}")
    for name in ("time_limit", "soft_time_limit"):
        value = getattr(wf, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise InvalidDefinition(f"{wf.ref}: {name} must be a positive number of seconds")
    if (wf.time_limit is not None and wf.soft_time_limit is not None
            and wf.soft_time_limit >= wf.time_limit):
        raise InvalidDefinition(f"{wf.ref}: soft_time_limit must be below time_limit (the soft "
                                "limit warns the workflow before the hard one kills it)")
    if wf.concurrency_limit is not None and (isinstance(wf.concurrency_limit, bool)
                                             or not isinstance(wf.concurrency_limit, int)
                                             or wf.concurrency_limit < 1):
        raise InvalidDefinition(f"{wf.ref}: concurrency_limit must be a positive integer")
    if wf.concurrency_key is not None and not callable(wf.concurrency_key):
        raise InvalidDefinition(f"{wf.ref}: concurrency_key must be a function of the input")
    if wf.rate_limit is not None:
        try:
            rate_interval(wf.rate_limit)
        except ValueError as err:
            raise InvalidDefinition(f"{wf.ref}: {err}") from None
    if wf.rate_key is not None and not callable(wf.rate_key):
        raise InvalidDefinition(f"{wf.ref}: rate_key must be a function of the input")
    if wf.rate_key is not None and wf.rate_limit is None:
        raise InvalidDefinition(f"{wf.ref}: rate_key needs a rate_limit")
    if wf.priority is not None and (isinstance(wf.priority, bool)
                                    or not isinstance(wf.priority, int)
                                    or not 0 <= wf.priority <= 255):
        raise InvalidDefinition(f"{wf.ref}: priority must be an integer from 0 to 255")


def _hash(wf: Workflow) -> str:
    canonical = json.dumps(wf.describe(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


_registry: dict[str, dict[str, Workflow]] = {}


def register(wf: Workflow) -> Workflow:
    """Register ``wf`` under ``name@version`` (replacing one of the same version)."""
    _registry.setdefault(wf.name, {})[wf.version] = wf
    return wf


def workflow(
    name: str,
    version: str = "1",
    *,
    max_attempts: int = 1,
    max_takeovers: int | None = None,
    backoff_seconds: float = 1.0,
    backoff_max_seconds: float = 60.0,
    retry_on: Iterable[type[BaseException]] = (Exception,),
    queue: str | None = None,
    time_limit: float | None = None,
    soft_time_limit: float | None = None,
    priority: int | None = None,
    concurrency_limit: int | None = None,
    concurrency_key: Callable[[Any], Any] | None = None,
    rate_limit: str | None = None,
    rate_key: Callable[[Any], Any] | None = None,
    key_reuse: str = "never",
    key_ttl: float | None = None,
    schedule: Any = None,
    schedule_tenant: str | None = None,
    schedule_input: Any = None,
    catch_up: str = "last",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated ``(ctx, input)`` function as workflow ``name@version``.

    Sugar for a workflow of one step (``main``) with one action at position 0
    that is not marker-bearing: a run lost mid-way starts it again from the top.
    ``queue``, ``time_limit``, ``soft_time_limit`` and ``priority`` go to
    Celery with every message of its runs (docs/guide/celery.md). ``key_reuse`` /
    ``key_ttl``: what a ``dispatch_key`` may do once its run ended; ``schedule``
    (seconds, or a ``celery.schedules.crontab``) with ``schedule_tenant``,
    ``schedule_input`` and ``catch_up``: beat admits one run per tick
    (docs/guide/workflows.md). ``concurrency_limit`` and ``concurrency_key`` limit
    how many of its runs run at once (docs/guide/workflows.md#concurrency);
    ``rate_limit`` ("100/m") and ``rate_key`` how many start per period, across every
    worker (docs/guide/workflows.md#rate-limits).
    """
    if not REF_PATTERN.match(f"{name}@{version}"):
        raise ValueError(f"invalid workflow name or version: {name!r}@{version!r}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        register(Workflow(
            name=name,
            version=version,
            steps=[Step("main", actions=[action(fn, position=0)])],
            max_attempts=max(1, max_attempts),
            max_takeovers=max(0, default_max_takeovers() if max_takeovers is None
                              else max_takeovers),
            backoff_seconds=backoff_seconds,
            backoff_max_seconds=backoff_max_seconds,
            retry_on=tuple(retry_on),
            queue=queue,
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            priority=priority,
            concurrency_limit=concurrency_limit,
            concurrency_key=concurrency_key,
            rate_limit=rate_limit,
            rate_key=rate_key,
            key_reuse=key_reuse,
            key_ttl=key_ttl,
            schedule=schedule,
            schedule_tenant=schedule_tenant,
            schedule_input=schedule_input,
            catch_up=catch_up,
        ))
        return fn

    return decorate


def _version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    # Natural order, so "10" is newer than "9" and "1.10" newer than "1.9".
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.-]", version))


def resolve(ref: str) -> Workflow:
    """Return the workflow ``ref`` names; a bare name means its newest version."""
    match = REF_PATTERN.match(ref)
    if not match:
        raise UnknownWorkflow(f"malformed workflow_ref {ref!r}; expected 'name' or 'name@version'")
    versions = _registry.get(match["name"])
    if not versions:
        raise UnknownWorkflow(f"no workflow named {match['name']!r} is registered")
    version = match["version"]
    if version is None:
        return versions[max(versions, key=_version_key)]
    if version not in versions:
        raise UnknownWorkflow(
            f"workflow {match['name']!r} has no version {version!r} "
            f"(registered: {', '.join(sorted(versions, key=_version_key))})"
        )
    return versions[version]


def get(name: str, version: str) -> Workflow:
    """Return the exact pinned workflow a run was admitted with."""
    return resolve(f"{name}@{version}")


def default_max_takeovers() -> int:
    """The lost workers a run may outlive where its workflow does not say:
    ``POIMEN_MAX_TAKEOVERS``, else ``DEFAULT_MAX_TAKEOVERS``."""
    return poimenconfig.max_takeovers_setting()


def max_takeovers_of(name: str, version: str) -> int:
    """How many lost workers a run of ``name@version`` may outlive (the default if unknown)."""
    try:
        return get(name, version).max_takeovers
    except UnknownWorkflow:
        return default_max_takeovers()


MAX_CONCURRENCY_KEY_LEN = 255


class InvalidConcurrencyKey(ValueError):
    """A concurrency key (given, or derived from the input) that cannot be stored."""

    field = "concurrency_key"  # the request field a refusal names


class InvalidRateKey(InvalidConcurrencyKey):
    """A rate key derived from the input that cannot be stored."""

    field = "rate_key"


# A rate limit's period, by its unit (Celery's spelling: "10/s", "100/m", "1000/h").
_RATE_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(?:/\s*([smh]))?\s*$")


def rate_interval(limit: str) -> float:
    """The seconds between two starts that ``limit`` allows ("100/m" -> 0.6; a bare count
    is per second, as Celery's ``rate_limit``). Raises ``ValueError`` for anything else."""
    match = _RATE.match(limit) if isinstance(limit, str) else None
    count = float(match[1]) if match else 0.0
    if not match or not 0 < count <= 1_000_000:
        raise ValueError(f"rate_limit must be a count per s, m or h, like '100/m' "
                         f"(got {limit!r})")
    return _RATE_PERIODS[match[2] or "s"] / count


def rate_of(wf: Workflow, input: Any) -> tuple[str | None, float | None]:
    """The (rate_key, rate_interval) a run of ``wf`` with ``input`` is admitted with:
    ``(None, None)`` for a workflow without a ``rate_limit``. Raises ``InvalidRateKey``."""
    if wf.rate_limit is None:
        return None, None
    return _key(wf, wf.rate_key, input, None, InvalidRateKey), rate_interval(wf.rate_limit)


def concurrency_of(wf: Workflow, input: Any, given: str | None = None
                   ) -> tuple[str | None, int | None]:
    """The (concurrency_key, concurrency_limit) a run of ``wf`` with ``input`` is admitted with.

    ``given`` (the admission's ``concurrency_key``) wins over the workflow's
    ``concurrency_key(input)``; a key of a workflow without a limit is kept
    (it shows in the run) but limits nothing. Raises ``InvalidConcurrencyKey``.
    """
    return (_key(wf, wf.concurrency_key, input, given, InvalidConcurrencyKey),
            wf.concurrency_limit)


def _key(wf: Workflow, derive: Callable[[Any], Any] | None, input: Any, given: str | None,
         invalid: type[InvalidConcurrencyKey]) -> str | None:
    """A run's key (``invalid.field``): ``given``, else ``derive(input)`` (a string, or an
    integer made one), else none; 1 to ``MAX_CONCURRENCY_KEY_LEN`` characters, no U+0000.
    Raises ``invalid``, naming the exception type a derivation raised, never the input."""
    name = invalid.field
    key: Any = given
    if key is None and derive is not None:
        try:
            key = derive(input)
        except Exception as err:  # noqa: BLE001 - the input lacks what the key needs
            raise invalid(f"{wf.ref}: {name} could not be derived from the input "
                          f"({type(err).__name__})") from err
        if key is not None and not isinstance(key, str):
            if isinstance(key, bool) or not isinstance(key, int):
                raise invalid(f"{wf.ref}: {name} derived a {type(key).__name__}; "
                              "it must derive a string or an integer")
            key = str(key)
    if key is not None and not 1 <= len(key) <= MAX_CONCURRENCY_KEY_LEN:
        raise invalid(f"{name} must be 1 to {MAX_CONCURRENCY_KEY_LEN} characters")
    if key is not None and "\x00" in key:
        raise invalid(f"{name} contains U+0000")
    return key


def registered() -> list[Workflow]:
    """Return every registered workflow version."""
    return [wf for versions in _registry.values() for wf in versions.values()]


def scheduled() -> list[Workflow]:
    """The newest version of every registered workflow that declares a schedule."""
    newest = [versions[max(versions, key=_version_key)] for versions in _registry.values()]
    return sorted((wf for wf in newest if wf.schedule is not None), key=lambda wf: wf.name)


def load_modules(modules: Iterable[str]) -> None:
    """Import the built-in examples and each module in ``modules`` (they register on import)."""
    for module in (*BUILTIN_MODULES, *modules):
        importlib.import_module(module)
