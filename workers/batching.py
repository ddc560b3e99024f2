"""The batching worker (``POIMEN_WORKER_MODE=batch``): one process running Celery's threads
pool, whose runs' claims and finishes the store batcher sends many at once: one statement
for each batch, and one transaction with one commit for a claim batch and a finish batch
taken together (docs/internals/batching.md).

Every rule stays per run. A claim in a batch is ``claim_queued``'s compare-and-set and
liveness check, row by row, in one statement (``claim_queued_batch``); a finish is
``poimen_finish`` run by run, in one call (``poimen_finish_batch``). The order:

1. A thread's claim is sent in the next batch; its body starts only once that statement
   returned (with the finishes sent beside it, once their transaction committed): the
   claim is committed.
2. Its finish is sent in a later batch; the run is reported (its events, the task's
   answer to Celery, the acknowledgement) only once that statement returned.
3. What the batch statements refuse or cannot decide goes the single-run way: a run not
   claimed asks why with ``claim_run``; a run of a limited group or a capped or
   rate-limited tenant never enters a batch; a finish whose batch failed (one value
   ``jsonb`` refuses fails the statement) is sent alone, so only the bad one fails.
4. A batch claim whose outcome is unknown (the connection broke while it ran) is decided
   per run, not by ending the boot: its backend is ended and awaited, then the runs this
   boot holds are read. No other thread of this process claims a run while one handles
   it (``boots.begin_claim``), so a run of the batch held by this boot is one the batch
   claimed. A finish of unknown outcome is sent again alone: fenced, it is refused if the
   first one applied, and recognised as ours.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from flask import current_app
from sqlalchemy.exc import DBAPIError

from app.metrics import WORKER_BATCH_SIZE, labelled
from app.state.claims import (
    ClaimedRun,
    FinishedInBatch,
    backend_gone,
    claim_batch,
    claim_batch_call,
    claimed_by_batch,
    claimed_in_batch,
    end_backend,
    finish_batch,
    finish_batch_call,
    finished_by_batch,
)
from app.state.direct import OwnConnection

from . import boots, registry

log = logging.getLogger(__name__)


class BatchFailed(RuntimeError):
    """The batch's statement failed: its request goes the single-run way."""


class ClaimUnknown(RuntimeError):
    """A batch claim's outcome could not be decided per run (the boot itself is gone, or
    Postgres stayed away): the worker ends its boot, as after a single claim's."""


