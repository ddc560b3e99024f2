"""Poisoned runs: a run whose executions keep killing their workers ends ``poisoned``.

Deterministic rule tests of the takeover statement (real Postgres, real boots, dead boots
killed with SIGKILL; no worker processes: ``test_poison_processes.py`` has those). The
rule: a dead holder's run that has been taken over ``max_takeovers`` times already is not
resumed a ``max_takeovers + 1``-th time; the takeover ends it poisoned, with one
``run.poisoned`` event. A requested cancel wins over the bound.
"""

from __future__ import annotations

import pytest

from app.state.claims import ClaimOutcome, finish_run
from app.state.executor import on_session
from workers.registry import DEFAULT_MAX_TAKEOVERS

from .test_claims import claim, events_of, hold_as
from .test_concurrency import keyed, pending_sends, set_cap, state


@pytest.fixture
def session(app):
    from app.extensions import db

    with app.app_context():
        yield db.session
        db.session.rollback()


def ended(pg, run_id):
    return pg.execute("SELECT status, error, takeovers, attempt, finished_at IS NOT NULL "
                      "FROM runs WHERE id = %s", [run_id]).fetchone()


def test_a_run_whose_holders_keep_dying_resumes_up_to_the_bound_then_is_poisoned(
        session, admit, boot_factory, dead_boot, pg):
    """Each holder dies in turn: takeovers 0 .. N-1 resume (counted), the one at N poisons."""
    run_id = admit()
    hold_as(pg, run_id, dead_boot())
    for takeovers in range(DEFAULT_MAX_TAKEOVERS):
        taken = claim(session, run_id, boot_factory().boot_id)
        assert taken.outcome == ClaimOutcome.TAKEN_OVER, takeovers
        assert ended(pg, run_id)[:4] == ("running", None, takeovers + 1, takeovers + 2)
        # ... and that holder dies too.
        pg.execute("UPDATE runs SET claimed_by = %s WHERE id = %s", [dead_boot(), run_id])

    last = claim(session, run_id, boot_factory().boot_id)
    assert (last.outcome, last.ended.status) == (ClaimOutcome.FINISHED, "poisoned")
    status, error, takeovers, attempt, finished = ended(pg, run_id)
    assert (status, takeovers, attempt, finished) == (
        "poisoned", DEFAULT_MAX_TAKEOVERS, DEFAULT_MAX_TAKEOVERS + 1, True)
    assert error["code"] == "poisoned" and error["type"] == "poimen.Poisoned"
    assert error["message"] == (f"the run killed {DEFAULT_MAX_TAKEOVERS + 1} workers "
                                f"(max_takeovers {DEFAULT_MAX_TAKEOVERS}): poisoned, it is not "
                                "resumed again")
    assert events_of(pg, run_id) == (["run.admitted"] + ["run.resumed"] * DEFAULT_MAX_TAKEOVERS
                                     + ["run.poisoned"])
    [(payload,)] = pg.execute("SELECT payload FROM outbox WHERE run_id = %s AND "
                              "event_type = 'run.poisoned'", [run_id]).fetchall()
    assert payload["error"]["code"] == "poisoned" and payload["attempt"] == attempt

    # Ended: a late delivery finds it finished and writes nothing more.
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    assert events_of(pg, run_id).count("run.poisoned") == 1


def test_the_claim_at_one_below_the_bound_resumes(session, admit, boot_factory, dead_boot, pg):
    run_id = admit()
    hold_as(pg, run_id, dead_boot(), takeovers=DEFAULT_MAX_TAKEOVERS - 1)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.TAKEN_OVER
    assert ended(pg, run_id)[:3] == ("running", None, DEFAULT_MAX_TAKEOVERS)


