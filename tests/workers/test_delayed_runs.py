"""Delayed runs and expiry: deterministic rule tests on real Postgres and Redis.

A delayed run waits in Postgres and is sent by beat's timer tick (``workers/timers.py``)
when due, never as a Celery ETA; a run no worker started by its ``expires_at`` ends
``expired``. Time is moved by moving a run's times in the database, never by sleeping.
Each feature it meets is tried here too: replays of caller and derived keys, claims,
retries, concurrency limits and tenant caps, joins, cancels and takeovers. The
processes test (a worker, beat, a Redis FLUSHALL and a worker restart) is
``test_delayed_runs_processes.py``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from app.state.claims import ClaimOutcome, schedule_retry
from app.state.executor import on_session

from .test_claims import claim, events_of, hold_as


@pytest.fixture
def session(app):
    from app.extensions import db

    with app.app_context():
        yield db.session
        db.session.rollback()


def tick(app) -> tuple[int, int]:
    """One beat timer tick, as beat's thread runs it."""
    from workers import timers

    return timers.tick(app, page=1000)


def row(pg, run_id):
    return pg.execute("SELECT status, not_before, admitted_not_before, expires_at, "
                      "last_sent_at, created_at, started_at FROM runs WHERE id = %s",
                      [run_id]).fetchone()


def come_due(pg, run_id) -> None:
    """Time passes: the run's not_before is now (its admission's send, earlier, stays)."""
    pg.execute("UPDATE runs SET not_before = now() - interval '1 millisecond', "
               "admitted_not_before = now() - interval '1 millisecond' WHERE id = %s",
               [run_id])


def come_expired(pg, run_id) -> None:
    pg.execute("UPDATE runs SET expires_at = now() - interval '1 millisecond' WHERE id = %s",
               [run_id])


def post(client, tenant, **body):
    return client.post("/v1/runs", json={"workflow_ref": "echo", "input": {}, **body},
                       headers=tenant.headers)


# -- admission ----------------------------------------------------------------------------------

def test_a_delayed_run_is_stored_with_its_time_and_not_sent(client, tenant, pg, queue):
    answer = post(client, tenant, delay_seconds=30)
    assert answer.status_code == 201, answer.json
    run_id = answer.json["id"]
    status, not_before, admitted, expires_at, last_sent, created, _ = row(pg, run_id)
    assert status == "queued" and expires_at is None
    # Counted by Postgres from the admission, and kept as admitted.
    assert not_before == admitted == created + timedelta(seconds=30)
    assert answer.json["not_before"] == not_before.isoformat()
    assert queue() == []  # no Celery ETA: nothing in Redis until it is due


def test_an_instant_in_the_past_or_no_delay_is_sent_at_once(client, tenant, pg, queue):
    past = post(client, tenant,
                not_before=(datetime.now(UTC) - timedelta(hours=1)).isoformat())
    assert past.status_code == 201
    now = post(client, tenant, delay_seconds=0)
    plain = post(client, tenant)
    assert queue() == [past.json["id"], now.json["id"], plain.json["id"]]


@pytest.mark.parametrize("body, field", [
    ({"delay_seconds": -1}, "delay_seconds"),
    ({"delay_seconds": "5"}, "delay_seconds"),
    ({"delay_seconds": True}, "delay_seconds"),
    ({"delay_seconds": 400 * 86400}, "delay_seconds"),
    ({"not_before": "tomorrow"}, "not_before"),
    ({"not_before": "2026-12-05T18:00:00"}, "not_before"),  # no offset
    ({"not_before": "2026-12-05"}, "not_before"),  # a date, not an instant
    ({"not_before": "2999-01-01T00:00:00Z"}, "not_before"),
    ({"not_before": "2026-12-05T18:00:00Z", "delay_seconds": 5}, "delay_seconds"),
    ({"expires_in_seconds": -0.5}, "expires_in_seconds"),
    ({"expires_at": 12}, "expires_at"),
    ({"expires_at": "2026-12-05T18:00:00Z", "expires_in_seconds": 5}, "expires_in_seconds"),
])
def test_a_bad_time_is_a_422_naming_the_field(client, tenant, pg, body, field):
    answer = post(client, tenant, **body)
    assert answer.status_code == 422
    assert answer.json["error"]["code"] == "validation_failed"
    assert field in answer.json["error"]["details"]["fields"]
    assert pg.execute("SELECT count(*) FROM runs").fetchone()[0] == 0  # nothing admitted