@dataclass(eq=False)
class _Request:
    run_id: uuid.UUID
    boot_id: uuid.UUID | None = None  # a claim's boot
    boots: tuple[uuid.UUID, ...] = ()  # a finish's fence
    params: Mapping[str, Any] | None = None  # a finish's ``finish_params``
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self.done.set()

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class Batcher:
    """Sends the claims and finishes handed to it, many per statement.

    ``dsn``: a direct connection to the runs' database (the lock database's: a batch's
    backend must be a real one to end, never a pooler's). ``window``: seconds to wait for
    more requests after the first, unless every thread executing a run is already waiting
    on this batcher (``enter``/``leave`` count them). ``linger``: under load, how long after
    the first request it may then still wait for runs not in flight yet, until ``threads``
    (the pool's size) all wait (``_linger_for_more``; 0: never). ``live(boot)``: whether
    ``boot`` is still this process's boot and holds its lock.
    """

    def __init__(self, dsn: Callable[[], str], *, window: float, max_size: int,
                 live: Callable[[uuid.UUID], bool], resolve_seconds: float = 30.0,
                 connect_kwargs: Mapping[str, Any] | None = None, linger: float = 0.0,
                 threads: int | None = None):
        self._dsn = dsn
        self._window = window
        self._linger = linger
        self._threads = threads
        self._arrivals = Arrivals()
        self._lingering = False
        self._max = max(1, max_size)
        self._live = live
        self._resolve_seconds = resolve_seconds
        self._connect_kwargs = dict(connect_kwargs or {})
        self._cond = threading.Condition()
        self._claims: list[_Request] = []
        self._finishes: list[_Request] = []
        self._active = 0
        self._conn: OwnConnection | None = None
        self._thread: threading.Thread | None = None
        # How many runs each statement carried: {size: statements} per kind.
        self.sizes: dict[str, Counter[int]] = {"claim": Counter(), "finish": Counter()}

    # -- what a run's thread calls ----------------------------------------------------------

    def enter(self) -> None:
        """A thread starts handling a delivery."""
        with self._cond:
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify()

    def claim(self, run_id: uuid.UUID, boot_id: uuid.UUID) -> ClaimedRun | None:
        """Claim ``run_id`` for ``boot_id`` in the next batch: its row once committed, None
        if the batch did not claim it (ask why on the single-run path). Raises
        ``ClaimUnknown`` when its outcome could not be decided."""
        value: ClaimedRun | None = self._submit("claim", _Request(run_id, boot_id=boot_id))
        return value

    def finish(self, run_id: uuid.UUID, boots: Iterable[uuid.UUID],
               params: Mapping[str, Any]) -> FinishedInBatch | None:
        """End ``run_id`` (``finish_params``) in the next batch, fenced by ``boots``: the
        run as ended, once committed; None if the fence refused it. Raises
        ``BatchFailed`` when the batch's statement failed (send it alone)."""
        value: FinishedInBatch | None = self._submit(
            "finish", _Request(run_id, boots=tuple(boots), params=params))
        return value

    def _submit(self, kind: str, request: _Request) -> Any:
        # The queue is read under the lock the batcher takes it under: a queue read before
        # a take would be the list that take already emptied, and the request would wait
        # there forever, unsent (its run queued, its thread gone).
        with self._cond:
            self._start()
            queue = self._claims if kind == "claim" else self._finishes
            queue.append(request)
            self._arrivals.note(time.monotonic())
            if not self._lingering or self._enough():
                self._cond.notify()
        return request.wait()

    # -- the batcher's thread ---------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="poimen-batcher",
                                            daemon=True)
            self._thread.start()

    def _at_max(self) -> bool:
        return len(self._claims) >= self._max or len(self._finishes) >= self._max

    def _waiting(self) -> int:
        """Requests waiting on this batcher: one per thread at most."""
        return len(self._claims) + len(self._finishes)

    def _enough(self) -> bool:
        """No more requests can come in time: a batch at its maximum, or every thread of
        the pool waiting on this batcher."""
        return self._at_max() or (
            self._threads is not None
            and self._waiting() >= self._threads)

    def _full(self) -> bool:
        return self._at_max() or self._waiting() >= self._active

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._claims or self._finishes):
                    self._cond.wait()
                started = time.monotonic()
                deadline = started + self._window
                while not self._full():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._linger_for_more(started + self._linger)
                claims, finishes = self._take()
            by_boot = _claims_by_boot(claims)
            if finishes and len(by_boot) == 1:
                # One transaction, one commit for the claims and the finishes taken
                # together (docs/internals/batching.md, "One commit for both kinds").
                [(boot_id, first)] = by_boot.items()
                self._guarded([*first.values(), *finishes], self._send_together, first,
                              boot_id, finishes)
                continue
            for boot_id, first in by_boot.items():
                self._guarded(list(first.values()), self._send_claims, first, boot_id)
            if finishes:
                self._guarded(finishes, self._send_finishes, finishes)

    def _linger_for_more(self, until: float) -> None:
        """Under load, wait until ``until`` for requests of runs not in flight yet: the
        rate they arrive at says at least one more is due by then (under ``_cond``)."""
        left = until - time.monotonic()
        if left <= 0 or self._enough() or self._arrivals.expected(left) < 1.0:
            return
        self._lingering = True
        try:
            while left > 0 and not self._enough():
                self._cond.wait(left)
                left = until - time.monotonic()
        finally:
            self._lingering = False

    @staticmethod
    def _guarded(requests: list[_Request], send: Callable[..., None], *args: Any) -> None:
        """``send(*args)``; should it raise, each of ``requests`` not answered yet fails
        (to be sent alone): no thread may wait forever."""
        try:
            send(*args)
        except BaseException as err:  # noqa: BLE001 - no thread may wait forever
            log.exception("store batcher: %d request(s) failed", len(requests))
            for request in requests:
                if not request.done.is_set():
                    request.resolve(error=BatchFailed(type(err).__name__))

    def _take(self) -> tuple[list[_Request], list[_Request]]:
        """The next batch of each kind, taken off the queues (under ``_cond``)."""
        claims, self._claims = self._claims[:self._max], self._claims[self._max:]
        finishes, self._finishes = self._finishes[:self._max], self._finishes[self._max:]
        return claims, finishes

    def _connection(self) -> OwnConnection:
        if self._conn is None or self._conn.conn.closed:
            self._conn = OwnConnection(psycopg.connect(self._dsn(), autocommit=True,
                                                       **self._connect_kwargs))
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.conn.close()
            except Exception:  # noqa: BLE001 - it is being dropped
                pass

    def _send_claims(self, first: dict[uuid.UUID, _Request], boot_id: uuid.UUID) -> None:
        """One claim statement for the runs of ``first`` (each run once), all of
        ``boot_id``."""
        try:
            conn = self._connection()
        except Exception:  # noqa: BLE001 - nothing was sent: nothing claimed
            log.warning("store batcher: could not connect; %d claim(s) go alone", len(first))
            for request in first.values():
                request.resolve(None)
            return
        pid = conn.conn.info.backend_pid
        try:
            claimed = claim_batch(conn, list(first), boot_id)
        except DBAPIError as err:
            if not conn.conn.closed and _answered(err):
                # Postgres answered with an error: the statement rolled back whole.
                log.warning("store batcher: a claim batch was refused (%s); its %d "
                            "run(s) go alone", _code(err), len(first))
                claimed = {}
            else:
                self._claims_unknown(first, boot_id, pid, err)
                return
        self._claimed(first, claimed)

    def _claimed(self, first: dict[uuid.UUID, _Request],
                 claimed: Mapping[uuid.UUID, ClaimedRun]) -> None:
        """Answer a committed claim batch's requests: each its row, or None."""
        self.sizes["claim"][len(first)] += 1
        labelled(WORKER_BATCH_SIZE, "claim").observe(len(first))
        for run_id, request in first.items():
            request.resolve(claimed.get(run_id))

    def _claims_unknown(self, first: dict[uuid.UUID, _Request], boot_id: uuid.UUID, pid: int,
                        err: BaseException) -> None:
        """The claim batch sent on backend ``pid`` has an unknown outcome: decide each of
        its runs once that backend has ended."""
        self._drop()
        log.warning("store batcher: a claim batch's outcome is unknown (%s); deciding its %d "
                    "run(s) one by one", type(err).__name__, len(first))
        decided = self._decide_claims(list(first), boot_id, pid)
        for request in first.values():
            if decided is None:
                request.resolve(error=ClaimUnknown(
                    f"batch claim of run {request.run_id}: outcome unknown"))
            else:
                request.resolve(decided.get(request.run_id))

    def _send_together(self, first: dict[uuid.UUID, _Request], boot_id: uuid.UUID,
                       finishes: list[_Request]) -> None:
        """The claim statement for ``first`` and the finish statement for ``finishes`` in
        one transaction, sent in one round trip (``OwnConnection.together``): one commit
        for both, and every request answered only after it.
        An error Postgres answers rolls both back: the claims go the single-run way (None)
        and the finishes alone. An unknown outcome (the connection broke) decides each
        claim once the backend has ended; the finishes then go alone, fenced (one that
        had applied is refused there and recognised as this process's)."""
        ends, boots = _finish_arguments(finishes)
        try:
            conn = self._connection()
        except Exception:  # noqa: BLE001 - nothing was sent: nothing claimed or ended
            log.warning("store batcher: could not connect; %d claim(s) and %d finish(es) go "
                        "alone", len(first), len(finishes))
            for request in first.values():
                request.resolve(None)
            _fail(finishes, "OperationalError")
            return
        pid = conn.conn.info.backend_pid
        try:
            claim_result, finish_result = conn.together([
                claim_batch_call(list(first), boot_id), finish_batch_call(ends, boots)])
        except DBAPIError as err:
            if not conn.conn.closed and _answered(err):
                # Postgres answered with an error: the transaction rolled back whole.
                log.warning("store batcher: a claim and finish batch was refused (%s); its "
                            "%d claim(s) and %d finish(es) go alone", _code(err),
                            len(first), len(finishes))
                for request in first.values():
                    request.resolve(None)
                _fail(finishes, type(err).__name__)
                return
            self._claims_unknown(first, boot_id, pid, err)
            _fail(finishes, type(err).__name__)
            return
        self._claimed(first, claimed_by_batch(claim_result))
        self._finished(finishes, finished_by_batch(finish_result))

    def _decide_claims(self, run_ids: list[uuid.UUID], boot_id: uuid.UUID, pid: int
                       ) -> dict[uuid.UUID, ClaimedRun] | None:
        """The runs the batch of unknown outcome claimed, read once its backend ``pid`` has
        ended (its transaction decided); None if that cannot be known in time, or if the
        boot lost its lock meanwhile (its runs are then wreckage, taken over after the
        bound, as any dead boot's)."""
        deadline = time.monotonic() + self._resolve_seconds
        while time.monotonic() < deadline:
            try:
                conn = self._connection()
                end_backend(conn, pid)
                while not backend_gone(conn, pid):
                    if time.monotonic() > deadline:
                        return None
                    time.sleep(0.05)
                if not self._live(boot_id):
                    return None
                return claimed_in_batch(conn, run_ids, boot_id)
            except Exception as err:  # noqa: BLE001 - Postgres may be restarting
                self._drop()
                log.warning("store batcher: deciding a claim batch: %s; retrying",
                            type(err).__name__)
                time.sleep(0.2)
        return None

    def _send_finishes(self, requests: list[_Request]) -> None:
        ends, boots = _finish_arguments(requests)
        try:
            conn = self._connection()
            done = finish_batch(conn, ends, boots)
        except DBAPIError as err:
            if conn_closed(self._conn):
                self._drop()
            log.warning("store batcher: a finish batch failed (%s); its %d run(s) end alone",
                        _code(err) or type(err).__name__, len(requests))
            _fail(requests, type(err).__name__)
            return
        except psycopg.Error as err:
            self._drop()
            _fail(requests, type(err).__name__)
            return
        self._finished(requests, done)

    def _finished(self, requests: list[_Request],
                  done: Mapping[uuid.UUID, FinishedInBatch]) -> None:
        """Answer a committed finish batch's requests: each its ended run, or None."""
        self.sizes["finish"][len(requests)] += 1
        labelled(WORKER_BATCH_SIZE, "finish").observe(len(requests))
        for request in requests:
            request.resolve(done.get(request.run_id))


