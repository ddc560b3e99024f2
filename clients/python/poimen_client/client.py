"""The Python client of the Poimen API, and the HTTP transport the inbox posts through.

``Runs(base_url, token).admit("resize-images", {"paths": [...]})`` starts a run
exactly once however often the network fails: every attempt of one call carries
the same ``dispatch_key`` (the caller's, or one generated for the call), so a
retry after a lost answer is replayed by admission instead of admitting twice.

It is built on one pooled keep-alive ``urllib3`` connection pool per client,
with no per-call machinery beyond it (the inbox spent most of its CPU per
message in ``requests``). ``Transport`` is the bare pool: one request, one
answer, no retries, no redirects followed; the inbox uses it and judges answers
itself (Poimen's ``bridge/inbox/faults.py``). ``Runs`` adds the API's meaning: typed
runs, its ``{"error": {...}}`` body on exceptions, retries, cursors, waiting.

Nothing here logs a request or response body, or the token.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

log = logging.getLogger("poimen.client")

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "poisoned", "expired"})
# Answers worth another attempt of the same request: the server was away, overloaded or
# slow. 401/403/404/409/4xx about the request are the caller's to fix: never retried.
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
GENERATED_KEY_PREFIX = "client-"


# -- exceptions --------------------------------------------------------------------------------


class PoimenError(Exception):
    """Base of every error this client raises."""


class TransportError(PoimenError):
    """No answer: the connection was refused, reset or dropped, or DNS failed."""

    reason = "connection"


class TransportTimeout(TransportError):
    """No answer within the timeout (connect or read)."""

    reason = "timeout"


class ApiError(PoimenError):
    """The API answered with an error: its status and its ``{"error": {...}}`` body.

    ``code``, ``message`` and ``details`` are the API's; an answer not in that
    shape (a proxy's 502 page) has ``code = "http_<status>"`` and ``body = None``.
    """

    def __init__(self, status: int, body: Any, retry_after: float | None = None):
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            self.code: str = error["code"]
            self.message: str = str(error.get("message", ""))
            self.details: dict[str, Any] = error.get("details") or {}
            self.body: dict[str, Any] | None = body
        else:
            self.code, self.message, self.details, self.body = (
                f"http_{status}", f"HTTP {status} not in the API's error shape", {}, None)
        self.status = status
        self.retry_after = retry_after
        super().__init__(f"{status} {self.code}: {self.message}")


class InvalidRequest(ApiError):
    """400/413/415/422: the request itself is wrong (an unknown workflow, a bad field)."""


class AuthError(ApiError):
    """401/403: the token is missing, wrong, revoked or not allowed to do this."""


class RunNotFound(ApiError):
    """404: no such run for this token's tenant (another tenant's run looks the same)."""


class DispatchKeyConflict(ApiError):
    """409: the key already names a different request; ``run_id`` is the existing run."""

    @property
    def run_id(self) -> str | None:
        return self.details.get("run_id")


class Unavailable(ApiError):
    """5xx, 429 or 408 still answered after the client's retries ran out."""


class WaitTimeout(PoimenError):
    """``wait`` ran out of time; ``run`` is the run as last seen (not finished)."""

    def __init__(self, run: Run, timeout: float):
        super().__init__(f"run {run.id} still {run.status} after {timeout:g}s")
        self.run = run


class RunFailed(PoimenError):
    """``Runs.result``: the run ended but did not succeed (failed, cancelled, poisoned,
    expired). ``run`` is the run; ``error`` its error document (None for a cancel)."""

    def __init__(self, run: Run):
        code = (run.error or {}).get("code") if isinstance(run.error, dict) else None
        super().__init__(f"run {run.id} {run.status}" + (f": {code}" if code else ""))
        self.run = run
        self.status = run.status
        self.error = run.error


def _api_error(status: int, body: Any, retry_after: float | None) -> ApiError:
    if status in (400, 413, 415, 422):
        cls: type[ApiError] = InvalidRequest
    elif status in (401, 403):
        cls = AuthError
    elif status == 404:
        cls = RunNotFound
    elif status == 409:
        cls = DispatchKeyConflict
    elif status in RETRIED_STATUSES or status >= 500:
        cls = Unavailable
    else:
        cls = ApiError
    return cls(status, body, retry_after)


# -- the transport -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One HTTP answer, read whole (the connection is back in the pool)."""

    status: int
    headers: Mapping[str, str]
    data: bytes

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    def json(self) -> Any:
        """The body as JSON, or ``None`` if it is not JSON."""
        if "json" not in self.header("Content-Type").lower():
            return None
        try:
            return json.loads(self.data)
        except (ValueError, RecursionError):
            return None


