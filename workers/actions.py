"""The kinds of action a step runs, and the keys of their effects.

An action is ``call`` (a function), ``task`` (a Celery task's own function, in
this worker), or a built-in whose effect the ledger writes itself: ``emit`` (an
event) and ``spawn_each`` (child runs, admitted through the same admission).
``prepare`` runs the action's own code and returns its *effect*, a value; the
fence (``workers/fence.py``) writes a built-in's effect in the transaction that
completes the action's marker. Keys are derived from the declaration, never
from what happens to be in the ledger, so a resumed entry derives the same ones.
"""

from __future__ import annotations

import hashlib
import json
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flask import current_app, has_app_context

from poimenconfig import DEFAULT_ERROR_TEXT_MAX_BYTES

from . import registry
from .context import StepContext
from .registry import Action

# A traceback line (a frame, the exception's own line) longer than this is cut, so the
# kept tail of a traceback shows frames, not only the end of a long message.
TRACEBACK_LINE_LIMIT = 1024
MAX_DISPATCH_KEY = 255


@dataclass(frozen=True)
class Output:
    """A ``call`` or ``task`` action's return value."""

    value: Any


@dataclass(frozen=True)
class Emit:
    """An ``emit`` action's event: written with its marker's completion."""

    event_type: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Spawn:
    """A ``spawn_each`` action's children (item key, dispatch key, input): admitted with its
    marker's completion."""

    workflow_ref: str
    children: list[tuple[str, str, dict[str, Any]]]


Effect = Output | Emit | Spawn


def call(ctx: StepContext, act: Action, input: dict[str, Any]) -> Any:
    """Run a ``call`` or ``task`` action; return what it returns."""
    if act.kind == "call":
        if act.fn is None:  # refused at registration (registry._validate)
            raise registry.InvalidDefinition(f"action {act.name!r} calls no function")
        return act.fn(ctx, input)
    if act.kind == "task":
        celery_task = current_app.extensions["celery"].tasks[act.params["task"]]
        kwargs = act.params["kwargs"]
        # The task's own function, in this worker: no message, no second queue.
        return celery_task.run(**(kwargs(ctx, input) if kwargs else input))
    raise registry.InvalidDefinition(f"action kind {act.kind!r} is not callable directly")


def prepare(ctx: StepContext, act: Action, key: str, input: dict[str, Any]) -> Effect:
    """Run a marker-bearing action's own code; for a built-in, compute what it will write."""
    if act.kind in ("call", "task"):
        return Output(call(ctx, act, input))
    if act.kind == "emit":
        data = act.params["data"]
        data = data(ctx, input) if callable(data) else dict(data or {})
        return Emit(act.params["type"], data)
    if act.kind == "spawn_each":
        return Spawn(act.params["workflow_ref"], _fanout(ctx, act, key, input))
    raise registry.InvalidDefinition(f"unknown action kind {act.kind!r}")


def _fanout(ctx: StepContext, act: Action, key: str, input: dict[str, Any]
            ) -> list[tuple[str, str, dict[str, Any]]]:
    over, make_input = act.params["over"], act.params["input"]
    items = list(over(ctx, input) if callable(over) else _path(ctx, over))
    children, seen = [], set()
    for index, item in enumerate(items):
        ikey = item_key(item, index, act.params["key"])
        if ikey in seen:
            raise ValueError(f"spawn_each: two items have the key {ikey!r}")
        seen.add(ikey)
        child_input = (make_input(ctx, item) if make_input is not None
                       else item if isinstance(item, Mapping) else {"item": item})
        children.append((ikey, fanout_key(key, ikey), dict(child_input)))
    return children


def _path(ctx: StepContext, path: str) -> Any:
    head, *rest = path.split(".")
    if head == "input":
        value: Any = ctx.input
    elif head == "outputs":
        value = ctx.outputs
    else:
        raise registry.InvalidDefinition(f"path {path!r} must start with 'input.' or 'outputs.'")
    for part in rest:
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


# -- keys ------------------------------------------------------------------------------------

def idempotency_key(run_id: uuid.UUID, step_id: str, entry_no: int, position: int) -> str:
    """The key of one marker-bearing action's effect: (run, step, entry, position).

    Its inputs come from the declaration (step id, declared position) and the
    entry's number, never from whether a ledger row happens to exist, so a
    resumed entry derives the same key and another entry a different one.
    """
    return f"{run_id}/{step_id}/{entry_no}/{position}"


def item_key(item: Any, index: int, key: str | Callable[[Any], Any] | None) -> str:
    """The key of one fan-out item: ``item[key]``, ``key(item)``, or the item's index."""
    if key is None:
        value: Any = index
    elif callable(key):
        value = key(item)
    else:
        value = item[key]
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return str(value)


def fanout_key(idem_key: str, item: str) -> str:
    """The ``dispatch_key`` of one child: the action's idempotency key and the item key.

    The item key comes last, so no item can make two keys collide; a key too
    long for the column ends in the item key's SHA-256 instead.
    """
    key = f"{idem_key}/{item}"
    if len(key) > MAX_DISPATCH_KEY:
        key = f"{idem_key}/sha256:{hashlib.sha256(item.encode()).hexdigest()}"
    return key


def error_info(err: BaseException, **extra: Any) -> dict[str, Any]:
    """An exception as stored in ``runs.error`` and the ledger (type, message, traceback),
    bounded by ``bound_error``."""
    lines = traceback.format_exception(type(err), err, err.__traceback__)
    tb = "".join(_cut_head(line, TRACEBACK_LINE_LIMIT, "\n") for line in lines)
    return bound_error({**extra, "type": f"{type(err).__module__}.{type(err).__qualname__}",
                        "message": str(err), "traceback": tb})


def error_text_limit() -> int:
    """``POIMEN_ERROR_TEXT_MAX_BYTES`` of the app in context (its default outside one)."""
    if has_app_context():
        return int(current_app.config.get("POIMEN_ERROR_TEXT_MAX_BYTES",
                                          DEFAULT_ERROR_TEXT_MAX_BYTES))
    return DEFAULT_ERROR_TEXT_MAX_BYTES


def bound_error(error: dict[str, Any], limit: int | None = None) -> dict[str, Any]:
    """``error`` as a run, its ledger and its events keep it: at most ``limit`` bytes of
    ``message`` (its head) and of ``traceback`` (its tail), in UTF-8.

    A message quoting a large input (a validation error, an HTTP body) would otherwise
    make the run's ``run.failed`` event larger than a Kafka message may be. A cut
    message is marked ``"error_truncated": true`` with its size in ``error_bytes``.
    """
    limit = error_text_limit() if limit is None else limit
    bounded = dict(error)
    message = bounded.get("message")
    if isinstance(message, str):
        size = len(message.encode("utf-8", "surrogatepass"))
        if size > limit:
            bounded["message"] = _cut_head(message, limit)
            bounded["error_truncated"] = True
            bounded["error_bytes"] = size
    tb = bounded.get("traceback")
    if isinstance(tb, str) and len(tb.encode("utf-8", "surrogatepass")) > limit:
        bounded["traceback"] = tb.encode("utf-8", "surrogatepass")[-limit:].decode(
            "utf-8", "ignore")
    return bounded


def _cut_head(text: str, limit: int, end: str = "") -> str:
    """``text``'s first ``limit`` bytes (whole characters), ``end`` kept after a cut."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", "ignore") + (end if text.endswith(end) else "")