class Arrivals:
    """When the batcher's requests arrive: the mean gap between two (exponentially
    weighted, so a pause counts at once), and how many more are due within a time."""

    WEIGHT = 0.125

    def __init__(self) -> None:
        self._last: float | None = None
        self._gap = math.inf

    def note(self, now: float) -> None:
        """A request arrived at ``now`` (``time.monotonic()``)."""
        if self._last is not None:
            gap = max(0.0, now - self._last)
            self._gap = gap if math.isinf(self._gap) else \
                self._gap + self.WEIGHT * (gap - self._gap)
        self._last = now

    def expected(self, within: float) -> float:
        """How many requests are due within ``within`` seconds at the recent rate."""
        if math.isinf(self._gap):
            return 0.0
        return within / max(self._gap, 1e-6)


def _claims_by_boot(requests: list[_Request]) -> dict[uuid.UUID, dict[uuid.UUID, _Request]]:
    """The claim requests by boot, each run once: a second delivery of a run in one batch
    is answered None here (the single-run path decides it)."""
    by_boot: dict[uuid.UUID, dict[uuid.UUID, _Request]] = {}
    for request in requests:
        assert request.boot_id is not None  # a claim names its boot
        first = by_boot.setdefault(request.boot_id, {})
        if request.run_id in first:
            request.resolve(None)
        else:
            first[request.run_id] = request
    return by_boot


