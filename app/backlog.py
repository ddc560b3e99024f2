"""The backlog by tenant and queue: runs queued, waiting and delayed, and the oldest's age.

What operators ask when runs are late: whose runs wait, on which Celery queue, in
which state, and for how long. Three disjoint states of the runs that hold no
worker:

* ``queued``: sent to Celery and due (``not_before`` unset or past), not yet claimed;
* ``waiting``: status ``waiting`` and due, by ``wait_reason`` (join, concurrency,
  tenant_cap);
* ``delayed``: queued or waiting with ``not_before`` in the future (a retry's
  backoff, a run handed back until later).

The age of a state's oldest run: for queued and waiting, seconds since it became
due (its ``not_before`` if set, else its admission); for delayed, seconds since
its admission. Ages are the database clock's (``now()``).

The runs table has no queue column: a run's queue is its workflow's
(``app.enqueue.queue_of``, what every send uses), so the read groups by
(tenant, workflow name, version) in SQL and maps each workflow to its queue
here, from the registry of the process that reads. A version that process
does not have counts on the default queue, as its sends would go there.

The read is one index-only scan of ``ix_runs_backlog`` (migration 0023), a
partial index of the queued and waiting runs only: its cost is the backlog's
size, never the runs table's. ``beat`` alone exports the gauges
(``app.metrics.GlobalGauges``), at most once per ``POIMEN_METRICS_CACHE_SECONDS``;
the console reads one tenant's rows, cached as long per web process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import text

from workers import registry

from .enqueue import queue_of
from .models import WaitReason

STATES = ("queued", "waiting", "delayed")

# One row per (tenant, workflow version, state, wait reason): the groups, not the runs,
# of the tenants in ``:tenant_ids`` (beat's gauges: every tenant; the console's page: one),
# the index's leading column, so each tenant's read is bounded by its entries.
# `not_before > now()` is NULL for an unset not_before, so such a run is due.
BACKLOG = text("""
    SELECT t.name AS tenant, b.workflow_name, b.workflow_version,
           b.state, b.reason, b.runs, extract(epoch FROM now() - b.since) AS oldest_age
      FROM (SELECT r.tenant_id, r.workflow_name, r.workflow_version,
                   CASE WHEN r.not_before > now() THEN 'delayed' ELSE r.status END AS state,
                   CASE WHEN r.status = 'waiting' AND (r.not_before > now()) IS NOT TRUE
                        THEN coalesce(r.wait_reason, 'join') END AS reason,
                   count(*) AS runs,
                   min(CASE WHEN r.not_before > now() THEN r.created_at
                            ELSE greatest(r.created_at, r.not_before) END) AS since
              FROM runs r
             WHERE r.status IN ('queued', 'waiting') AND r.tenant_id = ANY(:tenant_ids)
             GROUP BY 1, 2, 3, 4, 5) b
      JOIN tenants t ON t.id = b.tenant_id
    """)
TENANTS = text("SELECT id, name FROM tenants ORDER BY name")


@dataclass
class Cell:
    """One (tenant, queue, state): how many runs, the oldest's age in seconds (0: none)."""

    runs: int = 0
    oldest_age: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)  # waiting only: runs by reason

    def add(self, runs: int, age: float, reason: str | None) -> None:
        self.runs += runs
        self.oldest_age = max(self.oldest_age, age)
        if reason is not None:
            self.reasons[reason] = self.reasons.get(reason, 0) + runs


@dataclass
class Backlog:
    """``cells[(tenant, queue, state)]``; ``queues`` every queue the registry sends to."""

    cells: dict[tuple[str, str, str], Cell]
    tenants: list[str]
    queues: list[str]
    read_at: float  # time.time() of the read

    def cell(self, tenant: str, queue: str, state: str) -> Cell:
        return self.cells.get((tenant, queue, state), Cell())

    def rows(self, tenant: str) -> list[tuple[str, dict[str, Cell]]]:
        """``tenant``'s queues with a backlog, each with its three states (the console's)."""
        queues = sorted({q for (t, q, _) in self.cells if t == tenant})
        return [(q, {s: self.cell(tenant, q, s) for s in STATES}) for q in queues]


