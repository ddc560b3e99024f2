"""Rate limits decided in the claim: deterministic rule tests on real Postgres and Redis.

A workflow's ``rate_limit`` (per ``rate_key``) and a tenant's allow so many first starts per
period across every worker: the claim (``poimen_claim_slot`` calling ``poimen_rate_start``)
starts a run now or reserves its start, ``queued`` with ``not_before`` and wait reason
``rate_limit``, holding no worker. Time is moved by moving rows' times, never by sleeping.
Each feature it meets is tried here too: concurrency limits, tenant caps and their lifting,
retries, delayed runs, expiry, cancels, replays of caller keys, derived keys, beat's timer.
The processes test (300 runs, three workers) is ``test_rate_limits_processes.py``.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest

from app.state.claims import ClaimOutcome, claim_run, claim_slot, finish_run, schedule_retry
from app.state.executor import on_session
from tests.conftest import wait_until_waiting_on_a_lock
from workers.registry import max_takeovers_of

from .test_claims import claim, events_of, hold_as

# "40/m" ("rated-slow"): the spacing of two starts of one key, long enough that a test's
# claims a moment apart are a moment apart on a loaded machine too, short enough that the
# next start (under 2 s away) is the reserving worker's to send.
T = timedelta(seconds=1.5)


@pytest.fixture
def session(app):
    from app.extensions import db

    with app.app_context():
        yield db.session
        db.session.rollback()


def rated(admit, customer="c1", **kwargs):
    return admit("rated-slow", {"customer": customer}, **kwargs)


def row(pg, run_id):
    return pg.execute("SELECT status, wait_reason, claimed_by, attempt, not_before, "
                      "last_sent_at, started_at FROM runs WHERE id = %s", [run_id]).fetchone()


def next_start(pg, scope):
    found = pg.execute("SELECT next_start FROM rate_slots WHERE scope = %s", [scope]).fetchone()
    return None if found is None else found[0]


def key_scope(pg, run_id):
    tenant, name, key = pg.execute("SELECT tenant_id, workflow_name, rate_key FROM runs "
                                   "WHERE id = %s", [run_id]).fetchone()
    return f"w:{tenant}|{name}|{key or ''}"


def come_due(pg, run_id) -> None:
    """Time passes: the run's reserved start is now."""
    pg.execute("UPDATE runs SET not_before = now() - interval '1 millisecond' WHERE id = %s",
               [run_id])


def scope_free(pg, scope) -> None:
    """Time passes: the scope's last start and its line are behind us."""
    pg.execute("UPDATE rate_slots SET next_start = '-infinity', last_start = '-infinity' "
               "WHERE scope = %s", [scope])


def last_start_ago(pg, scope, seconds) -> None:
    """Time passes: the scope's last start was ``seconds`` ago (its line is left as it is)."""
    pg.execute("UPDATE rate_slots SET last_start = now() - make_interval(secs => %s) "
               "WHERE scope = %s", [seconds, scope])


def tick(app):
    from workers import timers

    return timers.tick(app, page=1000)


# -- declaring and admitting -------------------------------------------------------------------

@pytest.mark.parametrize("limit, interval", [("10/s", 0.1), ("100/m", 0.6), ("5", 0.2),
                                             ("1/h", 3600.0), (" 2 / s ", 0.5)])
def test_a_rate_limit_is_a_count_per_second_minute_or_hour(limit, interval):
    from workers.registry import rate_interval

    assert rate_interval(limit) == pytest.approx(interval)


@pytest.mark.parametrize("kwargs", [{"rate_limit": "0/s"}, {"rate_limit": "ten/s"},
                                    {"rate_limit": "10/d"}, {"rate_limit": 10},
                                    {"rate_key": lambda input: 1},
                                    {"rate_limit": "1/s", "rate_key": "customer"}])
def test_a_bad_rate_limit_is_refused_when_declared(kwargs):
    from workers.registry import InvalidDefinition, Workflow

    with pytest.raises(InvalidDefinition):
        Workflow("bad-rate", "1", steps=steps(), **kwargs)