class Transport:
    """A pooled keep-alive HTTP connection to one API: one request, one answer.

    No retries and no redirects: a followed 302 would turn ``POST /v1/runs`` into a
    ``GET`` whose 200 looks like success. Thread-safe; ``maxsize`` connections are
    kept alive (more threads than that open extra connections, then drop them).
    """

    def __init__(self, base_url: str, token: str | None, *, user_agent: str,
                 connect_timeout: float = 5.0, read_timeout: float = 15.0, maxsize: int = 10):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._prefix = parts.path.rstrip("/")
        headers = {"User-Agent": user_agent, "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._pool = urllib3.connection_from_url(
            f"{parts.scheme}://{parts.netloc}", maxsize=maxsize, block=False, headers=headers,
            retries=False, timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout))

    def __repr__(self) -> str:  # never the headers: they hold the token
        return f"Transport({self._pool.scheme}://{self._pool.host}:{self._pool.port})"

    def send(self, method: str, path: str, body: bytes | None = None,
             headers: Mapping[str, str] | None = None,
             timeout: float | urllib3.Timeout | None = None) -> Answer:
        """Send one request; return the answer, or raise ``TransportError``/``TransportTimeout``."""
        extra = {"Content-Type": "application/json"} if body is not None else {}
        if headers:
            extra.update(headers)
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            # urlopen() merges no pool headers: send them with every request.
            response = self._pool.urlopen(
                method, self._prefix + path, body=body, headers={**self._pool.headers, **extra},
                retries=False, redirect=False, **kwargs)
        except NewConnectionError as err:
            # Refused, unreachable, DNS: urllib3 2 makes it a subclass of its
            # timeout error (via ConnectTimeoutError), so it is caught first here.
            raise TransportError(f"{method} {path}: {type(err).__name__}: {err}") from None
        except Urllib3Timeout as err:
            raise TransportTimeout(f"{method} {path}: {type(err).__name__}") from None
        except (Urllib3Error, OSError) as err:
            raise TransportError(f"{method} {path}: {type(err).__name__}: {err}") from None
        return Answer(response.status, response.headers, response.data)

    def close(self) -> None:
        self._pool.close()


# -- runs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A run as the API serialises it; ``raw`` is the whole document."""

    id: str
    status: str
    workflow_ref: str
    input: Any
    result: Any
    error: dict[str, Any] | None
    goal_id: str | None
    dispatch_key: str | None
    attempt: int
    cancel_requested: bool
    parent_run_id: str | None
    created_at: str | None
    finished_at: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    replayed: bool = False  # admit(): the API answered with an existing run (200)

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_json(cls, doc: dict[str, Any], replayed: bool = False) -> Run:
        return cls(
            id=doc["id"], status=doc["status"], workflow_ref=doc["workflow_ref"],
            input=doc.get("input"), result=doc.get("result"), error=doc.get("error"),
            goal_id=doc.get("goal_id"), dispatch_key=doc.get("dispatch_key"),
            attempt=int(doc.get("attempt") or 0),
            cancel_requested=bool(doc.get("cancel_requested")),
            parent_run_id=doc.get("parent_run_id"), created_at=doc.get("created_at"),
            finished_at=doc.get("finished_at"), raw=doc, replayed=replayed)


def timing_fields(value: float | timedelta | datetime | None, instant: str,
                  relative: str) -> dict[str, Any]:
    """A delay or an expiry as the API's fields: ``instant`` (RFC 3339) for a ``datetime``
    (aware: a naive one is refused here, as the API would), ``relative`` seconds else."""
    if value is None:
        return {}
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(f"{instant}: a datetime with a timezone (e.g. UTC), not a naive one")
        return {instant: value.isoformat()}
    if isinstance(value, timedelta):
        return {relative: value.total_seconds()}
    return {relative: float(value)}


def _is_run(doc: Any) -> bool:
    return (isinstance(doc, dict) and isinstance(doc.get("id"), str)
            and isinstance(doc.get("status"), str) and "workflow_ref" in doc)


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Parse ``Retry-After``: delta-seconds or an HTTP-date; ``None`` if absent or invalid."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("poimen-client")
    except metadata.PackageNotFoundError:  # imported from a checkout, not installed
        return "0"