def test_a_workflows_own_max_takeovers_is_its_poison_bound(session, admit, boot_factory,
                                                           dead_boot, pg):
    """``poison`` declares max_takeovers=2: its third lost worker poisons it."""
    import tests.workflows  # noqa: F401 - registers ``poison``

    run_id = admit("poison")
    hold_as(pg, run_id, dead_boot(), takeovers=1)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.TAKEN_OVER
    pg.execute("UPDATE runs SET claimed_by = %s WHERE id = %s", [dead_boot(), run_id])
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    status, error, *_ = ended(pg, run_id)
    assert status == "poisoned" and "killed 3 workers (max_takeovers 2)" in error["message"]


def test_poimen_max_takeovers_is_the_bound_where_the_workflow_sets_none(
        session, admit, boot_factory, dead_boot, pg, monkeypatch):
    """``POIMEN_MAX_TAKEOVERS=1``: a workflow declared without ``max_takeovers`` (and a
    version the process does not have) outlives one lost worker; the second poisons it. A
    workflow's own ``max_takeovers`` wins over the setting."""
    import uuid

    from workers import registry

    monkeypatch.setenv("POIMEN_MAX_TAKEOVERS", "1")
    name = f"fragile-{uuid.uuid4().hex[:8]}"
    registry.workflow(name)(lambda: {})
    registry.workflow(f"{name}-own", max_takeovers=3)(lambda: {})
    assert registry.get(name, "1").max_takeovers == 1
    assert registry.get(f"{name}-own", "1").max_takeovers == 3
    assert registry.max_takeovers_of("not-here", "9") == 1

    run_id = admit(name)
    hold_as(pg, run_id, dead_boot())
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.TAKEN_OVER
    pg.execute("UPDATE runs SET claimed_by = %s WHERE id = %s", [dead_boot(), run_id])
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    status, error, *_ = ended(pg, run_id)
    assert status == "poisoned" and "killed 2 workers (max_takeovers 1)" in error["message"]


@pytest.mark.parametrize("raw", ["-1", "five", "2.5"])
def test_a_bad_poimen_max_takeovers_is_refused_with_its_name(raw):
    from poimenconfig import max_takeovers_setting

    with pytest.raises(ValueError, match="POIMEN_MAX_TAKEOVERS"):
        max_takeovers_setting({"POIMEN_MAX_TAKEOVERS": raw})
    assert max_takeovers_setting({}) == DEFAULT_MAX_TAKEOVERS


def test_a_cancel_requested_wins_over_the_poison_bound(session, admit, boot_factory, dead_boot,
                                                       pg):
    """A run at the bound whose cancel was requested ends cancelled: the caller asked for
    that end, and it is the one said (no error, no run.poisoned)."""
    run_id = admit()
    hold_as(pg, run_id, dead_boot(), takeovers=DEFAULT_MAX_TAKEOVERS, cancel_requested=True)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    status, error, takeovers, *_ = ended(pg, run_id)
    assert (status, error, takeovers) == ("cancelled", None, DEFAULT_MAX_TAKEOVERS)
    assert events_of(pg, run_id) == ["run.admitted", "run.cancelled"]


def test_poisoning_a_run_of_a_concurrency_key_frees_its_slot_and_wakes_the_next(
        session, admit, boot_factory, dead_boot, pg):
    first, second = keyed(admit), keyed(admit)
    boot = boot_factory()
    assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.SLOT_WAIT
    # The holder of the slot died, as often as the run may outlive.
    pg.execute("UPDATE runs SET claimed_by = %s, takeovers = %s WHERE id = %s",
               [dead_boot(), DEFAULT_MAX_TAKEOVERS, first])
    from app.state.claims import claim_run
    from workers.registry import max_takeovers_of

    poisoned = claim_run(on_session(session), first, boot.boot_id, max_takeovers=max_takeovers_of)
    assert poisoned.outcome == ClaimOutcome.FINISHED
    assert pending_sends(session) == {second}  # sent once the takeover commits
    session.commit()
    assert state(pg, first)[:2] == ("poisoned", None)
    assert state(pg, second) == ("queued", None, None, 0)
    assert events_of(pg, second) == ["run.admitted", "run.waiting", "run.woken"]
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.CLAIMED


