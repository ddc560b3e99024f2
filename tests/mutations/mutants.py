"""The catalogue: one entry per core rule, broken on purpose in the smallest way.

Each mutant is an exact edit (``find`` must occur exactly ``occurrences`` times;
the ``nth`` one, 1-based, is replaced, or with ``nth=0`` every one) and the pytest
selection that must fail on it. A ``find`` that no longer matches is a stale mutant
and fails the gate: when a rule's code moves, its mutant moves with it. A new core
rule lands with its mutant here.

Most rules of the run-state store live in its SQL (``app/state/sql/*.sql``), where a
variant is a statement of its own: a rule several variants share is written in each,
so its mutant breaks every one (``nth=0``, or a tuple of the ones that hold it), and
``also`` holds further edits where the variants differ in words (a slot function names
its parameters ``p_run`` where a statement has ``:run``) or the rule is written in
several files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    """One more find/replace of a mutant: every one of ``occurrences`` replaced, in ``path``
    (None: the mutant's own)."""

    find: str
    replace: str
    occurrences: int = 1
    path: str | None = None


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str
    path: str
    find: str
    replace: str
    tests: tuple[str, ...]
    # Which occurrence(s) to replace, 1-based: one, several (a tuple), or 0 for every one.
    nth: int | tuple[int, ...] = 1
    occurrences: int = 1
    ci: bool = True  # part of the subset .ci/run runs
    # Further edits, applied in order after the first: each replaces every occurrence.
    also: tuple[Edit, ...] = ()

    def edits(self) -> list[tuple[str, str, str, int, tuple[int, ...]]]:
        """Every edit: (path, find, replace, occurrences, the occurrences to replace)."""
        first = (self.nth,) if isinstance(self.nth, int) else self.nth
        every = tuple(range(1, self.occurrences + 1))
        return [(self.path, self.find, self.replace, self.occurrences,
                 every if first == (0,) else first)] + [
            (edit.path or self.path, edit.find, edit.replace, edit.occurrences,
             tuple(range(1, edit.occurrences + 1))) for edit in self.also]


# The store's SQL (app/state/sql/): a rule shared by several statements is written in
# each, and these parts are written out word for word wherever they are used.
CLAIMS_SQL = "app/state/sql/claims.sql"
RUNS_SQL = "app/state/sql/runs.sql"
LEDGER_SQL = "app/state/sql/ledger.sql"
# The claiming boot holds its lock (app/liveness.py, claimer_live_sql(":boot")).
_CLAIMER_LIVE = ("EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = :boot AND NOT "
                 "pg_try_advisory_xact_lock_shared(1347373389, b.lock_key))")
# The claiming boot holds its lock, in a function (claimer_live_sql("p_boot")).
_CLAIMER_LIVE_FN = _CLAIMER_LIVE.replace(":boot", "p_boot")
# The holder a takeover replaces is gone (app/liveness.py, gone_sql("p_dead")).
_HOLDER_GONE = ("EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = p_dead AND "
                "g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds))")
# A run holds its slot while its boot is not gone (held_by_sql("r.claimed_by")); broken:
# only while its boot's lock is held.
_HELD = ("NOT EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = r.claimed_by AND "
         "g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds))")
_HELD_BY_LOCK = ("r.claimed_by IN (SELECT b.boot_id FROM worker_boots b "
                 "WHERE NOT pg_try_advisory_xact_lock_shared(1347374925, b.lock_key))")
# A claim's locks, taken before its statement (sql/README.md, "Store functions").
_SLOT_LOCKS = "    PERFORM poimen_lock_slots(p_run);\n"
CLAIM_TESTS = "tests/workers/test_claims.py"
POISON_TESTS = "tests/workers/test_poison.py"
DELAYED_TESTS = "tests/workers/test_delayed_runs.py"
CASCADE_TESTS = "tests/workers/test_cascade_cancel.py"
RATE_TESTS = "tests/workers/test_rate_limits.py"
BATCH_TESTS = "tests/workers/test_batching.py"
BROKER_TESTS = "tests/workers/test_broker.py"
EARLY_LOSS_TESTS = "tests/workers/test_early_lock_loss.py"
# The cross-feature model test: each rule it checks, driven across every family.
MODEL_TEST = "tests/test_cross_feature_model.py::test_every_rule_holds_across_features[core]"

MUTANTS: list[Mutant] = [
    # -- admission ----------------------------------------------------------------------------
    Mutant(
        "admission_without_unique_index",
        "a dispatch_key is unique per tenant: the partial unique index decides",
        "migrations/versions/0001_initial_schema.py",
        "batch_op.create_index('uq_runs_tenant_dispatch_key', ['tenant_id', 'dispatch_key'], "
        "unique=True,",
        "batch_op.create_index('uq_runs_tenant_dispatch_key', ['tenant_id', 'dispatch_key'], "
        "unique=False,",
        ("tests/app/test_idempotent_admission.py::"
         "test_first_spawn_creates_and_replay_returns_the_same_run",),
    ),
    Mutant(
        "fast_path_dispatches_a_refusal_again",
        "an admission answered in front of Flask runs once: a refusal is answered, "
        "never handed to Flask to run again",
        "app/fastpath.py",
        "        headers = [(\"Content-Type\", JSON), (\"Content-Length\", str(len(answer.body))),\n",
        "        if answer.run_id is None:\n"
        "            return self.flask_wsgi(environ, start_response)\n"
        "        headers = [(\"Content-Type\", JSON), (\"Content-Length\", str(len(answer.body))),\n",
        ("tests/app/test_fast_admission.py::"
         "test_a_conflict_is_answered_once_and_admits_nothing",),
    ),
    Mutant(
        "admission_check_then_insert",
        "the index decides a key: admission never reads before it inserts",
        RUNS_SQL,
        "VALUES (:id, :tenant_id,",
        "SELECT :id, :tenant_id,",
        ("tests/app/test_idempotent_admission.py::"
         "test_the_index_decides_a_key_held_by_an_uncommitted_admission",),
        also=(Edit("(SELECT cancelled FROM parent), false))\n"
                   "ON CONFLICT (tenant_id, dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING",
                   "(SELECT cancelled FROM parent), false)\n"
                   " WHERE NOT EXISTS (SELECT 1 FROM runs WHERE tenant_id = :tenant_id\n"
                   "                      AND dispatch_key = CAST(:dispatch_key AS varchar))"),),
    ),
    Mutant(
        "derived_key_released_by_key_reuse",
        "a key Poimen derives (schedule tick, kafka:, fan-out child) names one run forever: "
        "key_reuse applies to caller keys only",
        "app/admission.py",
        "    return origin in _DERIVING_ORIGINS or dispatch_key.startswith(DERIVED_KEY_PREFIXES)\n",
        "    return False\n",
        ("tests/app/test_derived_keys.py::test_a_derived_key_is_never_released",),
    ),
    Mutant(
        "admission_gives_up_when_the_key_changes_hands",
        "an admission ends on a run even when another request released the key between its "
        "statements: it goes round and the index decides again",
        "app/admission.py",
        "        if replay is not None:\n            return replay\n",
        "        assert replay is not None, 'ON CONFLICT found a row that is not there'\n"
        "        return replay\n",
        ("tests/app/test_derived_keys.py::"
         "test_a_key_released_between_the_insert_and_the_read_ends_on_a_run",),
    ),
    Mutant(
        "admission_in_a_transaction",
        "an admission is one round trip: its one statement runs in autocommit (issue 10)",
        "app/api.py",
        "                           single_statements(db.session, send_pending),\n",
        "                           db.session,\n",
        ("tests/app/test_hot_path.py::test_an_admission_is_one_statement_in_autocommit",),
    ),
    Mutant(
        "ping_blind_to_a_cut_socket",
        "a pooled connection the server cut is replaced before use, without a ping per checkout",
        "app/extensions.py",
        " and not _server_spoke(dbapi_connection)",
        "",
        ("tests/app/test_hot_path.py::"
         "test_a_connection_cut_server_side_a_moment_ago_is_replaced_before_the_request_uses_it",),
    ),
    Mutant(
        "replay_input_compared_loosely",
        "a replay is the same request as stored (jsonb equality, decided by Postgres)",
        RUNS_SQL,
        "input = CAST(:input AS jsonb) AS same_input",
        "input::text::numeric IS NULL OR true AS same_input",
        ("tests/app/test_hostile_input.py::test_true_and_1_under_one_key_are_a_conflict",),
    ),
    Mutant(
        "batch_check_then_insert",
        "a batch's keys are decided by the index too: it never reads which keys exist, "
        "then inserts the missing ones",
        RUNS_SQL,
        " ORDER BY r.dispatch_key, r.ord\n"
        "ON CONFLICT (tenant_id, dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING",
        " WHERE NOT EXISTS (SELECT 1 FROM runs x WHERE x.tenant_id = :tenant_id\n"
        "                      AND x.dispatch_key = r.dispatch_key)\n"
        " ORDER BY r.dispatch_key, r.ord",
        ("tests/app/test_batch_admission.py::"
         "test_the_index_decides_a_key_held_by_an_uncommitted_batch",),
    ),
    Mutant(
        "batch_insert_in_request_order",
        "a batch inserts its rows in key order, so two batches sharing keys cannot deadlock",
        RUNS_SQL,
        " ORDER BY r.dispatch_key, r.ord\n",
        " ORDER BY r.ord\n",
        ("tests/app/test_batch_admission.py::"
         "test_batches_with_overlapping_keys_in_reverse_order_do_not_deadlock",),
    ),
    # -- claims -------------------------------------------------------------------------------
    Mutant(
        "claim_without_claimer_liveness",
        "a boot without its lock claims nothing (liveness is part of the claim statement)",
        CLAIMS_SQL,
        "   AND (expires_at IS NULL OR expires_at > now() OR started_at IS NOT NULL)\n   AND "
        + _CLAIMER_LIVE + "\n",
        "   AND (expires_at IS NULL OR expires_at > now() OR started_at IS NOT NULL)\n",
        (f"{CLAIM_TESTS}::test_a_boot_cut_off_server_side_claims_nothing",),
    ),
    Mutant(
        "liveness_counts_shared_holders",
        "only the boot's own exclusive lock makes it live, never a claimer's shared check",
        # The view poimen_live_boots, which the statements and app/liveness.py read.
        "app/state/sql/boots.sql",
        "   AND l.mode = 'ExclusiveLock'\n",
        "",
        (f"{CLAIM_TESTS}::test_a_claimers_check_of_a_dead_boot_never_makes_it_look_live",),
    ),
    Mutant(
        "takeover_without_claimer_liveness",
        "a boot without its lock takes nothing over",
        CLAIMS_SQL,
        "claimed_by = p_dead AND " + _CLAIMER_LIVE_FN,  # poimen_take_over
        "claimed_by = p_dead",
        (f"{CLAIM_TESTS}::test_a_cut_off_boot_cannot_take_over_wreckage",
         f"{CLAIM_TESTS}::test_the_takeover_statement_itself_requires_the_claimers_lock"),
    ),
    Mutant(
        "takeover_at_early_lock_loss",
        "a run is taken over only once its holder is gone: its lock first seen free T_c + "
        "kill + margin ago (a lock lost early leaves the body running until the fence)",
        CLAIMS_SQL,
        "AND " + _HOLDER_GONE,
        "AND true",
        (f"{CLAIM_TESTS}::test_a_boot_whose_lock_connection_closed_is_gone_only_after_its_bound",
         f"{EARLY_LOSS_TESTS}::test_a_boot_lost_less_than_its_bound_ago_keeps_its_slot_and_its_run",
         f"{EARLY_LOSS_TESTS}::test_a_lock_cut_then_runs_redrive_never_runs_two_bodies_at_once"),
    ),
    Mutant(
        "slot_freed_at_early_lock_loss",
        "a run's slot stays held until its holder is gone, not only until its lock goes",
        CLAIMS_SQL,
        _HELD,
        _HELD_BY_LOCK,
        (f"{EARLY_LOSS_TESTS}::test_a_boot_lost_less_than_its_bound_ago_keeps_its_slot_and_its_run",
         f"{EARLY_LOSS_TESTS}::"
         "test_a_lock_cut_then_a_second_run_of_the_key_never_runs_two_bodies_at_once"),
        occurrences=4, nth=0,  # poimen_claim_slot, poimen_slot_verdict: tenant's and group's
        also=(Edit(_HELD, _HELD_BY_LOCK, 2, RUNS_SQL),),  # wake_waiting, poimen_cap_wakes
    ),
    Mutant(
        "repair_resend_before_gone",
        "repair re-sends a lost boot's run to be delivered when the boot is gone, not before",
        RUNS_SQL,
        "FROM (SELECT r.id, GREATEST(0, CAST(extract(epoch FROM g.first_seen_dead_at "
        "+ make_interval(secs => g.dead_after_seconds) - now()) AS float8)) AS gone_in",
        "FROM (SELECT r.id, 0 AS gone_in",
        (f"{EARLY_LOSS_TESTS}::test_a_boot_lost_less_than_its_bound_ago_keeps_its_slot_and_its_run",),
    ),
    Mutant(
        "repair_resend_only_after_gone_without_stamping",
        "repair stamps every boot whose lock is free, so a boot nobody delivers to is gone "
        "within a tick of its bound",
        "app/state/runs.py",
        "    mark_dead_boots(session)\n",
        "",
        (f"{EARLY_LOSS_TESTS}::"
         "test_a_process_adopts_its_limited_run_into_the_slot_its_lost_boot_still_holds",
         "tests/workers/test_concurrency_processes.py::"
         "test_kill_9_of_a_slots_holder_lets_the_next_run_of_its_key_start_within_the_bound"),
    ),
    Mutant(
        "revoke_ends_before_gone",
        "a revoke ends a dead holder's run (and hands its slot on) only once the holder is gone",
        RUNS_SQL,
        "AND EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = runs.claimed_by "
        "AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds))",
        "AND true",
        (f"{EARLY_LOSS_TESTS}::test_a_revoke_ends_a_lost_boots_run_only_once_the_boot_is_gone",),
    ),
    Mutant(
        "adoption_counts_its_own_slot",
        "a process adopting its run after an early lock loss keeps that run's slot: the slot "
        "its lost boot still holds is not counted against it",
        CLAIMS_SQL,
        " AND r.id <> me.id",
        "",
        (f"{EARLY_LOSS_TESTS}::"
         "test_a_process_adopts_its_limited_run_into_the_slot_its_lost_boot_still_holds",),
        occurrences=2, nth=0,  # poimen_slot_verdict: its tenant and group counts
    ),
    Mutant(
        "claim_check_then_update",
        "a claim is one conditional UPDATE, not a read then a write",
        CLAIMS_SQL,
        "WHERE id = :run AND (runs.status || '') = 'queued' AND NOT cancel_requested",
        "WHERE id = :run AND (SELECT r2.status FROM runs r2 WHERE r2.id = :run) = 'queued' "
        "AND NOT cancel_requested",
        (f"{CLAIM_TESTS}::test_a_claim_waiting_on_an_uncommitted_claim_does_not_claim_again",),
    ),
    Mutant(
        "takeover_without_compare_and_set",
        "wreckage is taken over with a compare-and-set on the dead boot id",
        CLAIMS_SQL,
        "= 'running' AND claimed_by = p_dead AND EXISTS",  # poimen_take_over
        "= 'running' AND EXISTS",
        (f"{CLAIM_TESTS}::test_two_rescuers_of_one_dead_boots_run_take_it_over_once",),
    ),
    Mutant(
        "adoption_without_compare_and_set",
        "a process that lost its boot keeps a run only if nobody took it over",
        CLAIMS_SQL,
        "= 'running' AND claimed_by = :dead AND EXISTS",  # adopt
        "= 'running' AND EXISTS",
        (f"{CLAIM_TESTS}::test_adoption_after_a_takeover_is_refused",),
    ),
    Mutant(
        "finish_unfenced",
        "finishing is fenced by the claim",
        CLAIMS_SQL,
        "= 'running' AND claimed_by = ANY(p_boots)",
        "= 'running'",
        (f"{CLAIM_TESTS}::test_every_fenced_write_of_a_boot_that_lost_its_claim_is_refused",),
        occurrences=3, nth=1,  # poimen_finish
    ),
    Mutant(
        "release_unfenced",
        "releasing is fenced by the claim",
        CLAIMS_SQL,
        "= 'running' AND claimed_by = ANY(p_boots)",
        "= 'running'",
        (f"{CLAIM_TESTS}::test_every_fenced_write_of_a_boot_that_lost_its_claim_is_refused",),
        occurrences=3, nth=2,  # poimen_release
    ),
    Mutant(
        "retry_unfenced",
        "scheduling a retry is fenced by the claim",
        CLAIMS_SQL,
        "= 'running' AND claimed_by = ANY(p_boots)",
        "= 'running'",
        (f"{CLAIM_TESTS}::test_every_fenced_write_of_a_boot_that_lost_its_claim_is_refused",),
        occurrences=3, nth=3,  # poimen_retry
    ),
    Mutant(
        "takeover_ignores_cancel",
        "a cancelled run whose worker died ends cancelled, never resumed",
        CLAIMS_SQL,
        "SET status = CASE WHEN cancel_requested THEN 'cancelled'",
        "SET status = CASE WHEN false THEN 'cancelled'",
        (f"{CLAIM_TESTS}::test_taking_over_a_cancelled_run_ends_it_cancelled",),
    ),
    Mutant(
        "takeovers_unbounded",
        "a run that keeps killing workers ends poisoned after max_takeovers",
        CLAIMS_SQL,
        "WHEN takeovers >= p_max_takeovers THEN 'poisoned'",
        "",
        (f"{CLAIM_TESTS}::test_a_run_that_outlived_max_takeovers_workers_ends_poisoned",),
    ),
    Mutant(
        "poison_bound_off_by_one",
        "the takeover at max_takeovers - 1 resumes the run; the one at max_takeovers poisons it",
        CLAIMS_SQL,
        "WHEN takeovers >= p_max_takeovers THEN 'poisoned'",
        "WHEN takeovers >= p_max_takeovers - 1 THEN 'poisoned'",
        (f"{POISON_TESTS}::test_the_claim_at_one_below_the_bound_resumes",),
    ),
    Mutant(
        "poisoned_ends_failed",
        "a poisoned run ends with its own status and event, not as failed",
        CLAIMS_SQL,
        "WHEN takeovers >= p_max_takeovers THEN 'poisoned'",
        "WHEN takeovers >= p_max_takeovers THEN 'failed'",
        (f"{POISON_TESTS}::"
         "test_a_run_whose_holders_keep_dying_resumes_up_to_the_bound_then_is_poisoned",),
    ),
    Mutant(
        "poison_beats_cancel",
        "a cancel requested wins over the poison bound",
        CLAIMS_SQL,
        "SET status = CASE WHEN cancel_requested THEN 'cancelled'\n"
        "                         WHEN takeovers >= p_max_takeovers THEN 'poisoned'",
        "SET status = CASE WHEN takeovers >= p_max_takeovers THEN 'poisoned'\n"
        "                         WHEN cancel_requested THEN 'cancelled'",
        (f"{POISON_TESTS}::test_a_cancel_requested_wins_over_the_poison_bound",),
    ),
    # -- boots --------------------------------------------------------------------------------
    Mutant(
        "boot_always_usable",
        "a boot that lost its lock is not used again",
        "workers/boots.py",
        "return (self.pid == os.getpid() and not self.lost.is_set() and not self.conn.closed\n"
        "                and not self.conn.broken and self.fresh())",
        "return True",
        (f"{CLAIM_TESTS}::test_the_watchdog_notices_a_lock_cut_server_side_and_a_new_boot_claims",),
    ),
    Mutant(
        "watchdog_trusts_the_client",
        "the watchdog asks Postgres, not psycopg, whether the lock is held",
        "workers/boots.py",
        "        if boot.probe():\n",
        "        if not boot.conn.closed and not boot.conn.broken:\n",
        (f"{CLAIM_TESTS}::test_the_watchdog_notices_a_lock_cut_server_side_and_a_new_boot_claims",),
    ),
    Mutant(
        "concurrency_check_then_claim",
        "a limited group's claim counts its slots in the claim statement, after the group's "
        "lock: never a count its snapshot took before another claim committed",
        CLAIMS_SQL,
        _SLOT_LOCKS,
        "",
        ("tests/workers/test_concurrency.py::test_racing_claims_cannot_both_take_the_last_slot",),
    ),
    Mutant(
        "slot_count_before_lock",
        "a limited group's claim counts on a snapshot taken after the group's lock (a count "
        "from before the lock misses a takeover committed while it waited)",
        CLAIMS_SQL,
        _SLOT_LOCKS,
        "",
        ("tests/workers/test_concurrency.py::"
         "test_a_claim_racing_a_takeover_counts_after_the_lock",),
        # ... and take them after the statement.
        also=(Edit("SELECT * FROM changed;\nEND\n$body$",
                   "SELECT * FROM changed;\n" + _SLOT_LOCKS + "END\n$body$"),),
    ),
    Mutant(
        "slot_count_by_plain_status",
        "a limited group's counts read only the slot indexes: with a plain status, a plan "
        "made on quiet statistics reads every queued run of every tenant per claim",
        CLAIMS_SQL,
        "('' || r.status) = 'queued' AND NOT r.cancel_requested",
        "r.status = 'queued' AND NOT r.cancel_requested",
        ("tests/app/test_slot_plans.py::"
         "test_a_slot_statement_reads_runs_only_by_key_and_through_the_slot_indexes",),
        # poimen_claim_slot's counts; wake_waiting's group count, poimen_cap_wakes' (the
        # tenant's, which wake_waiting and wake_tenant read):
        occurrences=2, nth=0,
        also=(Edit("('' || r.status) = 'queued' AND NOT r.cancel_requested",
                   "r.status = 'queued' AND NOT r.cancel_requested", 2, RUNS_SQL),),
    ),
    Mutant(
        "lookup_by_id_through_slot_index",
        "a statement about one run finds it by primary key only: with the slot indexes' "
        "status expression, a lookup by id may scan a whole slot index",
        CLAIMS_SQL,
        "(runs.status || '')",
        "('' || runs.status)",
        ("tests/app/test_slot_plans.py::"
         "test_a_lookup_by_id_has_no_index_but_the_primary_key",),
        occurrences=9, nth=0,
        # Every lookup of a run by id, in every file.
        also=(Edit("(r.status || '')", "('' || r.status)", 2),
              Edit("(runs.status || '')", "('' || runs.status)", 3, RUNS_SQL),
              Edit("(w.status || '')", "('' || w.status)", 1, RUNS_SQL)),
    ),
    Mutant(
        "lock_slots_skips_the_group",
        "a limited run's statements run under its group's lock: poimen_lock_slots takes it "
        "whenever the run's workflow declares a limit",
        RUNS_SQL,
        "    IF v_limited THEN\n",
        "    IF false THEN\n",
        ("tests/workers/test_concurrency.py::"
         "test_an_end_racing_a_claim_that_parks_still_wakes_it",
         "tests/workers/test_concurrency.py::"
         "test_a_claim_racing_a_takeover_counts_after_the_lock"),
    ),
    Mutant(
        "slot_end_without_lock",
        "the end of a slot's holder wakes the next run under the group's lock: it sees a run "
        "that went waiting a moment before (no lost wake-up)",
        CLAIMS_SQL,
        # poimen_finish: no locks, yet it hands the slot on.
        "    v_locks := poimen_lock_slots(p_run);\n    UPDATE runs\n",
        "    v_locks := 1;\n    UPDATE runs\n",
        ("tests/workers/test_concurrency.py::"
         "test_an_end_racing_a_claim_that_parks_still_wakes_it",),
    ),
    Mutant(
        "cap_lift_wakes_none",
        "a tenant cap lifted frees every slot it held back: every run waiting for it is woken "
        "(by the cap change, and by repair if one is left), never left waiting for good",
        RUNS_SQL,
        "WHEN t.max_running IS NULL THEN true",
        "WHEN t.max_running IS NULL THEN false",
        ("tests/workers/test_concurrency.py::test_lifting_a_cap_wakes_every_run_waiting_for_it",
         "tests/workers/test_concurrency.py::"
         "test_repair_wakes_runs_left_waiting_for_a_cap_that_is_gone"),
        # poimen_cap_wakes, which wake_waiting and wake_tenant read
    ),
    Mutant(
        "cap_raise_wakes_one",
        "a tenant cap raised wakes as many runs waiting for it as it freed, at once (not one "
        "per repair tick)",
        RUNS_SQL,
        "ELSE w.tenant_place <= t.max_running",
        "ELSE w.tenant_place <= 1",
        ("tests/workers/test_concurrency.py::"
         "test_raising_a_cap_wakes_as_many_runs_as_it_freed_oldest_first",
         "tests/workers/test_concurrency.py::test_repair_wakes_as_many_as_a_raised_cap_frees"),
        # poimen_cap_wakes, which wake_waiting and wake_tenant read
    ),
    Mutant(
        "wake_counts_newer_queued_runs",
        "a wake-up counts only the queued runs older than a waiter as taking a slot first (a "
        "newer one stands behind it in the claim): a backlog does not swallow a raised cap",
        RUNS_SQL,
        " AND (r.created_at, r.id) < (w.created_at, w.id)",
        "",
        ("tests/workers/test_concurrency.py::"
         "test_raising_a_cap_wakes_as_many_runs_as_it_freed_oldest_first",),
        occurrences=2, nth=0,  # wake_waiting's group count, poimen_cap_wakes' tenant count
    ),
    Mutant(
        "wake_line_without_cap_waiters",
        "a limited group's line, for a wake-up, holds its runs waiting for the tenant's cap "
        "too (the claim counts them ahead): a newer run is not woken to park again behind one",
        RUNS_SQL,
        ", w.concurrency_limit IS NULL\n",
        ", w.wait_reason\n",
        ("tests/workers/test_concurrency.py::"
         "test_a_run_left_waiting_for_a_gone_cap_does_not_block_its_group",),
        # wake_waiting: wake_tenant wakes only runs waiting for the tenant's cap.
    ),
    Mutant(
        "cap_change_without_lock",
        "a cap change wakes its tenant's waiting runs under the tenant's slot lock: a claim "
        "parking a run under the old cap commits before the wake-up's snapshot (no run left "
        "waiting for a cap that is gone)",
        "app/state/runs.py",
        "    session.execute(LOCK_TENANT, {\"tenant\": tenant_id})\n",
        "",
        ("tests/workers/test_concurrency.py::"
         "test_a_cap_lift_racing_a_claim_that_parks_still_wakes_it",),
    ),
    Mutant(
        "claim_in_a_transaction",
        "a claim is one round trip: its one statement runs in autocommit (issue 10)",
        "workers/execution.py",
        "            store = single_statements(session, send_pending)\n",
        "            store = session\n",
        (f"{CLAIM_TESTS}::test_a_claim_is_one_statement_in_autocommit",),
    ),
    Mutant(
        "single_statement_commit_sends_nothing",
        "a run a single statement left to send reaches the sender when it committed "
        "(app/state/direct.py: a join's woken parent, an admission)",
        "app/state/direct.py",
        "            self._after_commit(pending)\n",
        "            pass\n",
        ("tests/workers/test_step_entry_dispatch.py::"
         "test_one_arrival_at_review_enqueues_exactly_one_fanout",
         "tests/app/test_idempotent_admission.py::test_the_message_names_the_run_and_workflow"),
    ),
    Mutant(
        "finish_skips_a_childs_join",
        "a run's end counts for its parent's join: poimen_finish skips poimen_ended only "
        "for a run with no slot to hand on and no parent's entry to count in",
        CLAIMS_SQL,
        "    IF v_locks > 0 OR EXISTS (SELECT 1 FROM step_children c WHERE c.child_run_id = v_run.id)\n",
        "    IF v_locks > 0\n",
        ("tests/workers/test_step_entry_dispatch.py::"
         "test_join_the_last_child_finishing_while_the_parent_goes_waiting_requeues_it_once",),
    ),
    Mutant(
        "ended_skips_a_limited_childs_join",
        "an end counts for its parent's join whatever else it sets off: poimen_ended skips "
        "the join's statement only when no ended run is a fan-out's child",
        RUNS_SQL,
        "    IF EXISTS (SELECT 1 FROM step_children c WHERE c.child_run_id = ANY(p_ended)) THEN\n",
        "    IF cardinality(p_freed) = 0\n"
        "       AND EXISTS (SELECT 1 FROM step_children c WHERE c.child_run_id = ANY(p_ended)) THEN\n",
        ("tests/workers/test_step_entry_dispatch.py::"
         "test_join_a_limited_childs_end_counts_for_the_join_and_hands_its_slot_on",),
    ),
    Mutant(
        "finish_in_a_transaction",
        "a run outside every limited group ends in one statement in autocommit (issue 25)",
        "workers/fence.py",
        "autocommit=single, retrying=retrying)",
        "autocommit=False, retrying=retrying)",
        (f"{CLAIM_TESTS}::test_a_run_ends_in_one_statement_in_autocommit",),
    ),
    Mutant(
        "unrecordable_outcome_keeps_the_boot",
        "a claim whose outcome cannot be recorded ends the boot (the run becomes wreckage)",
        "workers/execution.py",
        "        rollback()\n        end_current_boot()\n        raise\n    finally:",
        "        rollback()\n        raise\n    finally:",
        (f"{CLAIM_TESTS}::test_a_run_whose_outcome_cannot_be_recorded_ends_the_boot",),
    ),
    Mutant(
        "finish_refused_by_its_own_adoption",
        "a fenced write racing this process's own adoption is recorded under the new boot",
        "workers/fence.py",
        "            return (True, True) if write(session, now_ours) else (False, False)\n",
        "            pass\n",
        (f"{CLAIM_TESTS}::"
         "test_a_finish_racing_its_own_adoption_is_recorded_under_the_new_boot",),
    ),
    Mutant(
        "forked_child_keeps_the_lock_socket",
        "liveness belongs to the worker process, not to a forked grandchild holding its socket",
        "workers/boots.py",
        "os.register_at_fork(after_in_child=_forget_boot_in_child)\n",
        "",
        ("tests/chaos/test_boot_loss.py::"
         "test_a_forked_grandchild_does_not_keep_a_dead_workers_boot_alive",),
    ),
    # -- the body's process tree (issue 43): the fence ends the group, not the pid --------------
    Mutant(
        "fence_kills_the_pid_not_the_group",
        "when a pool process dies (the fence, kill -9, the grace's end) the body's whole "
        "process group dies with it, before a takeover may start the run",
        "workers/proctree.py",
        "'kill -s KILL -- \"-$1\"'",
        "'kill -s KILL -- \"$1\"'",
        ("tests/chaos/test_process_tree.py::"
         "test_kill_9_of_the_pool_process_ends_the_bodys_children_one_writer_at_a_time",
         "tests/chaos/test_process_tree.py::test_the_kernel_fence_ends_the_bodys_children"),
    ),
    Mutant(
        "forked_child_keeps_the_guardians_pipe",
        "a forked child does not hold the guardian's pipe open: the group ends with the pool "
        "process, not with the last fork",
        "workers/proctree.py",
        "os.register_at_fork(after_in_child=_forget_guardian_in_child)\n",
        "",
        ("tests/chaos/test_boot_loss.py::test_a_forked_grandchild_dies_with_its_pool_process",),
    ),
    # -- the lease (issue 22): both bounds and their order -------------------------------------
    Mutant(
        "lease_fence_disabled",
        "a process whose runs' lease was not confirmed within T_c is killed, without Postgres",
        "workers/boots.py",
        "    _fence.arm(deadline)\n",
        "    pass\n",
        ("tests/test_lease.py::test_a_process_whose_lease_is_not_confirmed_within_t_c_is_killed",),
    ),
    Mutant(
        "lease_probe_without_deadline",
        "a liveness probe answers within its deadline; a silent path is 'not confirmed'",
        "workers/boots.py",
        "        held = probe_lock(self.conn, _PROBE_TEXT % {\"ns\": LOCK_NAMESPACE, "
        "\"key\": self.lock_key},\n"
        "                          self.settings.probe_timeout)\n",
        "        held = self.conn.execute(_PROBE_TEXT % {\"ns\": LOCK_NAMESPACE, "
        "\"key\": self.lock_key}).fetchone()[0]\n",
        ("tests/test_lease.py::"
         "test_a_boot_probe_through_a_hung_proxy_is_not_confirmed_within_its_deadline",),
    ),
    Mutant(
        "lease_ordering_unchecked",
        "settings with T_c + kill + margin > T_s are refused at start",
        "lease.py",
        "    if lhs > settings.server_seconds:\n",
        "    if False:\n",
        ("tests/test_lease.py::test_a_process_refuses_to_start_with_settings_that_break_the_ordering",),
    ),
    Mutant(
        "lease_ordering_counts_the_takeover_delay",
        "the server's bound covers the client's on its own: the takeover delay is no part of "
        "the ordering (a lock lost early, a re-drive, come without it)",
        "lease.py",
        "    if lhs > settings.server_seconds:\n",
        "    if lhs > settings.server_seconds + settings.takeover_delay:\n",
        ("tests/test_lease.py::test_the_takeover_delay_does_not_count_toward_the_ordering",),
    ),
    Mutant(
        "lease_server_bound_unset",
        "the server ends a lock session that sent nothing for T_s, even behind a hung proxy",
        "lease.py",
        "        statements.append(f\"SET idle_session_timeout = "
        "{int(settings.server_seconds * 1000)}\")\n",
        "        pass\n",
        ("tests/test_lease.py::test_the_server_ends_a_lock_session_behind_a_hung_proxy_after_t_s",),
    ),
    Mutant(
        "worker_consumes_while_cut_off",
        "a worker that cannot reach Postgres leaves run messages to workers that can",
        "workers/gate.py",
        "        if not self.reachable and not self.closed:\n",
        "        if False:\n",
        ("tests/workers/test_gate.py",),
    ),
    # -- issue 23: revoke, repair per queue, the time limit's fence ------------------------------
    Mutant(
        "prepared_statements_behind_a_pooler",
        "the app's pooled connections prepare no statements (a transaction pooler mixes them)",
        "settings_table.py",
        '_db("POIMEN_DB_PREPARE_THRESHOLD", str, "auto",',
        '_db("POIMEN_DB_PREPARE_THRESHOLD", str, "5",',
        ("tests/chaos/test_pooler.py::"
         "test_web_and_workers_behind_the_pooler_admit_and_run_every_run_without_an_error",),
    ),
    Mutant(
        "auto_prepare_behind_a_pooler",
        "under auto, a process prepares only where DATABASE_URL is the lock database",
        "app/extensions.py",
        "    if lock and libpq_url(lock) != dsn:\n",
        "    if False:\n",
        ("tests/workers/test_execution.py::"
         "test_a_worker_prepares_statements_only_where_database_url_is_its_checked_lock_database",
         "tests/chaos/test_pooler.py::"
         "test_web_and_workers_behind_the_pooler_admit_and_run_every_run_without_an_error"),
    ),
    Mutant(
        "session_check_trusts_a_pooler",
        "auto prepares only on a DATABASE_URL whose connection keeps its own session",
        "app/extensions.py",
        '    return other != pid and again == pid and kept == "kept"\n',
        "    return True\n",
        ("tests/chaos/test_pooler.py::test_the_session_check_tells_the_pooler_from_the_direct_url",),
    ),
    Mutant(
        "revoke_not_recorded",
        "a revoke of a run id is recorded as the API's cancel when it is issued",
        "app/celery_control.py",
        "        if command == \"revoke\" and arguments:\n",
        "        if False:\n",
        ("tests/workers/test_celery_native.py::"
         "test_a_revoke_is_recorded_when_issued_and_survives_a_full_worker_restart",),
    ),
    Mutant(
        "repair_budget_from_the_default_queue",
        "repair re-sends only as far as each run's own queue has room",
        "app/run_service.py",
        "            depths[queue] = _queue_depth(celery_app, queue)\n",
        "            depths[queue] = _queue_depth(celery_app)\n",
        ("tests/app/test_repair_queues.py",),
    ),
    Mutant(
        "time_limit_fenced_by_host_and_pid",
        "the hard-time-limit write applies only to the run held by this worker's pool process",
        RUNS_SQL,
        "WHERE node = p_node AND pid = p_pid)",
        "WHERE pid = p_pid)",
        ("tests/workers/test_time_limit_fence.py",),
    ),
    # -- the step-entry ledger ----------------------------------------------------------------
    Mutant(
        "ledger_continues_after_a_failed_marker",
        "a marker-bearing action that fails or loses its claim abandons the rest of the entry",
        "workers/ledger.py",
        "            for act in step.actions:\n                if stop is not None:\n",
        "            for act in step.actions:\n                if False and stop is not None:\n",
        ("tests/workers/test_step_entry_dispatch.py::"
         "test_a_failed_marker_at_position_0_leaves_the_fanout_enqueuing_nothing",),
    ),
    Mutant(
        "marker_claim_without_claimer_liveness",
        "a marker is claimed only by a live boot",
        LEDGER_SQL,
        "FROM run, live WHERE live.ok",
        "FROM run, live",
        ("tests/workers/test_step_entry_dispatch.py::"
         "test_witness_a_marker_claim_requires_a_live_claimer",),
    ),
    Mutant(
        "marker_takeover_without_compare_and_set",
        "a dead boot's marker is taken over with a compare-and-set on the dead boot id",
        LEDGER_SQL,
        "   AND m.claimed_by = :dead AND live.ok",
        "   AND live.ok",
        ("tests/workers/test_step_entry_dispatch.py::"
         "test_witness_a_dead_boots_marker_is_taken_over_by_compare_and_set",),
    ),
    # -- unfenced run transitions -------------------------------------------------------------
    Mutant(
        "cancel_misses_a_requeued_run",
        "cancel is one statement: a run requeued under it is still cancelled",
        RUNS_SQL,
        "   AND status IN ('queued', 'running', 'waiting')",
        "   AND status IN ('running', 'waiting')",
        ("tests/app/test_runs.py::test_cancel_racing_a_release_still_cancels",),
    ),
    Mutant(
        "two_repairs_at_once",
        "one repair at a time: a second beat's repair re-sends nothing while one runs",
        "app/run_service.py",
        "        if not held:\n",
        "        if False:\n",
        ("tests/app/test_repair_queues.py::"
         "test_a_second_repair_while_one_runs_re_sends_nothing",),
    ),
    # -- key reuse and schedules ----------------------------------------------------------------
    Mutant(
        "key_reuse_decided_before_the_release",
        "a key is released only by the statement that sees its run ended (never by a read "
        "before it): a live run's key is never taken",
        RUNS_SQL,
        "   AND status = ANY(CAST(:reusable AS text[]))\n",
        "   AND true\n",
        ("tests/app/test_key_reuse.py::test_after_failure_keeps_a_key_whose_run_did_not_fail",),
    ),
    Mutant(
        "tick_key_from_the_beat_clock",
        "a scheduled run's key is its schedule's tick, the same in every beat",
        "workers/ticks.py",
        "    tick = last_tick(schedule, now)\n",
        "    tick = now.replace(microsecond=0)\n",
        ("tests/workers/test_ticks.py::"
         "test_two_beats_a_moment_apart_compute_one_key_for_one_tick",),
    ),
    # -- the inbox ----------------------------------------------------------------------------
    Mutant(
        "inbox_commits_past_unfinished_work",
        "the inbox commits an offset only past messages that are all done",
        "bridge/inbox/partitions.py",
        "        while self.slots and self.slots[0].state is SlotState.DONE:\n"
        "            done = self.slots.popleft().message\n"
        "            self.buffered_bytes -= message_bytes(done)\n"
        "            self.commit_offset = offset_of(done) + 1",
        "        self.commit_offset = max(self.commit_offset or 0, slot.message.offset() + 1)",
        ("tests/bridge/test_partition_work.py::"
         "test_commit_waits_for_the_oldest_message_when_later_ones_finish_first",),
    ),
    Mutant(
        "revoke_commits_past_in_flight",
        "on revoke the inbox commits only the done prefix, never past a message in flight",
        "bridge/inbox/partitions.py",
        "        it would lose the message; committing less only replays.\n"
        "        \"\"\"\n"
        "        return self.commit_offset\n",
        "        it would lose the message; committing less only replays.\n"
        "        \"\"\"\n"
        "        return self.next_offset if self.slots else self.commit_offset\n",
        ("tests/bridge/test_partition_work.py::"
         "test_revoke_commits_only_what_is_admitted_or_dead_lettered_in_order",),
    ),
    Mutant(
        "batch_commits_past_failed_item",
        "each item of a batch is settled by its own outcome: a retriable one stops the commit",
        "bridge/inbox/partitions.py",
        "            if outcome.done:\n"
        "                slot.state = SlotState.DONE\n",
        "            if outcome.done or len(settled) > 1:\n"
        "                slot.state = SlotState.DONE\n",
        ("tests/bridge/test_partition_work.py::test_batch_commits_past_failed_item_never",),
    ),
    Mutant(
        "inbox_keyless_message_gets_no_key",
        "a message without dispatch_key is admitted under a derived kafka:<topic>:... key",
        "bridge/inbox/faults.py",
        '    if body.get("dispatch_key") is not None:\n        return value, False\n',
        "    return value, False\n",
        ("tests/bridge/test_inbox_hostile.py::"
         "test_keyless_messages_stay_one_run_each_after_redelivery",),
    ),
    Mutant(
        "inbox_derived_key_names_only_the_place",
        "a derived kafka: key names the message (place and stored time): a re-created "
        "topic's keyless message is a new run, a redelivered one the same run",
        "bridge/inbox/faults.py",
        '    return f"kafka:{topic}:{partition}:{offset}:{timestamp_ms}"\n',
        '    return f"kafka:{topic}:{partition}:{offset}"\n',
        ("tests/bridge/test_inbox_hostile.py::"
         "test_keyless_messages_of_a_recreated_topic_are_new_runs",),
    ),
    Mutant(
        "dlq_replay_replays_dead_lettered_copies",
        "a plain DLQ replay never publishes a dead-lettered copy of an earlier replay: "
        "N letters that keep failing stay at most 2N however often it runs",
        "bridge/dlq.py",
        "                if letter.copy_of:\n",
        "                if False:\n",
        ("tests/bridge/test_dlq_replay.py::"
         "test_replaying_letters_that_keep_failing_three_times_leaves_at_most_twice_as_many",),
    ),
    Mutant(
        "dlq_replay_forgets_letters_with_a_copy",
        "a plain DLQ replay never publishes a letter an earlier replay published that was "
        "dead-lettered again (its copy names it), commit or not",
        "bridge/dlq.py",
        '                elif f"{source}:{letter.partition}:{letter.offset}" in copied:\n',
        "                elif False:\n",
        ("tests/bridge/test_dlq_replay.py::"
         "test_a_filtered_replay_of_a_letter_that_keeps_failing_publishes_it_once",),
    ),
    Mutant(
        "dlq_replay_commits_nothing",
        "a DLQ replay records what it replayed (the replay group's offsets, after the "
        "broker's acknowledgement): the next plain replay starts after it",
        "bridge/dlq.py",
        "            dlq.commit(report.committed)\n",
        "            dlq.commit({})\n",
        ("tests/bridge/test_dlq_replay.py::"
         "test_dead_letters_replayed_become_one_run_each_and_a_second_replay_adds_none",),
    ),
    Mutant(
        "console_replay_without_admin_scope",
        "replaying dead letters from the console needs the admin scope",
        "app/console/views.py",
        "    if not principal.allows(REPLAY_DLQ):\n",
        "    if not principal.allows(ADMIT):\n",
        ("tests/app/test_least_privilege.py::"
         "test_only_an_admin_scoped_token_replays_dead_letters_from_the_console",),
    ),
    Mutant(
        "inbox_retries_its_own_bugs_forever",
        "a message our code keeps raising on is dead-lettered, never stalls its partition",
        "bridge/inbox/relay.py",
        "        if slot.internal_errors < INTERNAL_ERROR_TRIES:\n",
        "        if True:\n",
        ("tests/bridge/test_inbox_hostile.py::"
         "test_each_hostile_message_is_dead_lettered_and_the_next_one_runs_within_10s",),
    ),
    # -- the outbox ---------------------------------------------------------------------------
    Mutant(
        "outbox_reads_above_the_horizon",
        "the outbox relay reads only below the snapshot horizon, so no row is skipped",
        "bridge/outbox.py",
        "   AND o.txid < pg_snapshot_xmin(pg_current_snapshot())\n",
        "",
        ("tests/bridge/test_outbox_relay.py::"
         "test_rows_of_younger_transactions_wait_for_an_older_open_one",),
    ),
    Mutant(
        "outbox_retries_an_event_refused_for_size",
        "an event the broker refuses for its size is published reduced, never retried forever",
        "bridge/outbox.py",
        '            value, reason = reduced_value(event.value, size), "refused"\n',
        "            deliveries.failed[event.id] = error\n            return True\n",
        ("tests/bridge/test_outbox_relay.py::"
         "test_an_event_the_broker_refuses_for_size_goes_out_reduced",),
    ),
    Mutant(
        "outbox_marks_a_runs_events_past_a_failed_one",
        "a run's events the broker took after one of its events that failed go out again "
        "after it: the run's order holds",
        "bridge/outbox.py",
        "        acked = [row_id for row_id in self.acked\n"
        "                 if row_id < first_failed.get(self.events[row_id].key, row_id + 1)]\n",
        "        acked = list(self.acked)\n",
        ("tests/bridge/test_outbox_relay.py::"
         "test_an_event_the_broker_refuses_for_size_goes_out_reduced",),
    ),
    Mutant(
        "outbox_retries_an_undeliverable_event_forever",
        "an event refused for its size even reduced is marked and counted, never retried forever",
        "bridge/outbox.py",
        "        return acked, list(self.undeliverable)\n",
        "        return acked, []\n",
        ("tests/bridge/test_outbox_relay.py::"
         "test_an_event_refused_even_reduced_is_marked_counted_and_never_retried",),
    ),
    Mutant(
        "error_text_unbounded",
        "a failure's error text is stored bounded (POIMEN_ERROR_TEXT_MAX_BYTES), its size noted",
        "workers/actions.py",
        "        if size > limit:\n",
        "        if False:\n",
        ("tests/workers/test_error_text.py",
         "tests/bridge/test_outbox_relay.py::"
         "test_a_run_failing_with_a_huge_error_publishes_its_run_failed_event_truncated"),
    ),
    # -- the console ---------------------------------------------------------------------------
    Mutant(
        "console_redrive_without_derived_key",
        "a re-drive of a failed run is one admission: its dispatch key derives from that run",
        "app/console/views.py",
        "dispatch_key=redrive_key(run.id),",
        "dispatch_key=None,",
        ("tests/console/test_console.py::"
         "test_redrive_of_a_failed_run_clicked_twice_at_once_is_one_new_run",),
    ),
    Mutant(
        "console_post_without_csrf_check",
        "every console POST carries the session's CSRF token",
        "app/console/views.py",
        "    if request.method == \"POST\":\n        check_csrf()\n",
        "    pass\n",
        ("tests/console/test_console.py::"
         "test_a_post_without_the_csrf_token_is_refused_and_changes_nothing",),
        ci=False,
    ),
    # -- the Python client --------------------------------------------------------------------
    Mutant(
        "client_retries_without_a_key",
        "every attempt of one admit() carries one dispatch_key, generated when the caller gave none",
        "clients/python/poimen_client/client.py",
        '        request: dict[str, Any] = {"workflow_ref": workflow_ref, "input": dict(input or {}),\n'
        '                                   "dispatch_key": key}\n',
        '        request: dict[str, Any] = {"workflow_ref": workflow_ref, "input": dict(input or {}),\n'
        '                                   "dispatch_key": dispatch_key}\n',
        ("tests/bridge/test_client.py::"
         "test_twenty_threads_through_a_dropping_proxy_admit_exactly_one_run_per_call",),
    ),
    # -- Celery's own tools (workers/celery_native.py) ----------------------------------------
    Mutant(
        "failed_run_reports_success",
        "a run that ends failed ends its Celery task in FAILURE (Flower, celery events)",
        "workers/celery_native.py",
        '        raise RunFailed(f"run {claim.run_id} failed: {ended.code}")\n'
        "    if ended.status == RunEnding.CANCELLED:\n",
        "        return claim.outcome.value\n"
        "    if ended.status == RunEnding.CANCELLED:\n",
        ("tests/workers/test_celery_native.py::"
         "test_flower_and_task_events_show_each_runs_outcome",),
    ),
    Mutant(
        "duplicate_delivery_reports_success",
        "a delivery that did no work is Ignored, never SUCCESS",
        "workers/celery_native.py",
        "            raise RunFailed(f\"run {claim.run_id} failed: {(error or {}).get('code')}\")\n"
        "    raise Ignore()\n",
        "            raise RunFailed(f\"run {claim.run_id} failed: {(error or {}).get('code')}\")\n"
        "    return claim.outcome.value\n",
        ("tests/workers/test_celery_native.py::"
         "test_a_duplicate_delivery_while_the_run_goes_is_not_a_success",),
        ci=False,
    ),
    Mutant(
        "revoke_does_not_cancel",
        "celery control revoke/terminate cancels the run (never re-sent, never resumed)",
        "workers/celery_native.py",
        "    try:\n        run_uuid = uuid.UUID(run_id)\n    except (TypeError, ValueError):\n"
        "        return None\n    with flask_app.app_context():\n",
        "    return None\n    with flask_app.app_context():\n",
        ("tests/workers/test_celery_native.py::"
         "test_revoke_of_a_queued_run_cancels_it_and_it_never_runs",
         "tests/workers/test_celery_native.py::"
         "test_revoke_terminate_cancels_a_running_run_and_it_is_not_resumed"),
        ci=False,
    ),
    Mutant(
        "time_limit_leaves_run_to_takeover",
        "a run past its hard time limit is recorded failed before its process is killed",
        "workers/celery_native.py",
        "        if not soft and self.worker_pid and not worker_state.should_terminate:\n",
        "        if False:\n",
        ("tests/workers/test_celery_native.py::"
         "test_a_run_past_its_hard_time_limit_fails_and_is_not_resumed",),
        ci=False,
    ),
    Mutant(
        "connection_loss_cancels_runs",
        "a worker that loses its broker connection (RabbitMQ's consumer_timeout) keeps its runs",
        "celeryconfig.py",
        '        "worker_cancel_long_running_tasks_on_connection_loss": False,\n',
        '        "worker_cancel_long_running_tasks_on_connection_loss": True,\n',
        ("tests/rabbitmq/test_rabbitmq_broker.py::"
         "test_a_run_outlives_its_worker_losing_the_broker_connection",),
        ci=False,  # needs RabbitMQ and rabbitmqctl on the machine
    ),
    # -- the cross-feature model: each rule it checks, broken once ----------------------------
    Mutant(
        "model_group_limit_off_by_one",
        "at most concurrency_limit runs of a group run at once (model rule limits)",
        CLAIMS_SQL,
        ") >= me.concurrency_limit",
        ") > me.concurrency_limit",
        (MODEL_TEST,),
        occurrences=2, nth=0,  # poimen_claim_slot, poimen_slot_verdict
    ),
    Mutant(
        "model_tenant_cap_off_by_one",
        "at most max_running runs of a capped tenant start (model rule limits)",
        CLAIMS_SQL,
        ") >= me.max_running",
        ") > me.max_running",
        (MODEL_TEST,),
        occurrences=2, nth=0,  # poimen_claim_slot, poimen_slot_verdict
    ),
    Mutant(
        "model_repair_never_wakes_a_tenant",
        "a run waiting for its tenant's cap is woken by repair once the cap has room (a "
        "holder's death, a cap raised, an end that handed no slot on) (model rule waiting)",
        RUNS_SQL,
        "\n                     <= t.max_running\n",
        "\n                     <= 0\n",
        (MODEL_TEST,),  # poimen_cap_wakes, which wake_waiting and wake_tenant read
    ),
    Mutant(
        "model_every_key_reusable",
        "a key names one run unless its workflow's key_reuse lets an ended run's key go; a "
        "derived key of a workflow that never reuses keys names one run forever (model rules "
        "caller_keys, derived_keys)",
        "app/admission.py",
        "    return registry.KEY_REUSE_POLICIES[workflow.key_reuse]\n",
        "    return registry.KEY_REUSE_POLICIES[\"after_end\"]\n",
        # The model finds this within the gate's examples on most seeds, not all: the
        # deterministic witness of the rule stands beside it.
        (MODEL_TEST, "tests/app/test_key_reuse.py::test_the_default_policy_replays_a_failed_run"),
    ),
    Mutant(
        "claim_runs_an_expired_run",
        "a run no worker started by its expires_at is never started: the claim statement "
        "refuses it (and the delivery ends it expired), limited or not",
        CLAIMS_SQL,
        "   AND (expires_at IS NULL OR expires_at > now() OR started_at IS NOT NULL)\n",
        "",
        (f"{DELAYED_TESTS}::test_a_delivery_after_expiry_ends_the_run_expired_and_runs_nothing",
         f"{DELAYED_TESTS}::test_a_limited_runs_delivery_after_expiry_ends_it_expired",
         f"{BATCH_TESTS}::test_a_batch_claims_only_the_runs_a_single_claim_would"),
        occurrences=2, nth=0,  # the one-statement claim and the batch's
        also=(Edit(" AND (r.expires_at IS NULL OR r.expires_at > now() OR r.started_at IS NOT "
                   "NULL)", ""),),
    ),
    Mutant(
        "expiry_ends_a_started_run",
        "expiry is about the first start: a run a worker started (retried, resumed, taken "
        "over) is never ended expired",
        RUNS_SQL,
        "       AND started_at IS NULL AND expires_at <= now()\n",
        "       AND expires_at <= now()\n",
        (f"{DELAYED_TESTS}::test_a_started_run_never_expires_even_when_taken_over",),
        also=(Edit("        WHERE r.expires_at IS NOT NULL AND r.started_at IS NULL\n",
                   "        WHERE r.expires_at IS NOT NULL\n"),),
    ),
    Mutant(
        "admission_sends_a_delayed_run",
        "a delayed run is sent by beat when due, never at admission (no Celery ETA: nothing "
        "waits in a worker's memory for Redis to deliver twice)",
        "app/state/runs.py",
        "    if row.due:  # a delayed run is sent when due, by beat (``release_due_runs``)\n",
        "    if True:\n",
        (f"{DELAYED_TESTS}::test_a_delayed_run_is_stored_with_its_time_and_not_sent",),
        occurrences=2, nth=0,  # admit, admit_many
    ),
    Mutant(
        "release_sends_a_sent_run",
        "beat sends a delayed run once: release_due picks only runs never sent since they "
        "came due, and marks them sent in the statement that picks them",
        RUNS_SQL,
        "        WHERE r.status = 'queued' AND r.last_sent_at < r.not_before\n",
        "        WHERE r.status = 'queued'\n",
        (f"{DELAYED_TESTS}::test_beat_sends_a_delayed_run_once_when_due_and_never_before",
         f"{DELAYED_TESTS}::test_a_retrys_delayed_message_counts_as_sent_and_beat_leaves_it"),
    ),
    Mutant(
        "retry_message_counts_unsent",
        "a retry's delayed message (sent by its worker) counts as sent at its not_before, so "
        "beat's release does not send it a second time",
        CLAIMS_SQL,
        "           not_before = now() + make_interval(secs => p_delay),\n"
        "           last_sent_at = now() + make_interval(secs => p_delay)\n",
        "           not_before = now() + make_interval(secs => p_delay)\n",
        (f"{DELAYED_TESTS}::test_a_retrys_delayed_message_counts_as_sent_and_beat_leaves_it",),
    ),
    Mutant(
        "replay_ignores_the_delay",
        "a replay compares the delay it asks for with the run's: a different instant, or a "
        "delay against an undelayed run, is a conflict, never a silent other run",
        "app/admission.py",
        '_COMPARED = ("workflow_ref", "input", "goal_id", "not_before", "expires_at")',
        '_COMPARED = ("workflow_ref", "input", "goal_id", "expires_at")',
        (f"{DELAYED_TESTS}::"
         "test_a_replay_compares_an_instant_as_stored_and_a_delay_by_its_presence",),
    ),
    Mutant(
        "join_skips_an_expired_child",
        "an expired child has ended: it counts for its parent's join like a cancelled one",
        RUNS_SQL,
        "           AND s.status IN ('succeeded', 'failed', 'cancelled', 'poisoned', 'expired')",
        "           AND s.status IN ('succeeded', 'failed', 'cancelled', 'poisoned')",
        (f"{DELAYED_TESTS}::test_an_expired_child_counts_for_its_parents_join",),
    ),
    Mutant(
        "fan_out_ignores_a_cancelled_parent",
        "a child admitted under a parent whose cascading cancel committed is admitted with its "
        "cancellation requested: it never starts after the cancel's answer",
        RUNS_SQL,
        "p.cancel_requested AND p.cancel_cascade AS cancelled",
        "false AS cancelled",
        (f"{CASCADE_TESTS}::"
         "test_a_child_admitted_after_the_cancel_is_admitted_cancelled_and_never_runs",),
        occurrences=2, nth=0,  # admit, admit_many
    ),
    Mutant(
        "fan_out_does_not_lock_its_parent",
        "a child's admission locks its parent's row, so a cascading cancel meeting a fan-out "
        "in flight waits for its commit and then finds the children",
        RUNS_SQL,
        "      FROM runs p WHERE p.id = CAST(:parent_run_id AS uuid) FOR SHARE),",
        "      FROM runs p WHERE p.id = CAST(:parent_run_id AS uuid)),",
        (f"{CASCADE_TESTS}::"
         "test_a_cancel_meeting_a_fan_out_in_flight_waits_for_it_then_cancels_its_children",),
        occurrences=2, nth=0,
    ),
    Mutant(
        "cancel_reaches_only_children",
        "a cancel reaches every descendant not ended, at any depth",
        RUNS_SQL,
        "    SELECT c.id FROM runs c WHERE c.parent_run_id = :run\n    UNION ALL\n"
        "    SELECT c.id FROM tree JOIN runs c ON c.parent_run_id = tree.id)",
        "    SELECT c.id FROM runs c WHERE c.parent_run_id = :run)",
        (f"{CASCADE_TESTS}::test_a_cancel_reaches_every_descendant_not_ended",),
    ),
    # -- the batching worker -------------------------------------------------------------------
    Mutant(
        "batch_claim_skips_liveness",
        "a batch claim checks its boot's lock in its own statement: a boot whose lock is gone "
        "claims none of the runs",
        CLAIMS_SQL,
        "   AND EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = :boot\n"
        "                  AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key))\n",
        "",
        (f"{BATCH_TESTS}::test_a_batch_of_a_boot_without_its_lock_claims_nothing",),
    ),
    Mutant(
        "batch_claim_without_compare_and_set",
        "each run of a batch claim is claimed only from queued: a redelivery claims none",
        CLAIMS_SQL,
        " WHERE id = ANY(CAST(:runs AS uuid[])) AND (runs.status || '') = 'queued'\n",
        " WHERE id = ANY(CAST(:runs AS uuid[])) AND (runs.status || '') IN ('queued', 'running')\n",
        (f"{BATCH_TESTS}::test_a_batch_claims_each_queued_run_once_in_one_statement",),
    ),
    Mutant(
        "batch_finish_unfenced",
        "each end of a batch ended set-wise is fenced by this process's boots: a run another "
        "process took over is refused",
        CLAIMS_SQL,
        "         WHERE r.id = b.run AND (r.status || '') = 'running' AND r.claimed_by = ANY(p_boots)\n",
        "         WHERE r.id = b.run AND (r.status || '') = 'running'\n",
        (f"{BATCH_TESTS}::test_a_batch_ends_each_run_fenced_in_one_commit",),
    ),
    Mutant(
        "batch_each_finish_unfenced",
        "each end of a batch ended run by run is fenced by this process's boots: a run another "
        "process took over is refused",
        CLAIMS_SQL,
        "                             p_boots, p_event_type[i],",
        "                             ARRAY(SELECT r.claimed_by FROM runs r WHERE r.id = p_run[i]),"
        " p_event_type[i],",
        (f"{BATCH_TESTS}::test_a_batch_with_a_fan_out_child_is_ended_run_by_run_each_fenced",),
    ),
    Mutant(
        "batch_set_finish_of_a_limited_run",
        "a batch holding a run of a limited group is ended run by run: its end hands its slot on",
        CLAIMS_SQL,
        "                  AND (r.concurrency_limit IS NOT NULL OR t.max_running IS NOT NULL))\n",
        "                  AND (t.max_running IS NOT NULL))\n",
        (f"{BATCH_TESTS}::test_a_batch_holding_a_run_with_a_slot_hands_the_slot_on[limit]",),
    ),
    Mutant(
        "batch_set_finish_of_a_capped_tenant",
        "a batch holding a run of a capped tenant is ended run by run: its end hands the "
        "tenant's slot on",
        CLAIMS_SQL,
        "                  AND (r.concurrency_limit IS NOT NULL OR t.max_running IS NOT NULL))\n",
        "                  AND (r.concurrency_limit IS NOT NULL))\n",
        (f"{BATCH_TESTS}::test_a_batch_holding_a_run_with_a_slot_hands_the_slot_on[cap]",),
    ),
    Mutant(
        "batch_set_finish_events_out_of_order",
        "a batch ended set-wise writes each run's events in a single end's order: "
        "step.entered, step.<status>, run.<status>",
        CLAIMS_SQL,
        "         ORDER BY d.n, ev.ord)\n",
        "         ORDER BY d.n, ev.ord DESC)\n",
        (f"{BATCH_TESTS}::test_a_batch_ended_set_wise_writes_what_each_run_ended_alone_writes",),
    ),
    Mutant(
        "batch_set_finish_of_a_joined_child",
        "a batch holding a fan-out's child is ended run by run: its end counts for the join",
        CLAIMS_SQL,
        "       OR EXISTS (SELECT 1 FROM step_children c WHERE c.child_run_id = ANY(p_run)) THEN\n",
        "       THEN\n",
        (f"{BATCH_TESTS}::test_two_children_of_one_join_ending_in_one_batch_wake_their_parent_once",),
    ),
    Mutant(
        "batch_finish_reports_before_commit",
        "a run in a finish batch is reported only once the batch's statement returned, "
        "committed",
        "workers/batching.py",
        "        try:\n            conn = self._connection()\n"
        "            done = finish_batch(conn, ends, boots)\n",
        "        for request in requests:\n"
        "            request.resolve(FinishedInBatch(request.run_id, 'succeeded', None))\n"
        "        try:\n            conn = self._connection()\n"
        "            done = finish_batch(conn, ends, boots)\n",
        (f"{BATCH_TESTS}::test_a_finish_returns_only_once_its_batch_committed",),
    ),
    Mutant(
        "batcher_reads_its_queue_outside_the_lock",
        "a thread's request is appended to the batcher's queue under the lock the batcher "
        "takes batches under: a request made during a take is sent in the next batch, never "
        "left on the list the take emptied",
        "workers/batching.py",
        "        with self._cond:\n            self._start()\n"
        "            queue = self._claims if kind == \"claim\" else self._finishes\n",
        "        queue = self._claims if kind == \"claim\" else self._finishes\n"
        "        with self._cond:\n            self._start()\n",
        (f"{BATCH_TESTS}::test_a_request_made_while_the_batcher_takes_a_batch_goes_in_the_next_"
         "one",),
    ),
    Mutant(
        "batch_claim_decided_before_its_backend_ended",
        "a batch claim of unknown outcome is read only once its backend has ended: a backend "
        "still waiting would commit the claim later, with nobody to run the runs",
        "workers/batching.py",
        "                end_backend(conn, pid)\n"
        "                while not backend_gone(conn, pid):\n",
        "                while False:\n",
        (f"{BATCH_TESTS}::test_a_batch_claim_cut_before_it_applied_is_decided_not_claimed_and_"
         "never_applies_later",),
    ),
    Mutant(
        "fetch_pops_without_record",
        "a message the worker fetches after a BRPOP is recorded as unacked in the same atomic "
        "step as its pop: a worker killed before its delivery loses nothing",
        "workers/broker.py",
        "  redis.call('HSET', KEYS[2], tag, '[' .. m .. ',' .. cjson.encode(info['exchange']) .. ','\n"
        "             .. cjson.encode(info['routing_key']) .. ']')\n",
        "",
        (f"{BROKER_TESTS}::test_one_fetch_takes_what_the_prefetch_has_room_for_each_recorded_"
         "before_its_delivery",
         f"{BROKER_TESTS}::test_a_consumer_killed_in_the_middle_of_a_fetch_leaves_every_message_"
         "queued_or_unacked"),
    ),
    Mutant(
        "fetch_beyond_prefetch",
        "a fetch after a BRPOP takes no more than the channel's prefetch has room for",
        "workers/broker.py",
        "            limit = min(limit, qos.prefetch_count - (len(qos._delivered) - len(qos._dirty)))\n",
        "            pass\n",
        (f"{BROKER_TESTS}::test_one_fetch_takes_what_the_prefetch_has_room_for_each_recorded_"
         "before_its_delivery",),
    ),
    Mutant(
        "fetch_drops_unreadable",
        "a message the fetch cannot read goes back where it was, not lost",
        "workers/broker.py",
        "    redis.call('RPUSH', key, m)\n",
        "",
        (f"{BROKER_TESTS}::test_a_message_the_fetch_cannot_read_goes_back_where_it_was_for_"
         "kombu",),
    ),
    Mutant(
        "fetch_rest_left_unacked",
        "the messages of a fetch not delivered (a delivery before them failed) go back to the "
        "queue at once, not to the visibility timeout",
        "workers/broker.py",
        "                    if left not in qos._delivered:\n",
        "                    if False:\n",
        (f"{BROKER_TESTS}::test_a_delivery_that_fails_in_a_fetch_sends_the_rest_back_and_loses_"
         "nothing",),
    ),
    Mutant(
        "batch_second_delivery_claims_again",
        "while a thread of a batch worker handles a run, another delivery of it in the process "
        "is a duplicate (so a run this boot holds after an unknown batch is the batch's)",
        "workers/boots.py",
        "        if run_id in _claiming or run_id in _holding:\n            return False\n",
        "",
        (f"{BATCH_TESTS}::test_a_second_delivery_in_this_process_is_a_duplicate_decided_here",),
    ),
    Mutant(
        "batch_sigterm_grace_ignored",
        "a batch worker's SIGTERM bounds Celery's wait for its threads by the grace: at the "
        "deadline the process exits and leaves its runs to repair",
        "workers/shutdown.py",
        "        _abandon_timer.start()\n",
        "",
        ("tests/workers/test_batching_processes.py::test_sigterm_to_a_batch_worker_lets_"
         "short_runs_finish_and_leaves_the_rest_after_the_grace",),
    ),
    Mutant(
        "batch_together_commits_each_statement",
        "a claim batch and a finish batch sent together are one transaction: a finish that "
        "fails rolls the claims back, so their threads claim them alone (never runs left "
        "running under a live boot that nobody executes)",
        "app/state/direct.py",
        "                with self.conn.pipeline():\n"
        "                    for sql, params in compiled:\n"
        "                        cur = self.conn.cursor(row_factory=namedtuple_row)\n"
        "                        cursors.append(cur)\n"
        "                        cur.execute(sql, params)\n",
        "                with self.conn.pipeline() as pipeline:\n"
        "                    for sql, params in compiled:\n"
        "                        cur = self.conn.cursor(row_factory=namedtuple_row)\n"
        "                        cursors.append(cur)\n"
        "                        cur.execute(sql, params)\n"
        "                        pipeline.sync()\n",
        (f"{BATCH_TESTS}::test_a_refused_claim_and_finish_batch_rolls_both_back_and_sends_each_"
         "alone",),
    ),
    Mutant(
        "batch_claims_answered_before_their_commit",
        "a claim sent with finishes is answered only once their one transaction committed: "
        "no body starts while the finishes' statement may still fail",
        "workers/batching.py",
        "            claim_result, finish_result = conn.together([\n"
        "                claim_batch_call(list(first), boot_id), finish_batch_call(ends, boots)])\n",
        "            claim_result = conn.execute(*claim_batch_call(list(first), boot_id))\n"
        "            self._claimed(first, claimed_by_batch(claim_result))\n"
        "            finish_result = conn.execute(*finish_batch_call(ends, boots))\n",
        (f"{BATCH_TESTS}::test_a_claim_sent_with_finishes_is_answered_only_once_their_commit",),
    ),
    Mutant(
        "batch_linger_ignores_a_full_pool",
        "a batcher lingering under load sends once every thread of the pool waits on it: "
        "nothing more can come, and waiting on would idle the whole worker",
        "workers/batching.py",
        "            self._threads is not None\n",
        "            self._threads is not None and False\n",
        (f"{BATCH_TESTS}::"
         "test_under_load_the_batcher_lingers_until_every_thread_of_the_pool_waits",),
    ),
    Mutant(
        "batch_lingers_at_a_low_rate",
        "the batcher lingers only while the rate requests arrive at says one is due within "
        "the bound: at a low rate a run's claim and finish go at once",
        "workers/batching.py",
        "        if left <= 0 or self._enough() or self._arrivals.expected(left) < 1.0:\n",
        "        if left <= 0 or self._enough():\n",
        (f"{BATCH_TESTS}::test_at_a_low_rate_the_batcher_sends_at_once",),
    ),
    # -- rate limits --------------------------------------------------------------------------
    Mutant(
        "rate_check_then_claim",
        "a start under a rate limit is read after its scopes' row locks: a claim that waited "
        "for them starts one interval after the holder's, never beside it",
        CLAIMS_SQL,
        "    PERFORM 1 FROM rate_slots s WHERE s.scope = ANY(v_scopes) ORDER BY s.scope FOR UPDATE;\n"
        "    v_clock := clock_timestamp();\n",
        "    v_clock := clock_timestamp();\n",
        (f"{RATE_TESTS}::test_a_claim_waiting_for_the_scope_lock_reads_the_start_the_holder_"
         "committed",),
        also=(Edit("                    ON u.scope = s.scope);\n",
                   "                    ON u.scope = s.scope);\n"
                   "    PERFORM 1 FROM rate_slots s WHERE s.scope = ANY(v_scopes) "
                   "ORDER BY s.scope FOR UPDATE;\n"),),
    ),
    Mutant(
        "rate_claim_queued_ignores_the_limit",
        "a run under a rate limit is never taken by the one-statement claim, which counts no "
        "start",
        CLAIMS_SQL,
        "   AND concurrency_limit IS NULL AND rate_interval IS NULL\n",
        "   AND concurrency_limit IS NULL\n",
        (f"{RATE_TESTS}::test_the_second_start_a_moment_later_is_reserved_one_interval_after_"
         "the_first", f"{BATCH_TESTS}::test_a_batch_claims_only_the_runs_a_single_claim_would"),
        occurrences=2, nth=0,  # the one-statement claim and the batch's
    ),
    Mutant(
        "rate_reservation_takes_another_start",
        "a run's reserved start is its place in the line: its claim when due takes no other",
        CLAIMS_SQL,
        "CASE WHEN v_reserved THEN v_clock ELSE max(s.next_start) END)",
        "max(s.next_start))",
        (f"{RATE_TESTS}::test_a_reserved_run_claimed_early_is_not_due_and_when_due_keeps_its_"
         "place",),
    ),
    Mutant(
        "rate_reservation_ignores_the_last_start",
        "no two starts of a scope are closer than its interval, however late a reserved run "
        "comes (a late start puts off the next reserved one)",
        CLAIMS_SQL,
        "                                max(s.last_start + make_interval(secs => u.secs)),\n",
        "                                CASE WHEN v_reserved THEN v_clock ELSE\n"
        "                                max(s.last_start + make_interval(secs => u.secs)) END,\n",
        (f"{RATE_TESTS}::test_a_reserved_run_after_a_late_start_waits_the_interval_and_keeps_"
         "its_place",),
    ),
    Mutant(
        "rate_limit_on_every_start",
        "a rate limit counts first starts: a retry, a join's resumption take no start",
        CLAIMS_SQL,
        "WHERE r.id = p_run AND r.started_at IS NULL AND",
        "WHERE r.id = p_run AND",
        (f"{RATE_TESTS}::test_a_retry_takes_no_start",),
    ),
    Mutant(
        "rate_start_while_waiting_for_a_slot",
        "a run takes its start only once it has its slot: one waiting for a slot uses none",
        CLAIMS_SQL,
        "CASE WHEN v.reason IS NULL AND me.rated THEN p_run END",
        "CASE WHEN me.rated THEN p_run END",
        (f"{RATE_TESTS}::test_a_run_without_a_slot_uses_no_start_and_takes_one_once_woken",
         f"{RATE_TESTS}::test_a_tenant_cap_and_a_rate_limit_together"),
    ),
    Mutant(
        "model_tick_from_the_beat_clock",
        "one run per schedule tick, however many beats (a moment apart) admit it (model rule "
        "ticks)",
        "workers/ticks.py",
        "    tick = last_tick(schedule, now)\n",
        "    tick = now.replace(microsecond=0)\n",
        (MODEL_TEST,),
    ),
    Mutant(
        "model_slot_claim_without_holder",
        "a claimed run is running under the boot that claimed it: never lost to every boot "
        "(model rule no_run_lost)",
        CLAIMS_SQL,
        "claimed_by = CASE WHEN d.reason IS NULL AND d.reserved IS NULL\n"
        "                             THEN CAST(p_boot AS uuid) END,",
        "claimed_by = NULL,",
        (MODEL_TEST,),
    ),
    Mutant(
        "model_finish_unfenced",
        "a boot's write after it lost its claim is refused (model rule fenced)",
        CLAIMS_SQL,
        "= 'running' AND claimed_by = ANY(p_boots)",
        "= 'running'",
        (MODEL_TEST,),
        occurrences=3, nth=1,  # poimen_finish
    ),
]