def known_queues(celery_app) -> list[str]:
    """The default queue and every queue a registered workflow names."""
    queues = {celery_app.conf.task_default_queue}
    queues.update(wf.queue for wf in registry.registered() if wf.queue)
    return sorted(queues)


def read_backlog(session, celery_app, tenant_id: int | None = None) -> Backlog:
    """The backlog of every tenant (or of ``tenant_id``), by queue and state."""
    cells: dict[tuple[str, str, str], Cell] = {}
    queues: dict[tuple[str, str], str] = {}
    if tenant_id is None:
        every = session.execute(TENANTS).all()
        tenant_ids, tenants = [row.id for row in every], [row.name for row in every]
    else:
        tenant_ids, tenants = [tenant_id], []
    rows = session.execute(BACKLOG, {"tenant_ids": tenant_ids})
    for row in rows:
        ref = (row.workflow_name, row.workflow_version)
        if ref not in queues:
            queues[ref] = queue_of(celery_app, f"{row.workflow_name}@{row.workflow_version}")
        key = (row.tenant, queues[ref], row.state)
        cells.setdefault(key, Cell()).add(int(row.runs), float(row.oldest_age), row.reason)
    if tenant_id is not None:
        tenants = sorted({tenant for (tenant, _, _) in cells})
    return Backlog(cells, tenants, sorted({*known_queues(celery_app), *queues.values()}),
                   time.time())


def metric_families(backlog: Backlog) -> list[Metric]:
    """The backlog gauges: every tenant x queue x state, at 0 where nothing waits.

    Labels are bounded by tenants x queues x 3 states (x 3 wait reasons for the
    waiting breakdown); a run id, workflow or key is never a label.
    """
    runs = GaugeMetricFamily(
        "poimen_runs_backlog",
        "Runs holding no worker, by tenant, Celery queue and state: queued (sent, due, "
        "not claimed), waiting (for a slot or children), delayed (not_before in the future).",
        labels=["tenant", "queue", "state"])
    oldest = GaugeMetricFamily(
        "poimen_runs_backlog_oldest_age_seconds",
        "Age of the oldest run of poimen_runs_backlog's series (queued and waiting: since "
        "it became due; delayed: since its admission); 0 when there is none.",
        labels=["tenant", "queue", "state"])
    waiting = GaugeMetricFamily(
        "poimen_runs_backlog_waiting",
        "poimen_runs_backlog's waiting runs by what they wait for: join (children), "
        "concurrency (a slot of their key), tenant_cap (a slot of their tenant).",
        labels=["tenant", "queue", "reason"])
    for tenant in backlog.tenants:
        for queue in backlog.queues:
            for state in STATES:
                cell = backlog.cell(tenant, queue, state)
                runs.add_metric([tenant, queue, state], cell.runs)
                oldest.add_metric([tenant, queue, state], round(cell.oldest_age, 3))
            reasons = backlog.cell(tenant, queue, "waiting").reasons
            for reason in WaitReason:
                waiting.add_metric([tenant, queue, str(reason)], reasons.get(reason, 0))
    return [runs, oldest, waiting]


class TenantBacklogCache:
    """The console's reads of one tenant's backlog, at most one per ``ttl`` per tenant."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read: dict[int, tuple[float, Backlog]] = {}

    def get(self, ttl: float, tenant_id: int, read) -> Backlog:
        with self._lock:
            hit = self._read.get(tenant_id)
            if hit is None or time.monotonic() - hit[0] >= ttl:
                hit = (time.monotonic(), read())
                self._read[tenant_id] = hit
                if len(self._read) > 1000:  # tenants signed in long ago go
                    oldest = min(self._read, key=lambda key: self._read[key][0])
                    self._read.pop(oldest, None)
            return hit[1]


def totals(rows: Iterable[tuple[str, dict[str, Cell]]]) -> dict[str, int]:
    """Runs per state over ``rows`` (the console's header)."""
    out = dict.fromkeys(STATES, 0)
    for _, states in rows:
        for state, cell in states.items():
            out[state] += cell.runs
    return out
