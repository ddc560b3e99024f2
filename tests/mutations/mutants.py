"""The catalogue: one entry per core rule, broken on purpose in the smallest way.

Each mutant is an exact edit (``find`` must occur exactly ``occurrences`` times;
the ``nth`` one, 1-based, is replaced) and the pytest selection that must fail
on it. A ``find`` that no longer matches is a stale mutant and fails the gate:
when a rule's code moves, its mutant moves with it. A new core rule lands with
its mutant here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str
    path: str
    find: str
    replace: str
    tests: tuple[str, ...]
    nth: int = 1
    occurrences: int = 1
    ci: bool = True  # part of the subset .ci/run runs


CLAIMS = "workers/claims.py"
CLAIM_TESTS = "tests/workers/test_claims.py"

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
    # -- claims -------------------------------------------------------------------------------
    Mutant(
        "claim_without_claimer_liveness",
        "a boot without its lock claims nothing (liveness is part of the claim statement)",
        CLAIMS,
        "       AND (not_before IS NULL OR not_before <= now())\n       AND {_CLAIMER_LIVE}",
        "       AND (not_before IS NULL OR not_before <= now())",
        (f"{CLAIM_TESTS}::test_a_boot_cut_off_server_side_claims_nothing",),
    ),
    Mutant(
        "takeover_without_claimer_liveness",
        "a boot without its lock takes nothing over",
        CLAIMS,
        "claimed_by = :dead AND {_CLAIMER_LIVE}",
        "claimed_by = :dead",
        (f"{CLAIM_TESTS}::test_a_cut_off_boot_cannot_take_over_wreckage",
         f"{CLAIM_TESTS}::test_the_takeover_statement_itself_requires_the_claimers_lock"),
        nth=1, occurrences=2,
    ),
    Mutant(
        "claim_check_then_update",
        "a claim is one conditional UPDATE, not a read then a write",
        CLAIMS,
        "WHERE id = :run AND status = 'queued' AND NOT cancel_requested",
        "WHERE id = :run AND (SELECT r2.status FROM runs r2 WHERE r2.id = :run) = 'queued' "
        "AND NOT cancel_requested",
        (f"{CLAIM_TESTS}::test_a_claim_waiting_on_an_uncommitted_claim_does_not_claim_again",),
    ),
    Mutant(
        "takeover_without_compare_and_set",
        "wreckage is taken over with a compare-and-set on the dead boot id",
        CLAIMS,
        "WHERE id = :run AND status = 'running' AND claimed_by = :dead AND {_CLAIMER_LIVE}",
        "WHERE id = :run AND status = 'running' AND {_CLAIMER_LIVE}",
        (f"{CLAIM_TESTS}::test_two_rescuers_of_one_dead_boots_run_take_it_over_once",),
        nth=1, occurrences=2,
    ),
    Mutant(
        "adoption_without_compare_and_set",
        "a process that lost its boot keeps a run only if nobody took it over",
        CLAIMS,
        "WHERE id = :run AND status = 'running' AND claimed_by = :dead AND {_CLAIMER_LIVE}",
        "WHERE id = :run AND status = 'running' AND {_CLAIMER_LIVE}",
        (f"{CLAIM_TESTS}::test_adoption_after_a_takeover_is_refused",),
        nth=2, occurrences=2,
    ),
    Mutant(
        "finish_unfenced",
        "finishing is fenced by the claim",
        CLAIMS, "AND status = 'running' AND claimed_by = ANY(:boots)",
        "AND status = 'running'",
        (f"{CLAIM_TESTS}::test_every_fenced_write_of_a_boot_that_lost_its_claim_is_refused",),
        nth=1, occurrences=3,
    ),
    Mutant(
        "release_unfenced",
        "releasing is fenced by the claim",
        CLAIMS, "AND status = 'running' AND claimed_by = ANY(:boots)",
        "AND status = 'running'",
        (f"{CLAIM_TESTS}::test_every_fenced_write_of_a_boot_that_lost_its_claim_is_refused",),
        nth=2, occurrences=3,
    ),
    Mutant(
        "retry_unfenced",
        "scheduling a retry is fenced by the claim",
        CLAIMS, "AND status = 'running' AND claimed_by = ANY(:boots)",
        "AND status = 'running'",
        (f"{CLAIM_TESTS}::test_every_fenced_write_of_a_boot_that_lost_its_claim_is_refused",),
        nth=3, occurrences=3,
    ),
    Mutant(
        "takeover_ignores_cancel",
        "a cancelled run whose worker died ends cancelled, never resumed",
        CLAIMS, "SET status = CASE WHEN cancel_requested THEN 'cancelled'\n",
        "SET status = CASE WHEN false THEN 'cancelled'\n",
        (f"{CLAIM_TESTS}::test_taking_over_a_cancelled_run_ends_it_cancelled",),
    ),
    Mutant(
        "takeovers_unbounded",
        "a run that keeps killing workers fails worker_lost after max_takeovers",
        CLAIMS, "                         WHEN takeovers >= :max_takeovers THEN 'failed'\n",
        "",
        (f"{CLAIM_TESTS}::test_a_run_that_outlived_max_takeovers_workers_fails_worker_lost",),
    ),
    # -- boots --------------------------------------------------------------------------------
    Mutant(
        "boot_always_usable",
        "a boot that lost its lock is not used again",
        "workers/boots.py",
        "return (self.pid == os.getpid() and not self.lost.is_set() and not self.conn.closed\n"
        "                and not self.conn.broken)",
        "return True",
        (f"{CLAIM_TESTS}::test_the_watchdog_notices_a_lock_cut_server_side_and_a_new_boot_claims",),
    ),
    Mutant(
        "watchdog_trusts_the_client",
        "the watchdog asks Postgres, not psycopg, whether the lock is held",
        "workers/boots.py",
        "        if boot.probe():\n            continue\n",
        "        if not boot.conn.closed and not boot.conn.broken:\n            continue\n",
        (f"{CLAIM_TESTS}::test_the_watchdog_notices_a_lock_cut_server_side_and_a_new_boot_claims",),
    ),
    Mutant(
        "unrecordable_outcome_keeps_the_boot",
        "a claim whose outcome cannot be recorded ends the boot (the run becomes wreckage)",
        "workers/execution.py",
        "        _rollback()\n        end_current_boot()\n        raise\n    finally:",
        "        _rollback()\n        raise\n    finally:",
        (f"{CLAIM_TESTS}::test_a_run_whose_outcome_cannot_be_recorded_ends_the_boot",),
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
    # -- unfenced run transitions -------------------------------------------------------------
    Mutant(
        "cancel_misses_a_requeued_run",
        "cancel is one statement: a run requeued under it is still cancelled",
        "app/runs.py",
        "AND status IN ('{RunStatus.QUEUED}', '{RunStatus.RUNNING}')",
        "AND status = '{RunStatus.RUNNING}'",
        ("tests/app/test_runs.py::test_cancel_racing_a_release_still_cancels",),
    ),
    # -- the inbox ----------------------------------------------------------------------------
    Mutant(
        "inbox_commits_past_unfinished_work",
        "the inbox commits an offset only past messages that are all done",
        "bridge/inbox.py",
        "        while self.slots and self.slots[0].state is SlotState.DONE:\n"
        "            self.commit_offset = self.slots.popleft().message.offset() + 1",
        "        self.commit_offset = max(self.commit_offset or 0, slot.message.offset() + 1)",
        ("tests/bridge/test_partition_work.py::"
         "test_commit_waits_for_the_oldest_message_when_later_ones_finish_first",),
    ),
    Mutant(
        "inbox_keyless_message_gets_no_key",
        "a message without dispatch_key is admitted under kafka:<topic>:<partition>:<offset>",
        "bridge/inbox_faults.py",
        '    if body.get("dispatch_key") is not None:\n        return value, False\n',
        "    return value, False\n",
        ("tests/bridge/test_inbox_hostile.py::"
         "test_keyless_messages_stay_one_run_each_after_redelivery",),
    ),
    Mutant(
        "inbox_retries_its_own_bugs_forever",
        "a message our code keeps raising on is dead-lettered, never stalls its partition",
        "bridge/inbox.py",
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
]