def steps():
    from workers.registry import Step, action

    def body(ctx, input):
        return None

    return [Step("main", actions=[action(body, position=0)])]


def test_the_key_is_derived_from_the_input_and_the_interval_pinned(admit, pg):
    keyed = admit("rated", {"customer": "acme"})
    bare, plain = admit("rated", {}), admit("echo", {})
    rows = {r[0]: r[1:] for r in pg.execute("SELECT id, rate_key, rate_interval FROM runs")}
    assert rows[keyed] == ("acme", 0.1)
    assert rows[bare] == (None, 0.1)  # no key: one scope for the tenant and workflow
    assert rows[plain] == (None, None)


def test_a_batch_pins_each_runs_key_and_a_bad_one_is_its_items_422(client, tenant, pg):
    from workers import registry
    from workers.registry import Workflow, register

    def strict(input):
        return input["account"]

    register(Workflow("rated-strict", "1", steps=steps(), rate_limit="2/s", rate_key=strict))
    try:
        answer = client.post("/v1/runs/batch", headers=tenant.headers, json={"runs": [
            {"workflow_ref": "rated", "input": {"customer": "a"}},
            {"workflow_ref": "rated-strict", "input": {"account": "b"}},
            {"workflow_ref": "rated-strict", "input": {}}]})
        assert answer.status_code == 200, answer.json
        items = answer.json["results"]
        assert [item["status"] for item in items] == [201, 201, 422]
        assert "rate_key" in items[2]["error"]["details"]["fields"]
        rows = pg.execute("SELECT rate_key, rate_interval FROM runs ORDER BY created_at").fetchall()
        assert sorted(rows) == [("a", 0.1), ("b", 0.5)]
    finally:
        registry._registry.pop("rated-strict", None)


def test_a_key_the_workflow_cannot_derive_is_a_422_naming_no_input(client, tenant):
    from workers import registry
    from workers.registry import Workflow, register

    def boom(input):
        raise KeyError("secret-value")

    register(Workflow("rated-boom", "1", steps=steps(), rate_limit="1/s", rate_key=boom))
    try:
        answer = client.post("/v1/runs", headers=tenant.headers,
                             json={"workflow_ref": "rated-boom", "input": {"a": 1}})
        assert answer.status_code == 422
        assert "secret-value" not in answer.get_data(as_text=True)
        assert "KeyError" in answer.json["error"]["details"]["fields"]["rate_key"]
    finally:
        registry._registry.pop("rated-boom", None)


# -- the claim ---------------------------------------------------------------------------------

def test_the_second_start_a_moment_later_is_reserved_one_interval_after_the_first(
        session, admit, boot_factory, pg):
    first, second, third = rated(admit), rated(admit), rated(admit)
    boot = boot_factory()
    assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    started = row(pg, first)[6]
    scope = key_scope(pg, first)
    assert next_start(pg, scope) == started + T

    waited = claim(session, second, boot.boot_id)
    assert waited.outcome == ClaimOutcome.RATE_WAIT
    assert waited.not_before == started + T and waited.wait_reason == "rate_limit"
    # Queued, holding no worker, no attempt counted; less than 2 s away, so this delivery's
    # worker sends it for then (counted sent at its time: beat leaves it alone).
    status, reason, holder, attempt, not_before, last_sent, _ = row(pg, second)
    assert (status, reason, holder, attempt) == ("queued", "rate_limit", None, 0)
    assert not_before == last_sent == started + T and waited.send_for_start
    assert events_of(pg, second) == ["run.admitted", "run.waiting"]
    payload = pg.execute("SELECT payload FROM outbox WHERE run_id = %s AND event_type = "
                         "'run.waiting'", [second]).fetchone()[0]
    assert payload["reason"] == "rate_limit" and payload["not_before"]

    assert claim(session, third, boot.boot_id).not_before == started + 2 * T
    assert next_start(pg, scope) == started + 3 * T