class Runs:
    """The runs of one tenant: admit, get, list, cancel, wait.

    Idempotent calls (all of these, ``admit`` by its key) are retried on transport
    errors, 5xx, 429 and 408 with capped exponential backoff and full jitter,
    honouring ``Retry-After``, for at most ``retry_for`` seconds per call; then the
    last error is raised (``Unavailable``, ``TransportError``). A service token
    names its tenant with ``tenant=``.
    """

    def __init__(self, base_url: str, token: str, *, tenant: str | None = None,
                 timeout: float = 15.0, connect_timeout: float = 5.0,
                 retry_for: float = 60.0, backoff_initial: float = 0.2,
                 backoff_max: float = 5.0, maxsize: int = 10,
                 user_agent: str | None = None):
        self.transport = Transport(base_url, token,
                                   user_agent=user_agent or f"poimen-client/{_version()}",
                                   connect_timeout=connect_timeout, read_timeout=timeout,
                                   maxsize=maxsize)
        self.transport_connect_timeout = connect_timeout
        self.read_timeout = timeout
        self._tenant_headers = {"X-Poimen-Tenant": tenant} if tenant else {}
        self.retry_for = retry_for
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._random = random.Random()
        self._random_lock = threading.Lock()

    def __enter__(self) -> Runs:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.transport.close()

    # -- the calls -----------------------------------------------------------------------------

    def admit(self, workflow_ref: str, input: Mapping[str, Any] | None = None,
              dispatch_key: str | None = None, goal_id: str | None = None,
              concurrency_key: str | None = None, *,
              delay: float | timedelta | datetime | None = None,
              expires: float | timedelta | datetime | None = None) -> Run:
        """Admit a run; return it (``replayed`` if the API answered with an existing one).

        Without ``dispatch_key`` one is generated for this call (``client-<uuid4>``),
        so the call's own retries are replays, never second runs; two calls are
        still two runs. Raise ``DispatchKeyConflict`` if the key names another request.
        ``concurrency_key`` is the run's group under its workflow's ``concurrency_limit``
        (where the workflow derives none itself).
        ``delay``: seconds (or a ``timedelta``) from admission, or an aware ``datetime``, before
        which the run does not start (Celery's ``countdown``/``eta``, kept in Postgres).
        ``expires``: likewise, the time by which a worker must have started the run, else it
        ends ``expired`` (Celery's ``expires``).
        """
        key = dispatch_key if dispatch_key is not None else f"{GENERATED_KEY_PREFIX}{uuid.uuid4()}"
        request: dict[str, Any] = {"workflow_ref": workflow_ref, "input": dict(input or {}),
                                   "dispatch_key": key}
        if goal_id is not None:
            request["goal_id"] = goal_id
        if concurrency_key is not None:
            request["concurrency_key"] = concurrency_key
        request.update(timing_fields(delay, "not_before", "delay_seconds"))
        request.update(timing_fields(expires, "expires_at", "expires_in_seconds"))
        answer, doc = self._call("POST", "/v1/runs", json.dumps(request).encode())
        return Run.from_json(doc, replayed=answer.status == 200)

    def admit_many(self, items: Sequence[Mapping[str, Any]]) -> list[Run | ApiError]:
        """Admit many runs in one request (``POST /v1/runs/batch``); one result per item, in
        order: the ``Run`` (``replayed`` if the API answered with an existing one), or the
        ``ApiError`` the API gave that item (``DispatchKeyConflict``, ``InvalidRequest``).

        An item is ``admit``'s arguments as a mapping: ``workflow_ref``, and optionally
        ``input``, ``dispatch_key``, ``goal_id``, ``concurrency_key``, ``traceparent`` and
        ``tracestate``. An item without ``dispatch_key`` gets one generated for this call,
        so a retry of the whole batch replays every item instead of admitting it twice.
        A batch the API refuses whole (more items than its ``POIMEN_BATCH_MAX``: a 413)
        raises ``InvalidRequest``.
        """
        runs = []
        for item in items:
            request = dict(item)
            request["input"] = dict(request.get("input") or {})
            if request.get("dispatch_key") is None:
                request["dispatch_key"] = f"{GENERATED_KEY_PREFIX}{uuid.uuid4()}"
            runs.append(request)
        _, doc = self._call("POST", "/v1/runs/batch", json.dumps({"runs": runs}).encode(),
                            expect_run=False)
        results: list[Run | ApiError] = []
        for result in doc["results"]:
            status = int(result["status"])
            if status in (200, 201) and _is_run(result.get("run")):
                results.append(Run.from_json(result["run"], replayed=status == 200))
            else:
                results.append(_api_error(status, {"error": result.get("error")}, None))
        return results

    def get(self, run_id: str) -> Run:
        """Return the run; raise ``RunNotFound`` if this tenant has no such run."""
        return Run.from_json(self._call("GET", f"/v1/runs/{run_id}")[1])

    def list(self, *, status: str | Sequence[str] | None = None, goal_id: str | None = None,
             workflow_ref: str | None = None, dispatch_key: str | None = None,
             parent_run_id: str | None = None, page_size: int = 100) -> Iterator[Run]:
        """Yield the matching runs, newest first, following ``next_cursor`` page by page."""
        query: dict[str, str] = {"limit": str(page_size)}
        if status is not None:
            query["status"] = status if isinstance(status, str) else ",".join(status)
        for name, value in (("goal_id", goal_id), ("workflow_ref", workflow_ref),
                            ("dispatch_key", dispatch_key), ("parent_run_id", parent_run_id)):
            if value is not None:
                query[name] = value
        while True:
            _, doc = self._call("GET", f"/v1/runs?{urlencode(query)}", expect_run=False)
            for item in doc["runs"]:
                yield Run.from_json(item)
            cursor = doc.get("next_cursor")
            if not cursor:
                return
            query["cursor"] = cursor

    def cancel(self, run_id: str, *, cascade: bool = True) -> Run:
        """Cancel the run: a queued one at once, a running one at its next checkpoint; with
        ``cascade`` (the default) its descendants too (fan-out children, theirs, ...)."""
        path = f"/v1/runs/{run_id}/cancel" + ("" if cascade else "?cascade=false")
        return Run.from_json(self._call("POST", path, b"{}")[1])

    def wait(self, run_id: str, timeout: float, poll_interval: float = 0.2,
             poll_max: float = 2.0, server_wait: float = 30.0) -> Run:
        """Wait until the run is finished; return it, or raise ``WaitTimeout``.

        Each request waits on the server (``GET /v1/runs/<id>?wait=``, at most
        ``server_wait`` seconds), which answers as soon as the run ends. A server whose
        waiters are all taken (``Poimen-Wait: full``) answers at once; then this polls,
        every ``poll_interval`` seconds doubling up to ``poll_max``."""
        deadline = time.monotonic() + timeout
        interval = poll_interval
        while True:
            left = deadline - time.monotonic()
            wait = max(0.0, min(server_wait, left))
            query = f"?wait={wait:.3f}" if wait >= 0.001 else ""
            answer, doc = self._call(
                "GET", f"/v1/runs/{run_id}{query}",
                timeout=urllib3.Timeout(connect=self.transport_connect_timeout,
                                        read=wait + self.read_timeout) if query else None)
            run = Run.from_json(doc)
            if run.finished:
                return run
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(run, timeout)
            if query and answer.header("Poimen-Wait") != "full":
                continue  # the server waited its share: ask again at once
            time.sleep(min(interval, left))
            interval = min(interval * 2, poll_max)

    def result(self, run_id: str, timeout: float) -> Any:
        """The run's result once it succeeded, like Celery's ``AsyncResult.get()``: raise
        ``RunFailed`` (the run's ``error`` and status) if it ended otherwise, and
        ``WaitTimeout`` if it has not ended within ``timeout`` seconds."""
        run = self.wait(run_id, timeout)
        if run.status != "succeeded":
            raise RunFailed(run)
        return run.result

    # -- retries -------------------------------------------------------------------------------

    def _delay(self, attempt: int) -> float:
        cap = min(self.backoff_max, self.backoff_initial * 2 ** attempt)
        with self._random_lock:
            return self._random.uniform(0, cap)

    def _call(self, method: str, path: str, body: bytes | None = None,
              expect_run: bool = True,
              timeout: float | urllib3.Timeout | None = None) -> tuple[Answer, Any]:
        """Send until answered, retrying what is worth retrying within ``retry_for`` s;
        ``timeout``: this call's read timeout (a wait on the server), else the client's."""
        give_up = time.monotonic() + self.retry_for
        attempt = 0
        while True:
            retry_after = None
            try:
                answer = self.transport.send(method, path, body, self._tenant_headers,
                                             timeout=timeout)
            except TransportError as err:
                failure: PoimenError = err
            else:
                doc = answer.json()
                if answer.status in (200, 201, 202) and (
                        _is_run(doc) or (not expect_run and isinstance(doc, dict))):
                    return answer, doc
                retry_after = retry_after_seconds(answer.header("Retry-After"))
                failure = _api_error(answer.status, doc, retry_after)
                if not isinstance(failure, Unavailable):
                    raise failure
            delay = max(self._delay(attempt), retry_after or 0.0)
            if time.monotonic() + delay > give_up:
                raise failure
            attempt += 1
            log.warning("retrying %s %s in %.2fs (attempt %d): %s", method, path.split("?")[0],
                        delay, attempt + 1, failure)
            time.sleep(delay)
