"""What the store's functions run their statements on: an ``Executor``.

Two things satisfy it: a SQLAlchemy ``Session`` through ``SessionExecutor``
(``on_session(db.session)``: the statements run in the session's transaction),
and ``direct.SingleStatements``, each statement a transaction of its own on
psycopg. A store function reads what a statement returned through ``Rows`` and
answers with a result type of its module (a frozen dataclass, built by
``build``), never a driver's row.

A transition that re-queues or admits a run asks for its message through the
executor's ``pending`` (``PendingSends``): the runs to send once the work
commits. ``SingleStatements.commit()`` hands them to its sender; for a session
the ``after_commit`` hook (``app/enqueue.py``) takes them with
``take_pending(session)``, and ``after_rollback`` forgets them with
``forget_pending(session)``.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any, NamedTuple, Protocol, TypeVar, cast

from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session, scoped_session
from sqlalchemy.sql.expression import Executable


class Rows(Protocol):
    """What the store reads of one statement's result (SQLAlchemy's ``CursorResult``,
    ``direct.Result``)."""

    @property
    def rowcount(self) -> int: ...

    def one(self) -> Any: ...

    def one_or_none(self) -> Any: ...

    def scalar(self) -> Any: ...

    def scalar_one(self) -> Any: ...

    def all(self) -> Sequence[Any]: ...


class Send(NamedTuple):
    """One run's message, to send once the transaction that asked for it commits: its
    workflow ref, its W3C Trace Context (the run's columns, as plain values), and what the
    message tells Celery (and Flower) of the run's attempt and run tree
    (``compose.tree_of``)."""

    workflow_ref: str
    traceparent: str | None = None
    tracestate: str | None = None
    retries: int = 0
    parent_id: str | None = None
    root_id: str | None = None


class PendingSends:
    """The runs a unit of work asked to send once it commits, by run id (a later ask for a
    run replaces an earlier one)."""

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs: dict[uuid.UUID, Send] = {}

    def add(self, run_id: uuid.UUID, send: Send) -> None:
        self.runs[run_id] = send

    def take(self) -> dict[uuid.UUID, Send]:
        """The runs to send, leaving none (what a commit hands to the sender)."""
        runs, self.runs = self.runs, {}
        return runs

    def clear(self) -> None:
        """Forget them (a rollback: beat re-sends queued runs)."""
        self.runs = {}

    def __contains__(self, run_id: object) -> bool:
        return run_id in self.runs

    def __iter__(self) -> Iterator[uuid.UUID]:
        return iter(self.runs)

    def __len__(self) -> int:
        return len(self.runs)


class Executor(Protocol):
    """Where a store function runs its statements, and leaves the runs to send."""

    @property
    def pending(self) -> PendingSends: ...

    def execute(self, statement: Executable,
                params: Mapping[str, Any] | None = None) -> Rows: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...


# The sends each session's transaction asked for, held apart from the session (which keeps
# no reference to them) and dropped with it.
_PENDING: weakref.WeakKeyDictionary[Session, PendingSends] = weakref.WeakKeyDictionary()
_PENDING_LOCK = threading.Lock()


class SessionExecutor:
    """A SQLAlchemy ``Session`` as an ``Executor``: its statements in the session's
    transaction; ``pending`` is the session's, sent by its ``after_commit``."""

    __slots__ = ("session", "pending")

    def __init__(self, session: Session):
        self.session = session
        pending = _PENDING.get(session)
        if pending is None:
            with _PENDING_LOCK:
                pending = _PENDING.setdefault(session, PendingSends())
        self.pending = pending

    def execute(self, statement: Executable,
                params: Mapping[str, Any] | None = None) -> Rows:
        return cast(CursorResult[Any], self.session.execute(statement, params))

    def commit(self) -> None:
        self.session.commit()

    def rollback(self) -> None:
        self.session.rollback()


def on_session(session: Session | scoped_session[Any]) -> SessionExecutor:
    """``session`` (a ``scoped_session``: its current ``Session``) as an ``Executor``."""
    return SessionExecutor(session() if isinstance(session, scoped_session) else session)


def take_pending(session: Session) -> dict[uuid.UUID, Send]:
    """The runs ``session``'s committed transaction left to send (none left behind)."""
    pending = _PENDING.get(session)
    return pending.take() if pending is not None else {}


def forget_pending(session: Session) -> None:
    """Forget the runs ``session``'s rolled-back transaction asked to send."""
    pending = _PENDING.get(session)
    if pending is not None:
        pending.clear()


T = TypeVar("T")
_MAKERS: dict[type[Any], Callable[[Any], Any]] = {}


def build(result: type[T], row: Any) -> T:
    """A ``result`` (a frozen dataclass) of ``row``'s columns of the same names; the row's
    other columns are not read."""
    make = _MAKERS.get(result)
    if make is None:
        make = _MAKERS[result] = _maker(result)
    return cast(T, make(row))


def _maker(result: type[Any]) -> Callable[[Any], Any]:
    """How ``build`` makes a ``result``: its fields' values set in one step on a new
    instance, without the generated ``__init__``, which sets a frozen dataclass's fields
    one ``object.__setattr__`` at a time (a third of a batch admission's Python time
    per row). A result type declares no ``__post_init__`` and no ``__slots__``, so the
    instance is the one ``__init__`` would make: equal, hashed and frozen the same."""
    if not dataclasses.is_dataclass(result) or hasattr(result, "__post_init__") \
            or "__slots__" in result.__dict__:
        raise TypeError(f"{result.__name__}: a result is a dataclass without "
                        "__post_init__ or __slots__")
    names = tuple(f.name for f in dataclasses.fields(result))
    getter = attrgetter(*names)
    read = getter if len(names) > 1 else (lambda row: (getter(row),))
    new = object.__new__

    def make(row: Any) -> Any:
        made = new(result)
        made.__dict__.update(zip(names, read(row), strict=True))
        return made

    return make