def test_a_reserved_run_claimed_early_is_not_due_and_when_due_keeps_its_place(
        session, admit, boot_factory, pg):
    first, second, third = rated(admit), rated(admit), rated(admit)
    boot = boot_factory()
    for run_id in (first, second, third):
        claim(session, run_id, boot.boot_id)
    scope = key_scope(pg, first)
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.NOT_DUE
    come_due(pg, second)
    last_start_ago(pg, scope, 2 * T.total_seconds())  # its time came; not the third's yet
    line = next_start(pg, scope)
    got = claim(session, second, boot.boot_id)
    assert got.outcome == ClaimOutcome.CLAIMED and got.attempt == 1
    assert next_start(pg, scope) == line  # its reservation was its place: no other taken
    assert row(pg, second)[:3] == ("running", None, boot.boot_id)


def test_a_reserved_run_after_a_late_start_waits_the_interval_and_keeps_its_place(
        session, admit, boot_factory, pg):
    """Exact however late a run comes: a reserved run whose time came, just after a start
    that came late, is put off until the interval since that start has passed."""
    first, second, third = rated(admit), rated(admit), rated(admit)
    boot = boot_factory()
    for run_id in (first, second, third):
        claim(session, run_id, boot.boot_id)
    scope = key_scope(pg, first)
    come_due(pg, second)
    last_start_ago(pg, scope, 0.03)  # a start late for its time, 30 ms ago
    late, line = pg.execute("SELECT last_start, next_start FROM rate_slots WHERE scope = %s",
                            [scope]).fetchone()
    got = claim(session, second, boot.boot_id)
    assert got.outcome == ClaimOutcome.RATE_WAIT and got.not_before == late + T
    assert next_start(pg, scope) == line  # still ahead of the third
    assert row(pg, second)[:2] == ("queued", "rate_limit")