def test_a_replay_compares_an_instant_as_stored_and_a_delay_by_its_presence(client, tenant, pg,
                                                                           queue):
    at = (datetime.now(UTC) + timedelta(minutes=5)).replace(microsecond=0)
    first = post(client, tenant, dispatch_key="at", not_before=at.isoformat())
    assert first.status_code == 201
    # The same instant, written another way: the same run, still not sent.
    same = post(client, tenant, dispatch_key="at",
                not_before=at.astimezone(timezone_plus_two()).isoformat())
    assert same.status_code == 200 and same.json["id"] == first.json["id"]
    other = post(client, tenant, dispatch_key="at",
                 not_before=(at + timedelta(seconds=1)).isoformat())
    assert other.status_code == 409
    assert other.json["error"]["details"]["differs"] == ["not_before"]
    undelayed = post(client, tenant, dispatch_key="at")
    assert undelayed.status_code == 409

    delayed = post(client, tenant, dispatch_key="rel", delay_seconds=60)
    later = post(client, tenant, dispatch_key="rel", delay_seconds=61)  # a retry, later
    assert later.status_code == 200 and later.json["id"] == delayed.json["id"]
    assert post(client, tenant, dispatch_key="rel").status_code == 409
    assert post(client, tenant, dispatch_key="plain").status_code == 201
    assert post(client, tenant, dispatch_key="plain", delay_seconds=5).status_code == 409

    exp = post(client, tenant, dispatch_key="exp", expires_in_seconds=60)
    assert post(client, tenant, dispatch_key="exp", expires_in_seconds=30).status_code == 200
    conflict = post(client, tenant, dispatch_key="exp")
    assert conflict.status_code == 409
    assert conflict.json["error"]["details"]["differs"] == ["expires_at"]
    assert exp.json["expires_at"] is not None
    # A replay re-sends a queued run that is due (its message may be lost), never a
    # delayed one: that is beat's to send.
    sent = set(queue())
    assert first.json["id"] not in sent and delayed.json["id"] not in sent
    assert exp.json["id"] in sent


def timezone_plus_two():
    from datetime import timezone

    return timezone(timedelta(hours=2))


def test_a_batch_and_a_derived_key_delay_like_a_single_request(client, tenant, pg, queue, app):
    """A batch item delays like ``POST /v1/runs``; a Kafka message's derived key (``kafka:``)
    replayed with its relative delay (a DLQ replay, a redelivery) is the same run."""
    from app.admission import admit_run
    from app.extensions import db
    from app.models import AdmissionOrigin

    answer = client.post("/v1/runs/batch", headers=tenant.headers, json={"runs": [
        {"workflow_ref": "echo", "delay_seconds": 30, "dispatch_key": "b1"},
        {"workflow_ref": "echo", "dispatch_key": "b2"},
        {"workflow_ref": "echo", "delay_seconds": -3},
    ]})
    results = answer.json["results"]
    assert [r["status"] for r in results] == [201, 201, 422]
    again = client.post("/v1/runs/batch", headers=tenant.headers, json={"runs": [
        {"workflow_ref": "echo", "delay_seconds": 31, "dispatch_key": "b1"},
        {"workflow_ref": "echo", "delay_seconds": 5, "dispatch_key": "b2"},
    ]}).json["results"]
    assert again[0]["status"] == 200 and again[0]["run"]["id"] == results[0]["run"]["id"]
    assert again[1]["status"] == 409
    assert queue() == [results[1]["run"]["id"]]

    key = "kafka:poimen.t.dispatch:0:17"
    with app.app_context():
        ids = set()
        for _ in range(2):
            admission = admit_run(on_session(db.session), tenant_id=tenant.id,
                                  workflow_ref="echo", input={}, dispatch_key=key,
                                  origin=AdmissionOrigin.HTTP, delay_seconds=10 + len(ids))
            db.session.commit()
            ids.add(admission.run.id)
    assert len(ids) == 1
    assert row(pg, ids.pop())[1] is not None


# -- release: beat sends a delayed run once, when due --------------------------------------------