def _finish_arguments(requests: list[_Request]
                      ) -> tuple[list[dict[str, Any]], list[uuid.UUID]]:
    """``finish_batch``'s ends and fence for the finish ``requests``."""
    boots = sorted({boot for request in requests for boot in request.boots})
    return [{**(request.params or {}), "run": request.run_id} for request in requests], boots


def _fail(requests: list[_Request], reason: str) -> None:
    """Each of ``requests`` fails, to be sent alone."""
    for request in requests:
        request.resolve(error=BatchFailed(reason))


def conn_closed(conn: OwnConnection | None) -> bool:
    return conn is None or conn.conn.closed


def _answered(err: DBAPIError) -> bool:
    """Postgres answered the statement with an error (it rolled back), as opposed to a
    connection that broke with no answer."""
    code = _code(err)
    return code is not None and not code.startswith("08")


def _code(err: DBAPIError) -> str | None:
    code = getattr(err.orig, "sqlstate", None)
    return None if code is None else str(code)


# -- this process's batcher --------------------------------------------------------------------

_batcher: Batcher | None = None
pool_threads: int | None = None  # the worker's --concurrency (workers/tasks.py, at its start)
_batcher_lock = threading.Lock()


def active() -> bool:
    """Whether this worker runs in batch mode (``POIMEN_WORKER_MODE=batch``)."""
    return bool(current_app.config.get("POIMEN_WORKER_MODE") == "batch")