def test_keys_are_apart_and_a_workflow_without_a_limit_is_claimed_as_ever(
        session, admit, boot_factory, pg):
    boot = boot_factory()
    assert claim(session, rated(admit, "c1"), boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert claim(session, rated(admit, "c2"), boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert claim(session, rated(admit, "c1"), boot.boot_id).outcome == ClaimOutcome.RATE_WAIT
    plain = admit("echo", {})
    assert claim(session, plain, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert pg.execute("SELECT count(*) FROM rate_slots").fetchone()[0] == 2


def test_a_start_further_away_is_beats_to_send_when_due_once(session, admit, boot_factory, pg,
                                                           app, queue):
    first, far = rated(admit), rated(admit)
    boot = boot_factory()
    claim(session, first, boot.boot_id)
    scope = key_scope(pg, first)
    pg.execute("UPDATE rate_slots SET next_start = now() + interval '30 seconds' "
               "WHERE scope = %s", [scope])
    sent = queue()  # the admissions' own sends
    waited = claim(session, far, boot.boot_id)
    assert waited.outcome == ClaimOutcome.RATE_WAIT and not waited.send_for_start
    status, _, _, _, not_before, last_sent, _ = row(pg, far)
    assert last_sent < not_before  # beat's release_due sends it
    assert tick(app) == (0, 0) and queue() == sent
    come_due(pg, far)
    assert tick(app) == (1, 0) and queue() == [*sent, str(far)]
    assert tick(app) == (0, 0)


def test_a_claim_waiting_for_the_scope_lock_reads_the_start_the_holder_committed(
        session, admit, boot_factory, pg, dsn):
    """The rule's order, made deterministic with two sessions: claim A holds the scope's row
    lock, uncommitted; claim B waits for it. B's start is read after the lock, so it is
    reserved one interval after A's, never taken at the same moment
    (mutant ``rate_check_then_claim``: B read the start before the lock)."""
    warm, a, b = rated(admit), rated(admit), rated(admit)
    boot = boot_factory()
    claim(session, warm, boot.boot_id)  # the scope's row exists, committed
    scope = key_scope(pg, warm)
    scope_free(pg, scope)

    got_a = claim_slot(on_session(session), a, boot.boot_id, max_takeovers=max_takeovers_of)
    assert got_a.outcome == ClaimOutcome.CLAIMED  # in session's transaction, not committed
    results = {}

    def claim_b():
        with psycopg.connect(dsn, autocommit=True, application_name="rate-b") as conn:
            results["b"] = conn.execute("SELECT status, not_before FROM poimen_claim_slot(%s, %s)",
                                        [b, boot.boot_id]).fetchone()

    thread = threading.Thread(target=claim_b)
    thread.start()
    try:
        wait_until_waiting_on_a_lock(pg, "rate-b")
    finally:
        session.commit()
        thread.join(10)
    started_a = row(pg, a)[6]
    assert results["b"] == ("queued", started_a + T)


def test_claims_from_many_connections_at_once_are_never_closer_than_the_interval(
        admit, boot_factory, pg, dsn):
    runs = [rated(admit) for _ in range(24)]
    boot = boot_factory()
    barrier = threading.Barrier(8)
    starts = []

    def claimer(mine):
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait()
            for run_id in mine:
                conn.execute("SELECT * FROM poimen_claim_slot(%s, %s)", [run_id, boot.boot_id])

    threads = [threading.Thread(target=claimer, args=(runs[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for status, started, not_before in pg.execute(
            "SELECT status, started_at, not_before FROM runs WHERE id = ANY(%s)", [runs]):
        starts.append(started if status == "running" else not_before)
    starts.sort()
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len(starts) == 24 and min(gaps) >= T, gaps
    assert pg.execute("SELECT count(*) FROM runs WHERE id = ANY(%s) AND status = 'running'",
                      [runs]).fetchone()[0] >= 1


# -- where it meets the rest -----------------------------------------------------------------

def test_a_run_without_a_slot_uses_no_start_and_takes_one_once_woken(
        session, admit, boot_factory, pg):
    """A concurrency limit of one and a rate limit: the slot first, then the start."""
    first, second = admit("rated-keyed", {}), admit("rated-keyed", {})
    boot = boot_factory()
    assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    scope = key_scope(pg, first)
    before = next_start(pg, scope)
    waited = claim(session, second, boot.boot_id)
    assert (waited.outcome, waited.wait_reason) == (ClaimOutcome.SLOT_WAIT, "concurrency")
    assert next_start(pg, scope) == before  # waiting for a slot took no start

    assert finish_run(on_session(session), first, boot.boot_id, status="succeeded")
    session.commit()
    assert row(pg, second)[:2] == ("queued", None)  # woken
    got = claim(session, second, boot.boot_id)
    # Its start: one interval after the first's, or now if that passed meanwhile.
    if got.outcome == ClaimOutcome.RATE_WAIT:
        assert got.not_before == before
    else:
        assert got.outcome == ClaimOutcome.CLAIMED and row(pg, second)[6] >= before
    assert next_start(pg, scope) > before


def test_a_tenants_rate_limit_spaces_all_its_runs_and_lifting_it_frees_new_ones(
        session, admit, boot_factory, pg, app, tenant):
    from app import tenant_service

    with app.app_context():
        assert tenant_service.set_rate_limit(tenant.name, "40/m").rate_interval == 1.5
    one, two = admit("echo", {}), admit("echo", {"n": 2})
    boot = boot_factory()
    assert claim(session, one, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    reserved = claim(session, two, boot.boot_id)
    assert reserved.outcome == ClaimOutcome.RATE_WAIT
    assert reserved.not_before == row(pg, one)[6] + T

    with app.app_context():
        assert tenant_service.set_rate_limit(tenant.name, None).rate_limit is None
    # A new run is claimed as ever; the start reserved under the old limit keeps its time.
    assert claim(session, admit("echo", {"n": 3}), boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert row(pg, two)[:2] == ("queued", "rate_limit")
    come_due(pg, two)
    assert claim(session, two, boot.boot_id).outcome == ClaimOutcome.CLAIMED


def test_a_tenant_cap_and_a_rate_limit_together(session, admit, boot_factory, pg, app, tenant):
    from app import tenant_service

    pg.execute("UPDATE tenants SET max_running = 1 WHERE id = %s", [tenant.id])
    with app.app_context():
        tenant_service.set_rate_limit(tenant.name, "40/m")
    one, two = admit("echo", {}), admit("echo", {"n": 2})
    boot = boot_factory()
    assert claim(session, one, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    waited = claim(session, two, boot.boot_id)
    assert (waited.outcome, waited.wait_reason) == (ClaimOutcome.SLOT_WAIT, "tenant_cap")
    assert next_start(pg, f"t:{tenant.id}") == row(pg, one)[6] + T  # one start, not two


def test_a_retry_takes_no_start(session, admit, boot_factory, pg):
    first = rated(admit)
    boot = boot_factory()
    claim(session, first, boot.boot_id)
    scope = key_scope(pg, first)
    pg.execute("UPDATE rate_slots SET next_start = now() + interval '1 hour' WHERE scope = %s",
               [scope])
    assert schedule_retry(on_session(session), first, boot.boot_id, delay=0.0, error={})
    session.commit()
    come_due(pg, first)
    got = claim(session, first, boot.boot_id)
    assert got.outcome == ClaimOutcome.CLAIMED and got.attempt == 2  # not a first start


def test_a_takeover_takes_no_start(session, admit, boot_factory, dead_boot, pg):
    first = rated(admit)
    boot = boot_factory()
    claim(session, rated(admit), boot.boot_id)  # the scope's row
    pg.execute("UPDATE rate_slots SET next_start = now() + interval '1 hour', "
               "last_start = now()")
    hold_as(pg, first, dead_boot())  # started under a worker that died
    got = claim(session, first, boot.boot_id)
    assert got.outcome == ClaimOutcome.TAKEN_OVER and got.attempt == 2


def test_a_scheduled_workflows_runs_are_limited_like_any(session, admit, boot_factory, pg, app):
    """Beat admits a scheduled run as any admission does; its claim decides its start."""
    from workers import registry
    from workers.registry import Workflow, register

    register(Workflow("rated-scheduled", "1", steps=steps(), rate_limit="1/m", schedule=3600,
                      schedule_tenant="t"))
    try:
        first, second = admit("rated-scheduled", {}), admit("rated-scheduled", {})
        boot = boot_factory()
        assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.CLAIMED
        later = claim(session, second, boot.boot_id)
        assert later.outcome == ClaimOutcome.RATE_WAIT and not later.send_for_start
        assert later.not_before == row(pg, first)[6] + timedelta(minutes=1)
    finally:
        registry._registry.pop("rated-scheduled", None)


def test_a_delayed_run_takes_its_start_when_it_comes_due(session, admit, boot_factory, pg, app):
    delayed = rated(admit, delay_seconds=60)
    assert pg.execute("SELECT count(*) FROM rate_slots").fetchone()[0] == 0
    come_due(pg, delayed)
    assert tick(app) == (1, 0)
    boot = boot_factory()
    assert claim(session, delayed, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert next_start(pg, key_scope(pg, delayed)) == row(pg, delayed)[6] + T


def test_a_reserved_run_expires_and_is_cancelled_like_any_queued_run(
        session, admit, boot_factory, pg, app, client, tenant, queue):
    first = rated(admit)
    expiring = rated(admit, expires_in_seconds=60)
    cancelled = rated(admit)
    boot = boot_factory()
    claim(session, first, boot.boot_id)
    pg.execute("UPDATE rate_slots SET next_start = now() + interval '30 seconds'")
    for run_id in (expiring, cancelled):
        assert claim(session, run_id, boot.boot_id).outcome == ClaimOutcome.RATE_WAIT
    pg.execute("UPDATE runs SET expires_at = now() - interval '1 millisecond' WHERE id = %s",
               [expiring])
    assert tick(app) == (0, 1)
    answer = client.post(f"/v1/runs/{cancelled}/cancel", headers=tenant.headers)
    assert answer.status_code == 200 and answer.json["status"] == "cancelled"
    sent = queue()
    for run_id in (expiring, cancelled):
        come_due(pg, run_id)
    assert tick(app) == (0, 0) and queue() == sent
    # Ended, they wait for nothing any more.
    assert [row(pg, r)[:2] for r in (expiring, cancelled)] == [("expired", None),
                                                               ("cancelled", None)]
    assert claim(session, expiring, boot.boot_id).outcome == ClaimOutcome.FINISHED


def test_a_replay_of_a_reserved_run_returns_it_and_sends_nothing(
        session, admit, boot_factory, pg, client, tenant, queue):
    boot = boot_factory()
    claim(session, rated(admit), boot.boot_id)
    body = {"workflow_ref": "rated-slow", "input": {"customer": "c1"}, "dispatch_key": "k1"}
    first = client.post("/v1/runs", json=body, headers=tenant.headers).json["id"]
    claim(session, first, boot.boot_id)
    sent = queue()
    again = client.post("/v1/runs", json=body, headers=tenant.headers)
    assert again.status_code == 200 and again.json["id"] == first
    assert (again.json["status"], again.json["wait_reason"]) == ("queued", "rate_limit")
    assert again.json["not_before"] and queue() == sent


def test_a_slot_claim_in_a_callers_transaction_decides_as_in_autocommit(
        session, admit, boot_factory, pg):
    """claim_run in a transaction routes a rate-limited run to the slot claim (SLOTS is only
    for autocommit), and a rate-limited run claimed twice is a duplicate."""
    first = rated(admit)
    boot = boot_factory()
    got = claim_run(on_session(session), first, boot.boot_id, max_takeovers=max_takeovers_of)
    session.commit()
    assert got.outcome == ClaimOutcome.CLAIMED and got.slots
    assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.DUPLICATE


def test_the_cli_sets_shows_and_lifts_a_tenants_rate_limit(app, tenant):
    runner = app.test_cli_runner()
    out = runner.invoke(args=["tenants", "set", tenant.name, "--rate-limit", "50/s"])
    assert out.exit_code == 0 and "rate limit 50/s" in out.output
    assert "rate-limit 50/s" in runner.invoke(args=["tenants", "list"]).output
    bad = runner.invoke(args=["tenants", "set", tenant.name, "--rate-limit", "lots"])
    assert bad.exit_code != 0 and "rate_limit must be" in bad.output
    out = runner.invoke(args=["tenants", "set", tenant.name, "--no-rate-limit"])
    assert out.exit_code == 0 and "rate limit none" in out.output
    assert runner.invoke(args=["tenants", "set", tenant.name]).exit_code != 0


def test_the_console_shows_a_reserved_start(session, admit, boot_factory, tenant):
    import re

    from app import create_app

    boot = boot_factory()
    claim(session, rated(admit), boot.boot_id)
    reserved = rated(admit)
    claim(session, reserved, boot.boot_id)
    console = create_app({"POIMEN_CONSOLE_SECRET": "s" * 40, "TESTING": True}).test_client()
    page = console.get("/console/sign-in").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page)[1]
    console.post("/console/sign-in", data={"csrf_token": csrf, "token": tenant.token})
    detail = console.get(f"/console/runs/{reserved}").get_data(as_text=True)
    assert 'data-reason="rate_limit"' in detail and "reserved for" in detail


def test_a_celery_tasks_own_rate_limit_becomes_its_workflows_across_every_worker():
    from celery import Celery

    from workers import registry
    from workers.celery_native import workflow_from_task

    celery_app = Celery("rate-limit-test")

    @celery_app.task(name="rate.tasks.per_second", rate_limit=5)
    def per_second():
        return None

    @celery_app.task(name="rate.tasks.per_minute", rate_limit="30/m")
    def per_minute():
        return None

    try:
        assert workflow_from_task(per_second).rate_limit == "5"  # Celery's number: a second
        wf = workflow_from_task(per_minute, rate_key=lambda input: input["account"])
        assert registry.rate_of(wf, {"account": "a-1"}) == ("a-1", 2.0)
    finally:
        for name in ("rate.tasks.per_second", "rate.tasks.per_minute"):
            registry._registry.pop(name, None)