def test_poisoning_a_run_under_a_tenant_cap_frees_its_slot_and_wakes_the_next(
        app, session, admit, tenant, boot_factory, dead_boot, pg):
    set_cap(app, tenant.name, 1)
    first, second = admit("echo"), admit("echo")
    boot = boot_factory()
    assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    waited = claim(session, second, boot.boot_id)
    assert (waited.outcome, waited.wait_reason) == (ClaimOutcome.SLOT_WAIT, "tenant_cap")
    pg.execute("UPDATE runs SET claimed_by = %s, takeovers = %s WHERE id = %s",
               [dead_boot(), DEFAULT_MAX_TAKEOVERS, first])
    assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.FINISHED
    assert state(pg, first)[0] == "poisoned"
    assert state(pg, second)[:2] == ("queued", None)
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert finish_run(on_session(session), second, boot.boot_id, status="succeeded")
    session.commit()


def test_a_poisoned_takeover_is_a_failure_of_its_celery_task_and_counted(
        app, admit, dead_boot, pg, fresh_boot):
    """Delivered as the worker's task does (in this process): RunFailed naming the code, and
    poimen_runs_poisoned_total{tenant, workflow} counts the run once."""
    from app.metrics import RUNS_POISONED
    from workers import tasks
    from workers.celery_native import RunFailed, report
    from workers.execution import execute_run

    tenant_name = pg.execute("SELECT t.name FROM tenants t JOIN runs r ON r.tenant_id = t.id "
                             "WHERE r.id = %s", [run_id := admit("echo")]).fetchone()[0]
    # Tenant names are cached by id; other tests' databases reuse ids for other names.
    from app.logs import _tenant_name

    _tenant_name.cache_clear()
    counted = RUNS_POISONED.labels(tenant_name, "echo")
    before = counted._value.get()
    hold_as(pg, run_id, dead_boot(), takeovers=DEFAULT_MAX_TAKEOVERS)

    with app.app_context():
        execution = execute_run(str(run_id))
        assert execution.claim.outcome == ClaimOutcome.FINISHED
        with pytest.raises(RunFailed, match="poisoned"):
            report(tasks.execute, execution)
        assert counted._value.get() == before + 1
        # A second delivery of the ended run counts nothing more.
        execute_run(str(run_id))
    assert counted._value.get() == before + 1


def test_the_api_the_console_and_the_client_show_a_poisoned_run(
        database_url, tenant, admit, boot_factory, dead_boot, session, pg):
    """GET /v1/runs/<id> and ?status=poisoned, the console's status count, filter and badge,
    and the python client's idea of an ended run."""
    import re

    from poimen_client import TERMINAL

    from app import create_app

    run_id, other = admit(), admit()
    hold_as(pg, run_id, dead_boot(), takeovers=DEFAULT_MAX_TAKEOVERS)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    client = create_app({"POIMEN_CONSOLE_SECRET": "s" * 40, "TESTING": True}).test_client()
    headers = tenant.headers

    body = client.get(f"/v1/runs/{run_id}", headers=headers).json
    assert body["status"] == "poisoned" and body["error"]["code"] == "poisoned"
    listed = client.get("/v1/runs?status=poisoned", headers=headers).json["runs"]
    assert [r["id"] for r in listed] == [str(run_id)]
    assert "poisoned" in TERMINAL

    page = client.get("/console/sign-in").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    client.post("/console/sign-in", data={"csrf_token": csrf, "token": tenant.token})
    runs = client.get("/console/runs?status=poisoned").get_data(as_text=True)
    assert re.search(r'data-status="poisoned"[^>]*>poisoned <span>1</span>', runs)
    assert f'data-run-id="{run_id}"' in runs and f'data-run-id="{other}"' not in runs
    assert '<span class="badge status-poisoned">poisoned</span>' in runs
    detail = client.get(f"/console/runs/{run_id}").get_data(as_text=True)
    assert 'id="run-status">poisoned<' in detail and "killed 6 workers" in detail