def test_beat_sends_a_delayed_run_once_when_due_and_never_before(client, tenant, pg, queue, app):
    run_id = post(client, tenant, delay_seconds=60).json["id"]
    assert tick(app) == (0, 0)
    assert queue() == []
    come_due(pg, run_id)
    assert tick(app) == (1, 0)
    assert queue() == [run_id]
    assert tick(app) == (0, 0)  # marked sent: a second tick, or a second beat, sends nothing
    assert queue() == [run_id]
    _, not_before, _, _, last_sent, _, _ = row(pg, run_id)
    assert last_sent >= not_before


def test_an_early_delivery_claims_nothing(session, admit, boot_factory, pg):
    run_id = admit("echo", {}, delay_seconds=60)
    result = claim(session, run_id, boot_factory().boot_id)
    assert result.outcome == ClaimOutcome.NOT_DUE
    assert row(pg, run_id)[0] == "queued" and row(pg, run_id)[6] is None


def test_a_retrys_delayed_message_counts_as_sent_and_beat_leaves_it(session, admit, boot_factory,
                                                                     pg, queue, app):
    run_id, boot = admit("echo", {}), boot_factory()
    assert claim(session, run_id, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    queue()  # the admission's message: gone to the worker
    schedule_retry(on_session(session), run_id, [boot.boot_id], delay=0.05, error={"x": 1})
    session.commit()
    _, not_before, admitted, _, last_sent, _, _ = row(pg, run_id)
    assert admitted is None and last_sent == not_before
    pg.execute("SELECT pg_sleep(0.1)")
    assert tick(app) == (0, 0)  # the worker sent its own delayed message


def test_a_cancelled_delayed_run_is_never_sent(client, tenant, pg, queue, app):
    run_id = post(client, tenant, delay_seconds=60).json["id"]
    assert client.post(f"/v1/runs/{run_id}/cancel", headers=tenant.headers).status_code == 200
    come_due(pg, run_id)
    assert tick(app) == (0, 0)
    assert row(pg, run_id)[0] == "cancelled" and queue() == []


def test_a_delayed_run_takes_no_slot_and_no_place_in_line(session, admit, boot_factory, pg, app,
                                                          queue):
    """A limited group (limit 1) and a capped tenant: an older delayed run neither holds a slot
    nor stands ahead of a newer run in the line; once due, it waits its turn like any run."""
    delayed = admit("keyed", {"customer": "c"}, delay_seconds=60)
    newer = admit("keyed", {"customer": "c"})
    boot = boot_factory()
    assert claim(session, newer, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    come_due(pg, delayed)
    assert tick(app) == (1, 0)
    assert claim(session, delayed, boot.boot_id).outcome == ClaimOutcome.SLOT_WAIT

    tenant_id = pg.execute("SELECT tenant_id FROM runs WHERE id = %s", [newer]).fetchone()[0]
    pg.execute("UPDATE tenants SET max_running = 2 WHERE id = %s", [tenant_id])
    capped_delayed = admit("echo", {}, delay_seconds=60)
    capped_newer = admit("echo", {})
    assert claim(session, capped_newer, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    come_due(pg, capped_delayed)
    assert claim(session, capped_delayed, boot.boot_id).outcome == ClaimOutcome.SLOT_WAIT


# -- expiry ------------------------------------------------------------------------------------

def test_a_delivery_after_expiry_ends_the_run_expired_and_runs_nothing(session, admit,
                                                                        boot_factory, pg):
    run_id = admit("echo", {}, expires_in_seconds=60)
    come_expired(pg, run_id)
    result = claim(session, run_id, boot_factory().boot_id)
    assert result.outcome == ClaimOutcome.EXPIRED
    status, *_, started = row(pg, run_id)
    assert status == "expired" and started is None
    assert events_of(pg, run_id) == ["run.admitted", "run.expired"]


def test_a_limited_runs_delivery_after_expiry_ends_it_expired(session, admit, boot_factory, pg):
    run_id = admit("keyed", {"customer": "c"}, expires_in_seconds=60)
    come_expired(pg, run_id)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.EXPIRED
    assert row(pg, run_id)[0] == "expired"


def test_beat_expires_runs_in_redis_waiting_for_a_slot_and_delayed(session, admit, boot_factory,
                                                                    pg, app, queue):
    in_redis = admit("echo", {}, expires_in_seconds=60)
    holder = admit("keyed", {"customer": "c"})
    waiting = admit("keyed", {"customer": "c"}, expires_in_seconds=60)
    delayed = admit("echo", {}, delay_seconds=120, expires_in_seconds=60)
    boot = boot_factory()
    assert claim(session, holder, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert claim(session, waiting, boot.boot_id).outcome == ClaimOutcome.SLOT_WAIT
    assert tick(app) == (0, 0)
    for run_id in (in_redis, waiting, delayed):
        come_expired(pg, run_id)
    assert tick(app) == (0, 3)
    for run_id in (in_redis, waiting, delayed):
        assert row(pg, run_id)[0] == "expired"
        assert events_of(pg, run_id)[-1] == "run.expired"
    assert pg.execute("SELECT wait_reason FROM runs WHERE id = %s", [waiting]).fetchone()[0] \
        is None
    come_due(pg, delayed)
    assert tick(app) == (0, 0)  # an expired delayed run is never sent
    # The message in Redis is delivered later: it claims nothing.
    assert claim(session, in_redis, boot.boot_id).outcome == ClaimOutcome.FINISHED


def test_a_started_run_never_expires_even_when_taken_over(session, admit, boot_factory,
                                                          dead_boot, pg, app):
    """Expiry is about starting: a run a worker started runs to its end, and a takeover of
    it after its worker died is no new start."""
    run_id = admit("echo", {}, expires_in_seconds=60)
    hold_as(pg, run_id, dead_boot(), started_at=datetime.now(UTC))
    come_expired(pg, run_id)
    assert tick(app) == (0, 0)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.TAKEN_OVER
    # Released back to queued (a retry), it is still a started run: it is claimed again.
    pg.execute("UPDATE runs SET status = 'queued', claimed_by = NULL WHERE id = %s", [run_id])
    assert tick(app) == (0, 0)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.CLAIMED


def test_expiry_racing_a_claim_one_wins(session, admit, boot_factory, pg, app):
    """The claim and the expiry both decide on the row: whichever commits first wins, and
    the other changes nothing (here the claim first, then a tick with the time passed)."""
    run_id = admit("echo", {}, expires_in_seconds=60)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.CLAIMED
    come_expired(pg, run_id)
    assert tick(app) == (0, 0)
    assert row(pg, run_id)[0] == "running"


def test_a_cancel_of_an_expired_run_is_a_finished_run(client, tenant, pg, app):
    run_id = post(client, tenant, expires_in_seconds=60).json["id"]
    come_expired(pg, run_id)
    tick(app)
    answer = client.post(f"/v1/runs/{run_id}/cancel", headers=tenant.headers)
    assert answer.status_code == 200 and answer.json["status"] == "expired"  # left as it is
    assert events_of(pg, run_id)[-1] == "run.expired"
    listed = client.get("/v1/runs?status=expired", headers=tenant.headers)
    assert listed.status_code == 200
    assert [r["id"] for r in listed.json["runs"]] == [run_id]


def test_an_expired_key_is_free_to_reuse_under_after_failure(client, tenant, pg, app):
    """``key_reuse="after_failure"``: an expired run never ran, and its key admits a new run
    (a caller's key; a derived one never is: ``test_derived_keys``)."""
    import tests.workflows.reuse  # noqa: F401 - registers the reuse-* workflows

    body = {"workflow_ref": "reuse-after-failure", "dispatch_key": "k",
            "expires_in_seconds": 60}
    first = client.post("/v1/runs", json=body, headers=tenant.headers).json["id"]
    come_expired(pg, first)
    assert tick(app) == (0, 1)
    second = client.post("/v1/runs", json=body, headers=tenant.headers)
    assert second.status_code == 201 and second.json["id"] != first
    plain = client.post("/v1/runs", json={**body, "workflow_ref": "echo", "dispatch_key": "e"},
                        headers=tenant.headers)
    pg.execute("UPDATE runs SET status = 'expired', finished_at = now() WHERE id = %s",
               [plain.json["id"]])
    # The default policy (never): the expired run keeps its key.
    again = client.post("/v1/runs", json={**body, "workflow_ref": "echo", "dispatch_key": "e"},
                        headers=tenant.headers)
    assert again.status_code == 200 and again.json["id"] == plain.json["id"]


def test_an_expired_child_counts_for_its_parents_join(admit, pg, app, fresh_boot):
    from workers.execution import execute_run

    from .test_step_entry_dispatch import children_of, run_row

    def run_here(run_id) -> str:
        with app.app_context():
            return execute_run(str(run_id)).outcome.value

    parent = admit("doc-review", {"participants": ["ana", "bo"]})
    run_here(parent)
    assert run_row(pg, parent)[0] == "waiting"
    (ana, *_), (bo, *_) = children_of(pg, parent)
    pg.execute("UPDATE runs SET expires_at = now() - interval '1 second' WHERE id = %s", [ana])
    assert run_here(ana) == "expired"
    assert run_row(pg, parent)[0] == "waiting"
    run_here(bo)
    assert run_row(pg, parent)[0] == "queued"  # the expired child counted
    assert events_of(pg, parent).count("run.joined") == 1


# -- what users see: the client, the console ------------------------------------------------------

def test_the_client_admits_with_a_delay_and_an_expiry(live_api, tenant, pg):
    from poimen_client import TERMINAL, Runs

    runs = Runs(live_api, tenant.token, retry_for=5)
    at = (datetime.now(UTC) + timedelta(minutes=10)).replace(microsecond=0)
    delayed = runs.admit("echo", {}, dispatch_key="c1", delay=timedelta(seconds=90),
                         expires=at)
    assert delayed.raw["not_before"] is not None
    assert datetime.fromisoformat(delayed.raw["expires_at"]) == at
    again = runs.admit("echo", {}, dispatch_key="c1", delay=30, expires=at)
    assert again.replayed and again.id == delayed.id
    stored = pg.execute("SELECT admitted_not_before - created_at FROM runs WHERE id = %s",
                        [delayed.id]).fetchone()[0]
    assert stored == timedelta(seconds=90)
    with pytest.raises(ValueError):
        runs.admit("echo", {}, delay=datetime(2030, 1, 1))  # naive: refused before sending
    assert "expired" in TERMINAL


def test_the_console_shows_a_delay_an_expiry_and_the_expired_status(client, tenant, pg, app):
    import re

    from app import create_app

    delayed = post(client, tenant, delay_seconds=60, expires_in_seconds=120).json["id"]
    gone = post(client, tenant, expires_in_seconds=60).json["id"]
    come_expired(pg, gone)
    tick(app)
    console = create_app({"POIMEN_CONSOLE_SECRET": "s" * 40, "TESTING": True}).test_client()
    page = console.get("/console/sign-in").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    console.post("/console/sign-in", data={"csrf_token": csrf, "token": tenant.token})
    detail = console.get(f"/console/runs/{delayed}").get_data(as_text=True)
    assert 'id="not-before"' in detail and "delayed at admission" in detail
    assert 'id="expires-at"' in detail
    listing = console.get("/console/runs?status=expired").get_data(as_text=True)
    assert '<span class="badge status-expired">expired</span>' in listing
    assert f'data-run-id="{gone}"' in listing and f'data-run-id="{delayed}"' not in listing


# -- plans: a tick reads only its own partial index, whatever the backlog ---------------------------

@pytest.mark.parametrize("name, index", [("RELEASE_DUE", "ix_runs_delayed"),
                                         ("NEXT_DUE", "ix_runs_delayed"),
                                         ("EXPIRE_DUE", "ix_runs_expiring")])
def test_a_timer_tick_reads_runs_only_through_its_partial_index(pg, name, index):
    """Beat ticks once a second: under a backlog of queued and finished runs, neither
    statement may scan runs or read another index (the indexes repeat their predicates)."""
    from app.state import runs
    from tests.app.test_slot_plans import _generic_plan, _runs_reads

    with pg.transaction(force_rollback=True):
        pg.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        tenant = pg.execute("INSERT INTO tenants (name) VALUES ('timers') RETURNING id"
                            ).fetchone()[0]
        pg.execute("INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, "
                   "workflow_version, input, status, attempt, failures, cancel_requested, "
                   "origin, created_at, updated_at, started_at, finished_at) "
                   "SELECT gen_random_uuid(), %s, 'noop@1', 'noop', '1', '{}', "
                   "CASE WHEN g %% 3 = 0 THEN 'queued' ELSE 'succeeded' END, 1, 0, false, "
                   "'http', now(), now(), now(), now() FROM generate_series(1, 6000) g",
                   [tenant])
        pg.execute("ANALYZE runs")
        plan = _generic_plan(pg, getattr(runs, name).text)
    reads = _runs_reads(plan)
    assert index in reads and reads <= {index, "runs_pkey"}, plan  # the pkey: the rows found