def batcher() -> Batcher:
    """This process's store batcher, made on first use (in an app context)."""
    global _batcher
    with _batcher_lock:
        if _batcher is None:
            config = current_app.config
            dsn = boots.boot_dsn()  # read here: the batcher's thread has no app context
            _batcher = Batcher(
                lambda: dsn, window=config["POIMEN_WORKER_BATCH_WINDOW_MS"] / 1000.0,
                max_size=config["POIMEN_WORKER_BATCH_MAX"], live=boots.boot_is_live,
                resolve_seconds=config["POIMEN_RECORD_RETRY_SECONDS"],
                connect_kwargs=_connect_kwargs(config),
                linger=config["POIMEN_WORKER_BATCH_LINGER_MS"] / 1000.0, threads=pool_threads)
        return _batcher


def _connect_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """The app's own connection arguments (timeouts, keepalives) for the batcher's."""
    options = config.get("SQLALCHEMY_ENGINE_OPTIONS") or {}
    args = dict(options.get("connect_args") or {})
    args.pop("prepare_threshold", None)
    return args


def refused_workflows() -> list[str]:
    """The registered workflows a batch worker cannot run as declared: those that set a
    time limit (Celery's threads pool enforces none)."""

    return sorted(wf.ref for wf in registry.registered()
                  if wf.time_limit is not None or wf.soft_time_limit is not None)


def batch_sizes() -> dict[str, dict[int, int]]:
    """How many runs each batch statement of this process carried (the histogram)."""
    if _batcher is None:
        return {"claim": {}, "finish": {}}
    return {kind: dict(sizes) for kind, sizes in _batcher.sizes.items()}
