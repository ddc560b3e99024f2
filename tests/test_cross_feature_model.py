"""The cross-feature model test: every rule, when features meet.

A Hypothesis ``RuleBasedStateMachine`` drives the store's real statements on the
session's real Postgres through random interleavings of admission (caller keys
under every ``key_reuse`` policy with ``key_ttl`` 0; the keys Poimen derives:
schedule ticks admitted by real ``Ticker`` beats, ``kafka:<topic>:<partition>:<offset>``
through ``POST /v1/runs`` as the inbox posts it, fan-out child keys through
``admit_many``), claims and takeovers by real boots (``workers.boots.Boot``: a lock
connection of its own), finish, fail, retry, release, cancel, tenant caps, limited
groups (limit 1 and 2, two keys), repair's wake statement, and boot deaths. After
every step it checks the table against a plain-Python model:

* ``one_holder``: at most one live holder executes a run (a boot whose lock is gone
  but whose bound has not passed may still be running its body);
* ``limits``: at most N running per group, and per tenant cap when a run starts,
  counting runs held by boots not yet past the dead bound;
* ``waiting``: every run waiting for a slot has a path to be woken: its reason still
  applies (the claim's own FIFO count), or repair's wake statement would wake it;
* ``derived_keys``: one run per derived key ever, whatever the workflow's key_reuse;
* ``ticks``: one run per schedule tick, however many beats admit it;
* ``no_run_lost``: the table holds exactly the runs admitted, each in the state the
  model says (a running run under the boot that claimed it);
* ``caller_keys``: a caller key admits a new run only as its workflow's policy allows;
* ``fenced``: a boot's write after it lost its claim is refused.

Families switch rule groups on (``FAMILIES``). ``core`` is the base; three more
drive what once broke where features meet (derived keys under ``key_reuse``, cap
changes, early lock loss) and ``all`` drives them together. A family listed in
``KNOWN_BROKEN`` is an xfail, not shrunk; none is listed.

Early and late death: a boot "dies" by closing its lock connection (Postgres frees
the lock at once). Early death is the state right after (the server-side bound,
T_c + kill + margin from when the boot was first seen dead, not passed): its body
may still run, so its runs keep their slots and nobody takes them over. Late death
is that bound passed; ``let_the_bound_pass`` moves a dead boot there (the one place
that knows how the store records the time a boot was first seen dead).

Reproduce a failure with the seed it prints: ``POIMEN_MODEL_SEED=<n>``; more
examples with ``POIMEN_MODEL_EXAMPLES=<n>``.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import psycopg
import pytest
from hypothesis import HealthCheck, Phase, event, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import text

from app.state.executor import on_session
from poimenconfig import libpq_url

# -- the workflows it admits ------------------------------------------------------------------

# name: (concurrency_limit, key_reuse); the concurrency key is the input's "g".
CALLER_WORKFLOWS = {
    "m-never": (None, "never"),
    "m-fail": (None, "after_failure"),
    "m-end": (None, "after_end"),
    "m-one": (1, "never"),
    "m-two": (2, "never"),
    "m-one-end": (1, "after_end"),
    "m-two-fail": (2, "after_failure"),
}
# Scheduled (every minute, tenant "ma"): name -> (concurrency_limit, key_reuse).
SCHEDULED_WORKFLOWS = {
    "m-tick-never": (None, "never"),
    "m-tick-one": (1, "never"),
    "m-tick-end": (None, "after_end"),
    "m-tick-fail": (1, "after_failure"),
}
# The order workflows are drawn in: limited ones at both ends (generation leans there), so
# runs of one group meet often enough to contend for its slots.
CALLER_CHOICES = ["m-one", "m-never", "m-fail", "m-end", "m-one-end", "m-two-fail", "m-two",
                  "m-one"]
TENANTS = ("ma", "mb")
GROUP_KEYS = ("a", "b")
CALLER_KEYS = (None, "k0", "k1")
PERIOD = 60  # seconds between schedule ticks
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
# A boot dead for less than this is within its bound (T_c alone is 10 s by default,
# and the bound is T_c + kill + margin); older, the model lets the bound pass.
EARLY_WINDOW = 8.0
BEAT_OFFSETS = (7.25, 41.5)  # where in a period each beat's clock is: they never agree


@dataclass(frozen=True)
class Family:
    """Which rule groups run: each switches on a way features meet."""

    derived_reuse: bool = False  # derived keys of workflows whose key_reuse is not never
    cap_lift: bool = False       # caps lifted; a cap change wakes all it freed at once
    early_death: bool = False    # a boot's lock lost before its bound passed


FAMILIES = {
    "core": Family(),
    "derived_keys": Family(derived_reuse=True),
    "cap_changes": Family(cap_lift=True),
    "early_lock_loss": Family(early_death=True),
    "all": Family(derived_reuse=True, cap_lift=True, early_death=True),
}
# Families that fail on this code, and why: xfail, and not shrunk (a failure is reported
# within make test's budget). Not strict: a random search may miss a known bug in one run.
# Empty: every family guards its rule, and a family put here stops guarding it.
KNOWN_BROKEN: dict[str, str] = {}


# What the examples did (printed after the run: ``pytest -s`` shows it).
STATS: Counter[str] = Counter()


def note(what: str) -> None:
    event(what)
    STATS[what] += 1


class Violation(AssertionError):
    """An invariant the model checks does not hold."""


def violated(rule_name: str, message: str) -> Violation:
    return Violation(f"[{rule_name}] {message}")


# -- the model ----------------------------------------------------------------------------------

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class ModelRun:
    id: uuid.UUID
    tenant: str
    workflow: str
    limit: int | None
    group: tuple | None
    key: str | None
    derived: str | None  # "schedule", "kafka", "fanout" or None (a caller's key, or none)
    input: dict
    # "unclaimed" (queued or waiting: the store moves it between them), "running", or an end.
    status: str = "unclaimed"
    holder: uuid.UUID | None = None
    slots: bool = False  # the claim's: whether its end hands a slot on
    cancel_requested: bool = False
    takeover_from: uuid.UUID | None = None  # the dead boot of its last takeover


@dataclass
class ModelBoot:
    boot: object  # workers.boots.Boot
    state: str = "live"  # "live", "early" (lock gone, bound not passed), "late"
    died_at: float = 0.0


@dataclass
class World:
    runs: dict[uuid.UUID, ModelRun] = field(default_factory=dict)
    boots: dict[uuid.UUID, ModelBoot] = field(default_factory=dict)
    executing: dict[uuid.UUID, set[uuid.UUID]] = field(default_factory=dict)
    # (run, boot) pairs, in the order they first happened (an ordered set: replays agree)
    ever_held: dict[tuple[uuid.UUID, uuid.UUID], None] = field(default_factory=dict)
    derived: dict[str, set[uuid.UUID]] = field(default_factory=dict)
    caps: dict[str, int | None] = field(default_factory=dict)
    ticks: dict[tuple[str, int], set[uuid.UUID]] = field(default_factory=dict)


def let_the_bound_pass(pg: psycopg.Connection, boot_id: uuid.UUID) -> None:
    """Make dead boot ``boot_id`` gone for takeovers, slot counts and re-drives: the
    server first saw its lock free (``worker_boots.first_seen_dead_at``) a day ago, far
    past its bound (T_c + kill + margin, ``dead_after_seconds``)."""
    pg.execute("UPDATE worker_boots SET first_seen_dead_at = now() - interval '1 day' "
               "WHERE boot_id = %s", [boot_id])


# Queued runs a delivery would claim now, oldest first (as repair re-sends them).
QUEUED_DUE = text("SELECT id FROM runs WHERE status = 'queued' AND NOT cancel_requested "
                  "AND (not_before IS NULL OR not_before <= now()) ORDER BY created_at, id")


class CrossFeatureModel(RuleBasedStateMachine):
    """One example: two tenants, up to three live boots, and the rules below."""

    family: Family
    app = None
    dsn: str = ""

    def __init__(self) -> None:
        super().__init__()
        from app.extensions import db
        from app.tenant_service import create_tenant, create_token, set_max_running

        self.db = db
        self.pg = psycopg.connect(self.dsn, autocommit=True)
        self.pg.execute("TRUNCATE outbox, runs, worker_boots, api_tokens, tenants "
                        "RESTART IDENTITY CASCADE")
        self.world = World()
        self.tenant_ids: dict[str, int] = {}
        self.tokens: dict[str, str] = {}
        for name in TENANTS:
            tenant = create_tenant(name)
            self.tenant_ids[name] = tenant.id
            self.tokens[name] = create_token(tenant, False)
            self.world.caps[name] = None
        # Tenant "ma" starts capped (at 1 in cap_changes: more runs wait for its cap).
        cap = 1 if self.family.cap_lift else 2
        set_max_running("ma", cap)
        self.world.caps["ma"] = cap
        db.session.remove()
        self.client = self.app.test_client()
        self.clock = 0  # schedule periods since EPOCH
        self.beats = [self._new_beat(0), self._new_beat(1)]
        self.strict_tenant: str | None = None  # cap_changes: the tenant whose cap just changed

    def teardown(self) -> None:
        for boot in self.world.boots.values():
            boot.boot.close()
        self.db.session.rollback()
        self.db.session.remove()
        self.pg.close()

    # -- helpers ----------------------------------------------------------------------------

    def _new_beat(self, index: int):
        """A beat process: its own clock (seconds apart from the other's), its own memory."""
        from workers.schedules import Ticker, admit_tick

        offset = timedelta(seconds=BEAT_OFFSETS[index])
        beat = Ticker(admit=admit_tick)
        beat.clock = lambda: EPOCH + timedelta(seconds=PERIOD * self.clock) + offset
        return beat

    def live_boots(self) -> list[uuid.UUID]:
        return [b for b, m in self.world.boots.items() if m.state == "live"]

    def counting_boots(self) -> set[uuid.UUID]:
        """Boots whose runs hold their slots: live, or dead within the bound."""
        return {b for b, m in self.world.boots.items() if m.state in ("live", "early")}

    def derived_workflows(self) -> list[str]:
        if self.family.derived_reuse:
            return CALLER_CHOICES
        return [n for n in CALLER_CHOICES if CALLER_WORKFLOWS[n][1] == "never"]

    def table(self) -> dict[uuid.UUID, tuple]:
        return {row[0]: row[1:] for row in self.pg.execute(
            "SELECT id, status, claimed_by, wait_reason, tenant_id, workflow_name, "
            "concurrency_key, concurrency_limit, cancel_requested, created_at, "
            "(not_before IS NULL OR not_before <= now()) AS due FROM runs")}

    def add_run(self, row, *, tenant: str, derived: str | None, input: dict) -> ModelRun:
        limit = row.concurrency_limit
        run = ModelRun(
            id=row.id, tenant=tenant, workflow=row.workflow_name, limit=limit,
            group=(tenant, row.workflow_name, row.concurrency_key) if limit else None,
            key=row.dispatch_key, derived=derived, input=input)
        self.world.runs[run.id] = run
        return run

    def note_derived(self, key: str, run_id: uuid.UUID) -> None:
        self.world.derived.setdefault(key, set()).add(run_id)

    def count_running(self, runs, counting) -> int:
        """How many of ``runs`` hold a slot: running under a boot that counts, or executed
        by one (a body whose boot died within its bound still runs)."""
        return sum(1 for r in runs if (r.status == "running" and r.holder in counting)
                   or self.world.executing.get(r.id, set()) & counting)

    def check_limits_at_start(self, run: ModelRun) -> None:
        counting = self.counting_boots()
        if run.group is not None:
            n = self.count_running([r for r in self.world.runs.values() if r.group == run.group],
                                   counting)
            if n > run.limit:
                raise violated("limits", f"{n} runs of group {run.group} running (limit "
                                         f"{run.limit}) once run {run.id} started")
        cap = self.world.caps[run.tenant]
        if cap is not None:
            n = self.count_running([r for r in self.world.runs.values()
                                    if r.tenant == run.tenant], counting)
            if n > cap:
                raise violated("limits", f"{n} runs of tenant {run.tenant} running (cap {cap})"
                                         f" once run {run.id} started")

    def read_back(self, run: ModelRun) -> None:
        """Take an outcome the model does not decide (a wait, an end by a takeover) from
        the table; a running run must still be the model's holder's."""
        status, claimed_by = self.pg.execute(
            "SELECT status, claimed_by FROM runs WHERE id = %s", [run.id]).fetchone()
        if status in TERMINAL:
            run.status, run.holder = status, None
        elif status == "running":
            if run.status != "running" or claimed_by != run.holder:
                raise violated("no_run_lost", f"run {run.id} running under {claimed_by}, but "
                                              f"the model has it {run.status} under {run.holder}")
        else:
            run.status, run.holder = "unclaimed", None

    def ends(self, run: ModelRun, boot_id: uuid.UUID) -> None:
        """Boot ``boot_id``'s body of ``run`` ended (it wrote its end, or tried to)."""
        self.world.executing.get(run.id, set()).discard(boot_id)

    # -- boots --------------------------------------------------------------------------------

    @initialize(data=st.data())
    def two_boots_and_some_runs(self, data) -> None:
        self.start_boot()
        self.start_boot()
        for _ in range(data.draw(st.integers(1, 4), label="first admissions")):
            self.admit(data, "caller")

    def boots(self, data) -> None:
        """A boot starts; or one dies, late (its lock gone and its bound passed: its process
        was fenced) or early (its lock gone: restart, failover, pg_terminate_backend; its
        body runs on); or a dead boot's bound passes."""
        early = [b for b, m in self.world.boots.items() if m.state == "early"]
        # A boot dies only while another lives (a delivery needs one), and starts only if
        # fewer than three live: so deaths come about as often as the other changes.
        mortal = len(self.live_boots()) > 1
        choices = (["start"] if len(self.live_boots()) < 3 else []) \
            + (["bound passes"] if early else []) \
            + (["dies late"] if mortal else []) \
            + (["dies early"] if mortal and self.family.early_death else [])
        what = data.draw(st.sampled_from(choices), label="boots")
        note(f"boot: {what}")
        if what == "start":
            self.start_boot()
        elif what == "bound passes":
            self._bound_passes(data.draw(st.sampled_from(early), label="boot"))
        else:
            # Boots that hold runs first, runs of limited groups before others: a death
            # matters most there (a slot freed, a takeover due).
            running = [r for r in self.world.runs.values() if r.status == "running"]
            limited = {r.holder for r in running if r.group is not None}
            holding = {r.holder for r in running}
            boots = sorted(self.live_boots(), key=lambda b: (b not in holding, b not in limited))
            boot_id = data.draw(st.sampled_from(boots), label="boot")
            if boot_id in limited:
                note(f"boot {what} holding a run of a limited group")
            self._die(boot_id)
            if what == "dies late":
                self._bound_passes(boot_id)

    def start_boot(self) -> None:
        from workers.boots import Boot

        boot = Boot.register(self.dsn)
        self.world.boots[boot.boot_id] = ModelBoot(boot)

    def _die(self, boot_id: uuid.UUID) -> None:
        model = self.world.boots[boot_id]
        model.boot.close()  # Postgres frees the lock as its backend exits: wait for that
        from app.liveness import LIVE_BOOTS_SQL

        deadline = time.monotonic() + 10
        while self.pg.execute(f"SELECT EXISTS ({LIVE_BOOTS_SQL} WHERE b.boot_id = %s)",
                              [boot_id]).fetchone()[0]:
            assert time.monotonic() < deadline, f"boot {boot_id}'s lock outlived its connection"
            time.sleep(0.005)
        model.state, model.died_at = "early", time.monotonic()

    def _bound_passes(self, boot_id: uuid.UUID) -> None:
        let_the_bound_pass(self.pg, boot_id)
        self.world.boots[boot_id].state = "late"
        for holders in self.world.executing.values():  # the fence stopped its bodies
            holders.discard(boot_id)

    # -- admission ----------------------------------------------------------------------------

    @rule(data=st.data())
    def step(self, data) -> None:
        """One thing happens: a worker's act, an admission, or an operator's (or beat's).
        One rule, not three: Hypothesis's swarm testing switches whole rules off for an
        example, and each rule this test checks needs what all three do."""
        what = data.draw(st.sampled_from(["work", "admit", "work", "operate", "work"]),
                         label="step")
        getattr(self, what)(data)

    def admit(self, data, kind: str | None = None) -> None:
        """An admission: a caller's (a key under its workflow's policy, or none), a beat's
        (or a schedule period passing), a keyless Kafka message's, or a parent's fan-out."""
        kinds = ["beat", "kafka", "fanout", "caller", "beat"] if self.family.derived_reuse \
            else ["caller", "beat", "kafka", "fanout", "beat", "caller"]
        kind = kind or data.draw(st.sampled_from(kinds), label="kind")
        if kind == "fanout" and not self.world.runs:
            kind = "caller"
        if kind == "beat":
            self.beat(data.draw(st.integers(0, 1), label="beat"), data.draw(
                st.sampled_from(["ticks", "restarts", "period"]), label="beat does"))
        elif kind == "caller":
            self.admit_caller(
                data.draw(st.sampled_from(TENANTS), label="tenant"),
                data.draw(st.sampled_from(CALLER_CHOICES), label="workflow"),
                data.draw(st.sampled_from(CALLER_KEYS), label="key"),
                data.draw(st.integers(0, 1), label="v"),
                data.draw(st.sampled_from(GROUP_KEYS), label="g"))
        elif kind == "kafka":
            self.admit_kafka(data, data.draw(st.integers(0, 3), label="offset"),
                             data.draw(st.sampled_from(GROUP_KEYS), label="g"))
        else:
            self.admit_fanout(data, data.draw(st.integers(1, 2), label="entry"), data.draw(
                st.lists(st.sampled_from(["x", "y"]), min_size=1, max_size=2, unique=True),
                label="items"))

    def admit_caller(self, tenant, workflow, key, v, g) -> None:
        """A caller's admission, its key under the workflow's policy (key_ttl 0)."""
        from app.admission import AdmissionConflict, admit_run
        from workers import registry

        input = {"v": v, "g": g}
        expected = self._expect_caller(tenant, workflow, key, input)
        try:
            admission = admit_run(on_session(self.db.session), tenant_id=self.tenant_ids[tenant],
                                  workflow_ref=workflow, input=input, dispatch_key=key)
            self.db.session.commit()
        except AdmissionConflict:
            self.db.session.rollback()
            outcome = "conflict"
        else:
            outcome = "created" if admission.created else "replay"
            if admission.created:
                self.add_run(admission.run, tenant=tenant, derived=None, input=input)
            elif admission.run.id not in self.world.runs:
                raise violated("no_run_lost", f"a replay of {key!r} names run "
                                              f"{admission.run.id}, which nobody admitted")
        note(f"caller admission: {outcome}")
        if outcome != expected[0] or (outcome == "replay" and admission.run.id != expected[1]):
            policy = registry.resolve(workflow).key_reuse
            raise violated("caller_keys", f"{tenant}/{workflow} key {key!r} ({policy}): "
                                          f"expected {expected}, got {outcome}")

    def _expect_caller(self, tenant, workflow, key, input):
        from workers.registry import KEY_REUSE_POLICIES

        if key is None:
            return ("created", None)
        holder = next((r for r in self.world.runs.values() if r.tenant == tenant
                       and r.key == key and r.derived is None), None)
        if holder is None:
            return ("created", None)
        if holder.status in TERMINAL:
            note("caller key of an ended run admitted again")
        reusable = KEY_REUSE_POLICIES[CALLER_WORKFLOWS[workflow][1]]
        if holder.workflow == workflow and holder.status in reusable:
            holder.key = None  # released: the new run takes it
            return ("created", None)
        if holder.workflow == workflow and holder.input == input:
            return ("replay", holder.id)
        return ("conflict", None)

    def admit_kafka(self, data, offset, g) -> None:
        """A keyless Kafka message, admitted as the inbox posts it (a redelivery repeats it)."""
        workflow = data.draw(st.sampled_from(self.derived_workflows()), label="workflow")
        key = f"kafka:poimen.ma.dispatch:0:{offset}"
        body = {"workflow_ref": workflow, "input": {"offset": offset, "g": g},
                "dispatch_key": key}
        previous = self.world.derived.get(key)
        if previous:  # a redelivery is the very message again
            run = self.world.runs[next(iter(previous))]
            if run.status in TERMINAL:
                note("kafka redelivery of an ended run")
            body = {"workflow_ref": run.workflow, "input": run.input, "dispatch_key": key}
        response = self.client.post("/v1/runs", json=body,
                                    headers={"Authorization": f"Bearer {self.tokens['ma']}"})
        assert response.status_code in (200, 201), (response.status_code, response.json)
        run_id = uuid.UUID(response.json["id"])
        if run_id not in self.world.runs:
            row = SimpleNamespace(id=run_id, workflow_name=body["workflow_ref"],
                                  dispatch_key=key,
                                  concurrency_limit=CALLER_WORKFLOWS[body["workflow_ref"]][0],
                                  concurrency_key=body["input"]["g"])
            self.add_run(row, tenant="ma", derived="kafka", input=body["input"])
        self.note_derived(key, run_id)

    def admit_fanout(self, data, entry, items) -> None:
        """A parent's spawn_each: its children under keys derived from (run, step, entry,
        position, item); a resumed entry derives them again."""
        from app.admission import Admission, RunRequest, admit_many
        from app.models import AdmissionOrigin
        from workers.actions import fanout_key, idempotency_key

        parent = self.world.runs[data.draw(st.sampled_from(list(self.world.runs)),
                                           label="parent")]
        workflow = data.draw(st.sampled_from(self.derived_workflows()), label="child workflow")
        idem = idempotency_key(parent.id, "fan", entry, 0)
        requests = []
        for item in items:
            key = fanout_key(idem, item)
            known = self.world.derived.get(key)
            child_wf = self.world.runs[next(iter(known))].workflow if known else workflow
            child_input = {"item": item, "g": "a"}
            requests.append((key, child_wf, child_input))
        # One statement (and transaction) per child: runs admitted together share their
        # created_at, and the FIFO breaks that tie by random ids, which a replayed example
        # must not meet (Hypothesis needs each step to decide the same again).
        for key, wf, child_input in requests:
            [outcome] = admit_many(
                on_session(self.db.session), [RunRequest(workflow_ref=wf, input=child_input,
                                             dispatch_key=key)],
                tenant_id=self.tenant_ids[parent.tenant], origin=AdmissionOrigin.FANOUT,
                origin_detail=f"spawn_each {idem}", parent_run_id=parent.id)
            self.db.session.commit()
            assert isinstance(outcome, Admission), outcome
            if outcome.created:
                self.add_run(outcome.run, tenant=parent.tenant, derived="fanout",
                             input=child_input)
            self.note_derived(key, outcome.run.id)
            # The same (parent, entry, item) is the same child, whatever key it derives.
            self.note_derived(f"fan-out child {parent.id}/{entry}/{child_input['item']}",
                              outcome.run.id)

    def beat(self, beat, what) -> None:
        """One of two beats looks for each schedule's latest tick (once a second), or
        restarts (a deploy: it forgets what it admitted and admits the latest tick again);
        or a schedule period passes."""
        note(f"beat: {what}")
        if what == "period":
            self.clock += 1
            return
        if what == "restarts":
            self.beats[beat] = self._new_beat(beat)
        self.beats[beat].tick()
        self._adopt_scheduled()

    def _adopt_scheduled(self) -> None:
        for row in self.pg.execute(
                "SELECT id, workflow_name, dispatch_key, concurrency_limit, concurrency_key, "
                "origin_detail, input FROM runs WHERE origin = 'schedule' ORDER BY created_at"):
            key = row[5]
            if row[0] not in self.world.runs:
                self.add_run(SimpleNamespace(id=row[0], workflow_name=row[1], dispatch_key=row[2],
                                             concurrency_limit=row[3], concurrency_key=row[4]),
                             tenant="ma", derived="schedule", input=row[6])
                # A beat looking at this period admits this period's tick, whatever its
                # clock says within it.
                self.world.ticks.setdefault((row[1], self.clock), set()).add(row[0])
            self.note_derived(key, row[0])

    # -- claims and their ends ----------------------------------------------------------------

    def work(self, data) -> None:
        """What workers do: deliveries of runs' messages to live boots (at least once: any
        run, any time), a body's end, a boot's start or death, a second rescuer racing a
        takeover, a late write."""
        # Deliveries and ends at both ends of the list (where generation leans) and twice:
        # most of what workers do; a boot's start or death once in a while.
        deliver = ["deliver"] if self.live_boots() and self.world.runs else []
        end = ["body ends"] if self._acting() else []
        boots = ["boots"] if self.world.runs or len(self.live_boots()) < 2 else []
        if self.family.early_death:
            boots *= 2  # early_lock_loss: a death, then a delivery of what the boot held
        racing = ["racing rescuer"] if self._takeovers() else []
        choices = deliver + racing + end + deliver + boots \
            + (["late write"] if self._lost_claims() else []) + deliver + end + racing + deliver
        if not choices:
            return
        what = data.draw(st.sampled_from(choices), label="work")
        if what == "deliver":
            for _ in range(data.draw(st.integers(1, 3), label="messages")):
                self.deliver(data)
        elif what == "body ends":
            self.body_ends(data, data.draw(st.sampled_from(
                ["succeeded", "failed", "cancelled", "retry", "release"]), label="how"))
        elif what == "boots":
            self.boots(data)
        elif what == "racing rescuer":
            self.racing_rescuer(data)
        else:
            self.late_write(data, data.draw(st.sampled_from(["succeeded", "retry", "release"]),
                                            label="how"))

    def deliver(self, data) -> None:
        from app.state.claims import ClaimOutcome, claim_run
        from workers.registry import max_takeovers_of

        boot_id = data.draw(st.sampled_from(self.live_boots()), label="boot")
        # Runs held by dead boots first: repair re-sends them on its next tick.
        live = set(self.live_boots())
        # then unclaimed ones (a duplicate of a live holder's changes nothing).
        def rank(run: ModelRun) -> int:
            if run.status == "running":
                return 0 if run.holder not in live else 2
            return 1

        open_runs = [r.id for r in sorted((r for r in self.world.runs.values()
                                           if r.status not in TERMINAL), key=rank)]
        # ... and the newest unclaimed one last too (generation leans to both ends).
        unclaimed = [r for r in open_runs if self.world.runs[r].status == "unclaimed"]
        open_runs += unclaimed[-1:]
        run = self.world.runs[data.draw(st.sampled_from(open_runs or list(self.world.runs)),
                                        label="run")]
        previous = run.holder
        claim = claim_run(on_session(self.db.session), run.id, boot_id,
                          max_takeovers=max_takeovers_of)
        self.db.session.commit()
        note(f"delivery: {claim.outcome}")
        if claim.outcome in (ClaimOutcome.CLAIMED, ClaimOutcome.TAKEN_OVER):
            run.takeover_from = previous if claim.outcome == ClaimOutcome.TAKEN_OVER else None
            run.status, run.holder, run.slots = "running", boot_id, claim.slots
            self.world.executing.setdefault(run.id, set()).add(boot_id)
            self.world.ever_held[(run.id, boot_id)] = None
            holders = self.world.executing[run.id]
            if len(holders) > 1:
                raise violated("one_holder", f"run {run.id}: {claim.outcome} by {boot_id} while"
                                             f" {sorted(map(str, holders - {boot_id}))} still "
                                             "executes it (dead within its bound)")
            self.check_limits_at_start(run)
        else:
            self.read_back(run)

    def racing_rescuer(self, data) -> None:
        """A second rescuer that read the dead holder before the takeover committed: its
        compare-and-set on the dead boot must find the run taken."""
        from app.state.claims import _decide
        from workers.registry import max_takeovers_of

        run = self.world.runs[data.draw(st.sampled_from(self._takeovers()), label="run")]
        rescuers = [b for b in self.live_boots() if b != run.holder]
        boot_id = data.draw(st.sampled_from(rescuers), label="boot")
        stale = SimpleNamespace(status="running", claimed_by=run.takeover_from,
                                cancel_requested=run.cancel_requested,
                                workflow_name=run.workflow, workflow_version="1",
                                claimer_live=True, due=True, slots=False)
        claim = _decide(on_session(self.db.session), run.id, boot_id, stale, max_takeovers_of)
        self.db.session.commit()
        note(f"racing rescuer: {claim.outcome}")
        if claim.outcome.execute:
            self.world.executing.setdefault(run.id, set()).add(boot_id)
            raise violated("one_holder", f"run {run.id}, taken over from {run.takeover_from} "
                                         f"by {run.holder}, taken over again by {boot_id}")
        self.read_back(run)

    def _takeovers(self) -> list[uuid.UUID]:
        live = set(self.live_boots())
        # Unlimited runs: a limited run's delivery decides under the group's locks, on a
        # state read after them, so no stale read reaches its takeover.
        return [r.id for r in self.world.runs.values()
                if r.status == "running" and r.takeover_from is not None and not r.slots
                and r.holder in live and len(live - {r.holder}) > 0]

    def _acting(self) -> list[tuple[uuid.UUID, uuid.UUID]]:
        """(run, boot) pairs where the boot executes the run and can still write."""
        counting = self.counting_boots()
        return [(run, boot) for run, boots in self.world.executing.items()
                for boot in self.world.boots if boot in boots and boot in counting]

    def body_ends(self, data, how) -> None:
        """The body a boot executes ends: the run finishes, fails, is cancelled at a
        checkpoint, is retried, or is released before user code ran."""
        from app.state.claims import finish_run, release_claim, schedule_retry

        run_id, boot_id = data.draw(st.sampled_from(self._acting()), label="holder")
        run = self.world.runs[run_id]
        if how == "cancelled" and not run.cancel_requested:
            how = "failed"
        if how == "retry":
            ok = schedule_retry(on_session(self.db.session), run_id, boot_id, delay=0,
                                error={"type": "Flaky"})
        elif how == "release":
            ok = release_claim(on_session(self.db.session), run_id, boot_id)
        else:
            ok = finish_run(on_session(self.db.session), run_id, boot_id, status=how,
                            error={"type": "Boom"} if how == "failed" else None)
        self.db.session.commit()
        note(f"body ends: {how} {'recorded' if ok else 'refused'}")
        self.ends(run, boot_id)
        mine = run.status == "running" and run.holder == boot_id
        if ok != mine:
            raise violated("fenced", f"{how} of run {run_id} by {boot_id} returned {ok}, but "
                                     f"the run is {run.status} under {run.holder}")
        if ok:
            run.status = how if how in TERMINAL else "unclaimed"
            run.holder = None

    def late_write(self, data, how) -> None:
        """A write from a boot that held the run once and lost it (taken over, ended):
        refused by its fence, whatever the boot's liveness."""
        from app.state.claims import finish_run, release_claim, schedule_retry

        run_id, boot_id = data.draw(st.sampled_from(self._lost_claims()), label="writer")
        if how == "retry":
            ok = schedule_retry(on_session(self.db.session), run_id, boot_id, delay=0,
                                error={"type": "x"})
        elif how == "release":
            ok = release_claim(on_session(self.db.session), run_id, boot_id)
        else:
            ok = finish_run(on_session(self.db.session), run_id, boot_id, status="succeeded")
        self.db.session.commit()
        note(f"late write: {how} {'accepted' if ok else 'refused'}")
        if ok:
            raise violated("fenced", f"{how} of run {run_id} by {boot_id}, which lost its "
                                     "claim, was accepted")

    def _lost_claims(self) -> list[tuple[uuid.UUID, uuid.UUID]]:
        return [(run, boot) for run, boot in self.world.ever_held
                if not (self.world.runs[run].status == "running"
                        and self.world.runs[run].holder == boot)]

    def operate(self, data) -> None:
        """What operators and beat do: a tenant's cap set, lowered, raised (or lifted, in
        cap_changes); repair's tick; a cancel."""
        what = data.draw(st.sampled_from(
            ["set cap", "repair", "cancel", "set cap"] if self.family.cap_lift
            else ["cancel", "set cap", "repair", "cancel"]), label="operate")
        if what == "set cap":
            self.set_cap(data, data.draw(st.sampled_from(TENANTS), label="tenant"))
        elif what == "repair" or not self.world.runs:
            self.repair()
        else:
            self.cancel(data)

    def cancel(self, data) -> None:
        from app.state.runs import cancel_run

        # Open runs under derived keys first: an ended one is what a re-admission may reuse.
        runs = sorted(self.world.runs.values(),
                      key=lambda r: (r.status in TERMINAL, r.derived is None))
        run = data.draw(st.sampled_from(runs), label="run")
        row = cancel_run(on_session(self.db.session), self.tenant_ids[run.tenant], run.id)
        self.db.session.commit()
        if run.status in TERMINAL:
            assert row is None, f"cancel changed ended run {run.id}"
        elif run.status == "unclaimed":
            run.status = "cancelled"
        else:
            run.cancel_requested = True

    # -- caps and repair ----------------------------------------------------------------------

    def set_cap(self, data, tenant) -> None:
        """``tenants set --max-running``: set, lowered, raised; in cap_changes also lifted
        (``--no-max-running``), which comes first there."""
        from app.tenant_service import set_max_running

        choices = [None, 3, 1, 2] if self.family.cap_lift else [1, 2, 3]
        cap = data.draw(st.sampled_from(choices), label="cap")
        set_max_running(tenant, cap)
        self.db.session.remove()
        self.world.caps[tenant] = cap
        if self.family.cap_lift:
            self.strict_tenant = tenant

    def repair(self) -> None:
        """Beat's repair tick: the wake statement (the backstop for freed slots)."""
        from app.state.runs import wake_waiting_runs

        wake_waiting_runs(on_session(self.db.session), limit=1000)
        self.db.session.commit()

    # -- the checks ---------------------------------------------------------------------------

    @invariant()
    def check(self) -> None:
        STATS["steps (and starts) checked"] += 1
        strict_tenant, self.strict_tenant = self.strict_tenant, None
        table = self.table()
        self._check_no_run_lost(table)
        self._check_one_holder()
        self._check_group_limits()
        self._check_waiting(table, strict_tenant=strict_tenant)
        self._check_derived_keys()
        self._check_ticks()
        # Time passes for dead boots: past the window, their bound has passed too.
        for boot_id, model in list(self.world.boots.items()):
            if model.state == "early" and time.monotonic() - model.died_at > EARLY_WINDOW:
                self._bound_passes(boot_id)

    def _check_no_run_lost(self, table) -> None:
        missing = set(self.world.runs) - set(table)
        unknown = set(table) - set(self.world.runs)
        if missing or unknown:
            raise violated("no_run_lost", f"admitted but not in the table: {sorted(missing)}; "
                                          f"in the table but never admitted: {sorted(unknown)}")
        for run in self.world.runs.values():
            status, claimed_by, reason = table[run.id][:3]
            if run.status in TERMINAL:
                ok = status == run.status
            elif run.status == "running":
                ok = status == "running" and claimed_by == run.holder
            else:
                ok = status in ("queued", "waiting") and (status == "queued" or reason)
            if not ok:
                raise violated("no_run_lost", f"run {run.id} is {status} under {claimed_by} "
                                              f"(reason {reason}); the model has it {run.status}"
                                              f" under {run.holder}")

    def _check_one_holder(self) -> None:
        for run_id, holders in self.world.executing.items():
            live = holders & self.counting_boots()
            if len(live) > 1:
                raise violated("one_holder", f"run {run_id} executed by {len(live)} boots")

    def _check_group_limits(self) -> None:
        counting = self.counting_boots()
        groups: dict[tuple, list[ModelRun]] = {}
        for run in self.world.runs.values():
            if run.group is not None:
                groups.setdefault(run.group, []).append(run)
        for group, runs in groups.items():
            n = self.count_running(runs, counting)
            if n > runs[0].limit:
                raise violated("limits", f"{n} runs of group {group} running "
                                         f"(limit {runs[0].limit})")

    def _check_waiting(self, table, *, strict_tenant: str | None) -> None:
        """Each waiting run's reason applies, or repair would wake it. Right after a tenant's
        cap changed (cap_changes), its cap's waiters must be woken by one repair tick: a
        change that frees capacity wakes all it freed at once."""
        waiting = {run_id: row for run_id, row in table.items() if row[0] == "waiting"}
        if not waiting:
            return
        note(f"waiting runs checked: {min(len(waiting), 3)}{'+' if len(waiting) > 3 else ''}")
        # What the system would wake is asked only for a run whose own reason has room:
        # the verdict is the same (woken, or its reason applies), without a rolled-back
        # wake-and-claim replay per step for runs that plainly still wait.
        woken_by: dict[bool, set[uuid.UUID]] = {}
        counting = self.counting_boots()
        for run_id, row in waiting.items():
            reason = row[2]
            if reason not in ("concurrency", "tenant_cap"):
                raise violated("waiting", f"run {run_id} waits ({reason}) for nothing")
            if self._reason_applies(run_id, table, counting):
                continue
            run = self.world.runs[run_id]
            strict = reason == "tenant_cap" and run.tenant == strict_tenant
            if strict not in woken_by:
                woken_by[strict] = self._would_wake(strict=strict)
            if run_id in woken_by[strict]:
                continue
            raise violated("waiting", (
                f"run {run_id} ({run.tenant}/{run.workflow}, group {run.group}) waits "
                f"({reason}) with nothing to wake it: its {reason} has room (cap "
                f"{self.world.caps[run.tenant]}, limit {run.limit}) and "
                f"{'a repair tick' if strict else 'repair ticks'} would not wake it"))

    def _reason_applies(self, run_id, table, counting) -> bool:
        """The claim's own count (``claims._verdict``): slots held, plus older runs that want
        one (queued and due, or waiting), reaches the cap or the limit."""
        status, _, reason, tenant_id, name, ckey, limit, _, created, _ = table[run_id]
        me = (created, run_id)

        def wanting(row_id, row, waits) -> bool:
            return (row[8], row_id) < me and (
                (row[0] == "queued" and row[9] and not row[7])
                or (row[0] == "waiting" and row[2] in waits))

        def held(row) -> bool:
            return row[0] == "running" and row[1] in counting

        if reason == "tenant_cap":
            cap = self.world.caps[self.world.runs[run_id].tenant]
            scope = {i: r for i, r in table.items() if r[3] == tenant_id}
            bound, waits = cap, ("tenant_cap",)
        else:
            scope = {i: r for i, r in table.items()
                     if (r[3], r[4], r[5]) == (tenant_id, name, ckey) and r[6] is not None}
            bound, waits = limit, ("concurrency", "tenant_cap")
        if bound is None:
            return False
        return sum(1 for i, r in scope.items() if held(r) or wanting(i, r, waits)) >= bound

    def _would_wake(self, *, strict: bool) -> set[uuid.UUID]:
        """The waiting runs the system itself would re-queue, on a transaction rolled back
        after. ``strict``: one repair tick's wake statement, now. Else the future that
        needs no caller: repair ticks, and the deliveries of every queued run (repair
        re-sends them), each claimed by a live boot (and held: its end would wake more),
        until nothing changes."""
        from sqlalchemy.orm import Session

        from app.state.claims import claim_run
        from app.state.runs import wake_waiting_runs
        from workers.registry import max_takeovers_of

        woken: set[uuid.UUID] = set()
        claimer = self.live_boots()[0] if self.live_boots() else None
        with self.db.engine.connect() as conn:
            session = Session(bind=conn)
            try:
                for _ in range(1 if strict else 20):
                    rows = wake_waiting_runs(on_session(session), limit=1000)
                    woken |= {row.id for row in rows}
                    if strict or claimer is None:
                        break
                    queued = session.execute(QUEUED_DUE).scalars().all()
                    for run_id in queued:
                        claim_run(on_session(session), run_id, claimer,
                                  max_takeovers=max_takeovers_of)
                    if not rows and not queued:
                        break
            finally:
                session.rollback()
                session.close()
        return woken

    def _check_derived_keys(self) -> None:
        for key, runs in self.world.derived.items():
            if len(runs) > 1:
                raise violated("derived_keys", f"derived key {key!r} named {len(runs)} runs: "
                                               f"{sorted(map(str, runs))}")
        for key, n in self.pg.execute(
                "SELECT coalesce(dispatch_key, released_key) AS k, count(*) FROM runs "
                "WHERE coalesce(dispatch_key, released_key) LIKE 'schedule:%%' "
                "OR coalesce(dispatch_key, released_key) LIKE 'kafka:%%' OR origin = 'fanout' "
                "GROUP BY 1 HAVING count(*) > 1"):
            raise violated("derived_keys", f"derived key {key!r} names {n} runs")

    def _check_ticks(self) -> None:
        for (workflow, period), runs in self.world.ticks.items():
            if len(runs) > 1:
                raise violated("ticks", f"{workflow}'s tick of period {period} has {len(runs)}"
                                        f" runs: {sorted(map(str, runs))}")
        for detail, n in self.pg.execute(
                "SELECT origin_detail, count(*) FROM runs WHERE origin = 'schedule' "
                "GROUP BY 1 HAVING count(*) > 1"):
            raise violated("ticks", f"schedule tick {detail!r} has {n} runs")


# -- the test -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_workflows():
    """Register the model's workflows in this process for the module (popped after)."""
    from workers import registry

    def body(ctx, input):
        return input

    names = []
    for name, (limit, reuse) in CALLER_WORKFLOWS.items():
        registry.workflow(name, concurrency_limit=limit,
                          concurrency_key=(lambda input: input.get("g")) if limit else None,
                          key_reuse=reuse, key_ttl=0 if reuse != "never" else None)(body)
        names.append(name)
    yield names
    for name in names:
        registry._registry.pop(name, None)


@pytest.fixture
def scheduled_workflows(model_workflows, request):
    """The schedules beats tick in this family (registered for the test, popped after)."""
    from workers import registry

    family: Family = request.getfixturevalue("family_flags")
    names = []
    for name, (limit, reuse) in SCHEDULED_WORKFLOWS.items():
        if reuse != "never" and not family.derived_reuse:
            continue
        registry.workflow(name, concurrency_limit=limit, key_reuse=reuse,
                          key_ttl=0 if reuse != "never" else None, schedule=PERIOD,
                          schedule_tenant="ma",
                          schedule_input=lambda tick: {"tick": tick.isoformat()})(
            lambda ctx, input: input)
        names.append(name)
    yield names
    for name in names:
        registry._registry.pop(name, None)


@pytest.fixture
def family_flags(request) -> Family:
    return FAMILIES[request.param]


# Bounded shrinking: a failure is reported within make test's budget, not after five minutes.
try:
    from hypothesis.internal.conjecture import engine as _engine

    _engine.MAX_SHRINKING_SECONDS = min(_engine.MAX_SHRINKING_SECONDS, 90)
except (ImportError, AttributeError):  # pragma: no cover - Hypothesis internals moved
    pass


def _family_params():
    for name in FAMILIES:
        marks = [pytest.mark.xfail(raises=Violation, reason=KNOWN_BROKEN[name])] \
            if name in KNOWN_BROKEN else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("family_flags", list(_family_params()), indirect=True)
def test_every_rule_holds_across_features(app, database_url, family_flags, request,
                                          scheduled_workflows, capsys, redis_client,
                                          queue_name):
    name = request.node.callspec.id
    chosen = os.environ.get("POIMEN_MODEL_SEED")
    run_seed = int(chosen) if chosen else random.SystemRandom().randrange(2**32)
    examples = int(os.environ.get("POIMEN_MODEL_EXAMPLES", "50"))
    # Printed first: pytest shows it with a failure (Hypothesis adds @reproduce_failure).
    print(f"cross-feature model [{name}]: seed {run_seed} (POIMEN_MODEL_SEED={run_seed} "
          f"reproduces it), {examples} examples")

    class Machine(CrossFeatureModel):
        pass

    Machine.family = family_flags
    Machine.app = app
    Machine.dsn = libpq_url(database_url)
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if name not in KNOWN_BROKEN or os.environ.get("POIMEN_MODEL_SHRINK"):
        phases.append(Phase.shrink)
    factory = seed(run_seed)(lambda: Machine())
    STATS.clear()
    try:
        with app.app_context():
            run_state_machine_as_test(factory, settings=settings(
                max_examples=examples, stateful_step_count=30, deadline=None,
                derandomize=False, database=None, print_blob=True, phases=phases,
                suppress_health_check=list(HealthCheck)))
    finally:
        print("\n".join(f"  {n:5d}  {what}" for what, n in sorted(STATS.items())))
        forget_the_sends(app, redis_client, queue_name)


def forget_the_sends(app, redis_client, queue_name: str) -> None:
    """Drop the Celery messages of this test's runs: its examples committed thousands of
    runs that no worker here executes, and the session's queues are shared. Left there, a
    later test's worker would spend its time on them (and a test counting Redis
    transactions would count theirs)."""
    from app.enqueue import sender

    assert sender(app.extensions["celery"]).wait_idle(60), "the sender is stuck"
    for key in redis_client.scan_iter(match=f"{queue_name}*"):
        if redis_client.type(key) == b"list":
            redis_client.delete(key)
