-- The statements of app/state/claims.py, each bound to the constant of its name in capitals
-- (``-- name: admit`` is ``ADMIT``). The parts many statements share: README.md.

-- name: claim_queued
-- The one-statement claim: ``queued`` -> ``running`` under this boot, with its
-- ``run.started`` event, if the run is due, not cancelled and not expired (a run never
-- started whose ``expires_at`` passed: ``poimen_expire`` ends it). Liveness is part of it: the
-- claiming boot must hold its lock *in the same statement* (a process whose lock vanished
-- may not know yet; Postgres does, and refuses). A run of a limited group (its workflow's
-- limit, its tenant's cap) or under a rate limit (its workflow's, its tenant's) is refused
-- here and claimed with ``poimen_claim_slot``.
-- Returns everything the worker needs to run the workflow (the run's columns, its pinned
-- definition hash, its latest step entry, created_at and started_at for the queue wait,
-- its trace context), so executing a run costs no extra read.
WITH  changed AS (
UPDATE runs
   SET status = 'running', claimed_by = :boot, attempt = attempt + 1, wait_reason = NULL,
       started_at = coalesce(started_at, now()), updated_at = now()
 WHERE id = :run AND (runs.status || '') = 'queued' AND NOT cancel_requested
   AND (not_before IS NULL OR not_before <= now())
   AND (expires_at IS NULL OR expires_at > now() OR started_at IS NOT NULL)
   AND EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = :boot AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key))
   AND concurrency_limit IS NULL AND rate_interval IS NULL
   AND NOT EXISTS (SELECT 1 FROM tenants t WHERE t.id = runs.tenant_id
                      AND (t.max_running IS NOT NULL OR t.rate_interval IS NOT NULL))
 RETURNING id, tenant_id, attempt, workflow_name, workflow_version, input, failures, cancel_requested, concurrency_key, concurrency_limit, goal_id, definition_hash, created_at, started_at, traceparent, tracestate, (SELECT to_jsonb(e) FROM step_entries e WHERE e.run_id = runs.id ORDER BY e.entry_no DESC LIMIT 1) AS last_entry),
    event AS (
    INSERT INTO outbox (tenant_id, run_id, event_type, payload)
    SELECT tenant_id, id, 'run.started',
           jsonb_build_object('run_id', (id)::text, 'type', 'run.started') || jsonb_build_object('attempt', attempt)
      FROM changed
     WHERE true

)

    SELECT * FROM changed;

-- name: claim_queued_batch
-- The batching worker's claim (docs/internals/batching.md): ``claim_queued`` for many runs
-- of one boot in one statement and one commit, each row decided alone by the same
-- compare-and-set (``queued``, due, not cancelled, not expired, no limit) and the same
-- liveness of the claiming boot, in this statement. Returns the rows it claimed, each
-- with its ``run.started`` event; a run it did not return was not claimed (a duplicate,
-- a run waiting, finished, not due, or under a limit), and its delivery asks why on the
-- single-run path (``claim_run``). The runs are locked in the primary key's order (an
-- index scan over the sorted array), so two batches never wait on each other in a circle.
WITH changed AS (
UPDATE runs
   SET status = 'running', claimed_by = :boot, attempt = attempt + 1, wait_reason = NULL,
       started_at = coalesce(started_at, now()), updated_at = now()
 WHERE id = ANY(CAST(:runs AS uuid[])) AND (runs.status || '') = 'queued'
   AND NOT cancel_requested
   AND (not_before IS NULL OR not_before <= now())
   AND (expires_at IS NULL OR expires_at > now() OR started_at IS NOT NULL)
   AND EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = :boot
                  AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key))
   AND concurrency_limit IS NULL AND rate_interval IS NULL
   AND NOT EXISTS (SELECT 1 FROM tenants t WHERE t.id = runs.tenant_id
                      AND (t.max_running IS NOT NULL OR t.rate_interval IS NOT NULL))
 RETURNING id, tenant_id, attempt, workflow_name, workflow_version, input, failures,
           cancel_requested, concurrency_key, concurrency_limit, goal_id, definition_hash,
           created_at, started_at, traceparent, tracestate,
           (SELECT to_jsonb(e) FROM step_entries e WHERE e.run_id = runs.id
             ORDER BY e.entry_no DESC LIMIT 1) AS last_entry),
     event AS (
INSERT INTO outbox (tenant_id, run_id, event_type, payload)
SELECT tenant_id, id, 'run.started',
       jsonb_build_object('run_id', (id)::text, 'type', 'run.started')
       || jsonb_build_object('attempt', attempt)
  FROM changed)
SELECT * FROM changed;

-- name: poimen_rate_start
-- A run's start under its rate limits (README.md, "Rate limits"), or NULL when none applies:
-- no limit names it, or this is no first start (a retry, a join's resumption: ``started_at``
-- is set). Its scopes are its tenant's (``t:<tenant>``, ``tenants.rate_interval``) and its
-- workflow's key's (``w:<tenant>|<workflow>|<rate_key>``, ``runs.rate_interval``, pinned at
-- admission). Each scope keeps, in ``rate_slots``, ``last_start`` (the latest start taken)
-- and ``next_start`` (the end of the line of starts reserved). Under the scopes' row locks
-- (taken in scope order) the clock is read (``clock_timestamp()``: a claim that waited for
-- the locks, or whose transaction began earlier, never starts at a time already past), and:
-- * the start may be now only if it is at least each scope's interval after its
--   ``last_start``: no two starts of a scope are closer than its interval, however many
--   claim at once and however late a reserved run comes;
-- * a run that holds no reservation joins the end of the line (``next_start``), which then
--   moves one interval on: reserved in the order the claims take the locks (FIFO);
-- * a run that holds one (``wait_reason = 'rate_limit'``, due) keeps its place: it starts now
--   unless a late start came within the interval, and then its start moves to the earliest
--   the spacing allows.
-- A start now becomes ``last_start``. Returns the start and whether it is reserved (no row
-- when no limit applies, or ``p_run`` is NULL: ``poimen_claim_slot`` passes NULL for a run
-- that waits for a slot, which takes no start).
CREATE OR REPLACE FUNCTION poimen_rate_start(
    p_run uuid
) RETURNS TABLE (start timestamptz, reserved boolean) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_scopes text[];
    v_intervals float8[];
    v_reserved boolean;
    v_clock timestamptz;
    v_start timestamptz;
BEGIN
    IF p_run IS NULL THEN
        RETURN;
    END IF;
    SELECT array_agg(s.scope ORDER BY s.scope), array_agg(s.secs ORDER BY s.scope),
           bool_or(r.wait_reason IS NOT DISTINCT FROM 'rate_limit')
      INTO v_scopes, v_intervals, v_reserved
      FROM runs r JOIN tenants t ON t.id = r.tenant_id,
           LATERAL (VALUES ('t:' || CAST(r.tenant_id AS text), t.rate_interval),
                           ('w:' || CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|'
                                 || coalesce(r.rate_key, ''), r.rate_interval)) AS s(scope, secs)
     WHERE r.id = p_run AND r.started_at IS NULL AND s.secs IS NOT NULL;
    IF v_scopes IS NULL THEN
        RETURN;
    END IF;
    -- A scope's first claim makes its row (a row that exists is not inserted again, so
    -- nothing waits here on a claim that holds it: the row lock below is the one wait).
    INSERT INTO rate_slots (scope, next_start, last_start)
    SELECT u.scope, '-infinity', '-infinity' FROM unnest(v_scopes) AS u(scope)
     WHERE NOT EXISTS (SELECT 1 FROM rate_slots s WHERE s.scope = u.scope)
    ON CONFLICT DO NOTHING;
    PERFORM 1 FROM rate_slots s WHERE s.scope = ANY(v_scopes) ORDER BY s.scope FOR UPDATE;
    v_clock := clock_timestamp();
    v_start := (SELECT greatest(v_clock,
                                max(s.last_start + make_interval(secs => u.secs)),
                                CASE WHEN v_reserved THEN v_clock ELSE max(s.next_start) END)
                  FROM rate_slots s JOIN unnest(v_scopes, v_intervals) AS u(scope, secs)
                    ON u.scope = s.scope);
    UPDATE rate_slots s
       SET last_start = CASE WHEN v_start <= v_clock THEN v_start ELSE s.last_start END,
           next_start = CASE WHEN v_reserved THEN s.next_start
                             ELSE v_start + make_interval(secs => u.secs) END
      FROM unnest(v_scopes, v_intervals) AS u(scope, secs)
     WHERE s.scope = u.scope;
    RETURN QUERY SELECT v_start, v_start > v_clock;
END
$body$;

-- name: poimen_claim_slot
-- CLAIM_SLOT, after the run's slot locks, as one call (README.md, "Store functions").
-- The claim of a run of a limited group: its ``me`` part is the run (due, the claimer
-- live), ``verdict`` the slot it may not take (``reason``, NULL if it may): its tenant's
-- cap first, then its group's limit. Slots held by live boots count, and so do older runs
-- of the group that want one (queued and due, or waiting for a slot), so a newcomer never
-- overtakes them. Each count is a sum over one status at a time (a run has one status, so
-- the parts never overlap), each reading only its own rows through the slot indexes
-- (README.md, "Status tests that choose the index"). The count and the claim are one
-- statement on a snapshot taken after the locks. No slot: the run waits (``waiting``,
-- ``wait_reason``), unclaimed, holding no worker.
-- A run with a slot (or of no limited group) then takes its start under its rate limits
-- (``decided``: ``poimen_rate_start``, only for a run the verdict lets start, so a run
-- that waits for a slot uses no start; not called for a run under no rate limit). A start still to come is reserved for it: it stays
-- ``queued`` with ``not_before`` at its start and ``wait_reason = 'rate_limit'``
-- (``run.waiting``), holding no worker; its claim when due keeps its place in the line (and
-- is put off again, with another ``run.waiting``, only if a late start came too close). A start
-- less than 2 s away counts as sent (``last_sent_at = not_before``): the worker that got
-- it sends the run for then; a later one is beat's (``release_due``, ``workers/timers.py``).
CREATE OR REPLACE FUNCTION poimen_claim_slot(
    p_run uuid, p_boot uuid
) RETURNS TABLE (
    id runs.id%TYPE, tenant_id runs.tenant_id%TYPE, attempt runs.attempt%TYPE,
    workflow_name runs.workflow_name%TYPE, workflow_version runs.workflow_version%TYPE,
    input runs.input%TYPE, failures runs.failures%TYPE,
    cancel_requested runs.cancel_requested%TYPE,
    concurrency_key runs.concurrency_key%TYPE,
    concurrency_limit runs.concurrency_limit%TYPE, goal_id runs.goal_id%TYPE,
    definition_hash runs.definition_hash%TYPE, created_at runs.created_at%TYPE,
    started_at runs.started_at%TYPE, traceparent runs.traceparent%TYPE,
    tracestate runs.tracestate%TYPE, last_entry jsonb, status runs.status%TYPE,
    wait_reason runs.wait_reason%TYPE, not_before runs.not_before%TYPE,
    last_sent_at runs.last_sent_at%TYPE
) LANGUAGE plpgsql VOLATILE AS $body$
#variable_conflict use_column
BEGIN
    PERFORM poimen_lock_slots(p_run);
    RETURN QUERY WITH 
    me AS (
        SELECT r.id, r.tenant_id, r.workflow_name, r.concurrency_key, r.concurrency_limit,
               r.created_at, t.max_running,
               r.rate_interval IS NOT NULL OR t.rate_interval IS NOT NULL AS rated
          FROM runs r JOIN tenants t ON t.id = r.tenant_id
         WHERE r.id = p_run AND (r.status || '') = 'queued' AND NOT r.cancel_requested AND (r.not_before IS NULL OR r.not_before <= now()) AND (r.expires_at IS NULL OR r.expires_at > now() OR r.started_at IS NOT NULL) AND EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = p_boot AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key))
    ),
    verdict AS (
        SELECT CASE
               WHEN me.max_running IS NOT NULL AND (
                    (SELECT count(*) FROM runs r WHERE CAST(r.tenant_id AS text) = CAST(me.tenant_id AS text) AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'running' AND NOT EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = r.claimed_by AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds)))
                    + (SELECT count(*) FROM runs r WHERE CAST(r.tenant_id AS text) = CAST(me.tenant_id AS text) AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'queued' AND NOT r.cancel_requested AND (r.not_before IS NULL OR r.not_before <= now()) AND (r.created_at, r.id) < (me.created_at, me.id))
                    + (SELECT count(*) FROM runs r WHERE CAST(r.tenant_id AS text) = CAST(me.tenant_id AS text) AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'waiting' AND r.wait_reason IN ('tenant_cap') AND (r.created_at, r.id) < (me.created_at, me.id))) >= me.max_running
               THEN 'tenant_cap'
               WHEN me.concurrency_limit IS NOT NULL AND (
                    (SELECT count(*) FROM runs r WHERE (CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|' || coalesce(r.concurrency_key, '')) = (CAST(me.tenant_id AS text) || '|' || me.workflow_name || '|' || coalesce(me.concurrency_key, '')) AND r.concurrency_limit IS NOT NULL AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'running' AND NOT EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = r.claimed_by AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds)))
                    + (SELECT count(*) FROM runs r WHERE (CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|' || coalesce(r.concurrency_key, '')) = (CAST(me.tenant_id AS text) || '|' || me.workflow_name || '|' || coalesce(me.concurrency_key, '')) AND r.concurrency_limit IS NOT NULL AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'queued' AND NOT r.cancel_requested AND (r.not_before IS NULL OR r.not_before <= now()) AND (r.created_at, r.id) < (me.created_at, me.id))
                    + (SELECT count(*) FROM runs r WHERE (CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|' || coalesce(r.concurrency_key, '')) = (CAST(me.tenant_id AS text) || '|' || me.workflow_name || '|' || coalesce(me.concurrency_key, '')) AND r.concurrency_limit IS NOT NULL AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'waiting' AND r.wait_reason IN ('concurrency', 'tenant_cap') AND (r.created_at, r.id) < (me.created_at, me.id))) >= me.concurrency_limit
               THEN 'concurrency'
               END AS reason
          FROM me
    ), decided AS (
        SELECT v.reason, s.start, CASE WHEN s.reserved THEN s.start END AS reserved
          FROM me CROSS JOIN verdict v
               LEFT JOIN LATERAL poimen_rate_start(
                   CASE WHEN v.reason IS NULL AND me.rated THEN p_run END) AS s ON true
    ), changed AS (
    UPDATE runs
       SET status = CASE WHEN d.reason IS NOT NULL THEN 'waiting'
                         WHEN d.reserved IS NOT NULL THEN 'queued' ELSE 'running' END,
           wait_reason = CASE WHEN d.reserved IS NOT NULL THEN 'rate_limit' ELSE d.reason END,
           not_before = coalesce(d.reserved, not_before),
           last_sent_at = CASE WHEN d.reserved <= clock_timestamp() + interval '2 seconds'
                               THEN d.reserved ELSE last_sent_at END,
           claimed_by = CASE WHEN d.reason IS NULL AND d.reserved IS NULL
                             THEN CAST(p_boot AS uuid) END,
           attempt = attempt + CASE WHEN d.reason IS NULL AND d.reserved IS NULL THEN 1 ELSE 0 END,
           started_at = CASE WHEN d.reason IS NULL AND d.reserved IS NULL
                             THEN coalesce(started_at, d.start, now()) ELSE started_at END,
           updated_at = now()
      FROM decided d
     WHERE runs.id = p_run AND (runs.status || '') = 'queued' AND NOT runs.cancel_requested
     RETURNING id, tenant_id, attempt, workflow_name, workflow_version, input, failures, cancel_requested, concurrency_key, concurrency_limit, goal_id, definition_hash, created_at, started_at, traceparent, tracestate, (SELECT to_jsonb(e) FROM step_entries e WHERE e.run_id = runs.id ORDER BY e.entry_no DESC LIMIT 1) AS last_entry, status, wait_reason, not_before, last_sent_at),
        event AS (
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT tenant_id, id, CASE status WHEN 'running' THEN 'run.started' ELSE 'run.waiting' END,
               jsonb_build_object('run_id', (id)::text, 'type', CASE status WHEN 'running' THEN 'run.started' ELSE 'run.waiting' END) || jsonb_build_object('attempt', attempt) || CASE WHEN status = 'waiting' THEN jsonb_build_object('reason', wait_reason) WHEN status = 'queued' THEN jsonb_build_object('reason', wait_reason, 'not_before', not_before) ELSE '{}' END
          FROM changed
         WHERE true
         
    )
        
        SELECT * FROM changed;
END
$body$;

-- name: poimen_slot_verdict
-- The slot a held run may not keep (``reason``, NULL if it may), after its slot locks: its
-- tenant's cap first, then its group's limit. Counted are the slots held by live boots
-- (README.md, "Status tests that choose the index"), the run's own not among them (its
-- lost holder's slot is not counted against it). A takeover and an adoption of a run of a
-- limited group decide with it.
CREATE OR REPLACE FUNCTION poimen_slot_verdict(
    p_run uuid
) RETURNS TABLE (reason text) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
BEGIN
    RETURN QUERY WITH
    me AS (
        SELECT r.id, r.tenant_id, r.workflow_name, r.concurrency_key, r.concurrency_limit,
               r.created_at, t.max_running
          FROM runs r JOIN tenants t ON t.id = r.tenant_id WHERE r.id = p_run
    )
    SELECT CASE
           WHEN me.max_running IS NOT NULL AND (
                (SELECT count(*) FROM runs r WHERE CAST(r.tenant_id AS text) = CAST(me.tenant_id AS text) AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'running' AND NOT EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = r.claimed_by AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds)) AND r.id <> me.id)) >= me.max_running
           THEN 'tenant_cap'
           WHEN me.concurrency_limit IS NOT NULL AND (
                (SELECT count(*) FROM runs r WHERE (CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|' || coalesce(r.concurrency_key, '')) = (CAST(me.tenant_id AS text) || '|' || me.workflow_name || '|' || coalesce(me.concurrency_key, '')) AND r.concurrency_limit IS NOT NULL AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'running' AND NOT EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = r.claimed_by AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds)) AND r.id <> me.id)) >= me.concurrency_limit
           THEN 'concurrency'
           END
      FROM me;
END
$body$;

-- name: poimen_take_over
-- Wreckage: the holder is dead. A compare-and-set on the dead boot (``claimed_by =
-- :dead``), by a live claimer, once the holder is *gone* (``app/liveness.py``: its lock
-- first seen free its bound ago, so its body has stopped). A cancelled run ends cancelled
-- instead of being resumed (a cancel wins over the bound); a run that has already outlived
-- ``:max_takeovers`` workers ends ``poisoned`` (its executions are what kills them: OOM, a
-- segfault, os._exit), not resumed again; else it resumes (``run.resumed``, the attempt and
-- the lost worker counted). A run it ends counts for its parent's join (``poimen_ended``).
-- A run of a limited group is taken over after its slot locks (``poimen_lock_slots``): it
-- resumes only if a slot is free (``poimen_slot_verdict``: another run may have taken the
-- dead holder's); else it waits, unclaimed (``waiting``), with the lost worker counted. A
-- run of a limited group it ends hands its slot on.
CREATE OR REPLACE FUNCTION poimen_take_over(
    p_run uuid, p_boot uuid, p_dead uuid, p_max_takeovers integer
) RETURNS TABLE (
    id runs.id%TYPE, tenant_id runs.tenant_id%TYPE, attempt runs.attempt%TYPE,
    workflow_name runs.workflow_name%TYPE, workflow_version runs.workflow_version%TYPE,
    input runs.input%TYPE, failures runs.failures%TYPE,
    cancel_requested runs.cancel_requested%TYPE,
    concurrency_key runs.concurrency_key%TYPE,
    concurrency_limit runs.concurrency_limit%TYPE, goal_id runs.goal_id%TYPE,
    definition_hash runs.definition_hash%TYPE, created_at runs.created_at%TYPE,
    started_at runs.started_at%TYPE, traceparent runs.traceparent%TYPE,
    tracestate runs.tracestate%TYPE, last_entry jsonb, status runs.status%TYPE,
    takeovers runs.takeovers%TYPE, error runs.error%TYPE,
    wait_reason runs.wait_reason%TYPE, woken jsonb
) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_locks integer;
    v_reason text;
    v_run runs%ROWTYPE;
BEGIN
    v_locks := poimen_lock_slots(p_run);
    IF v_locks > 0 THEN
        v_reason := (SELECT v.reason FROM poimen_slot_verdict(p_run) AS v);
    END IF;
    UPDATE runs
       SET status = CASE WHEN cancel_requested THEN 'cancelled'
                         WHEN takeovers >= p_max_takeovers THEN 'poisoned'
                         WHEN v_reason IS NOT NULL THEN 'waiting'
                         ELSE 'running' END,
           claimed_by = CASE WHEN v_reason IS NULL OR cancel_requested OR takeovers >= p_max_takeovers THEN p_boot END,
           attempt = attempt + CASE WHEN cancel_requested OR takeovers >= p_max_takeovers OR v_reason IS NOT NULL
                                    THEN 0 ELSE 1 END,
           takeovers = takeovers + CASE WHEN cancel_requested OR takeovers >= p_max_takeovers
                                        THEN 0 ELSE 1 END,
           error = CASE WHEN NOT cancel_requested AND takeovers >= p_max_takeovers
                        THEN jsonb_build_object(
                            'code', 'poisoned', 'type', 'poimen.Poisoned',
                            'message', 'the run killed ' || (takeovers + 1) || ' workers '
                                       || '(max_takeovers ' || p_max_takeovers || '): '
                                       || 'poisoned, it is not resumed again',
                            'traceback', '')
                        ELSE error END,
           finished_at = CASE WHEN cancel_requested OR takeovers >= p_max_takeovers
                              THEN now() ELSE finished_at END,
           wait_reason = CASE WHEN cancel_requested OR takeovers >= p_max_takeovers THEN NULL
                              ELSE v_reason END,
           updated_at = now()
     WHERE id = p_run AND (runs.status || '') = 'running' AND claimed_by = p_dead AND EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = p_boot AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key))
       AND EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = p_dead AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds))
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO outbox (tenant_id, run_id, event_type, payload)
    SELECT v_run.tenant_id, v_run.id, e.type,
           jsonb_build_object('run_id', (v_run.id)::text, 'type', e.type) || jsonb_build_object('attempt', v_run.attempt) || jsonb_build_object('previous_boot', CAST(p_dead AS text)) || CASE WHEN v_run.status = 'poisoned' THEN jsonb_build_object('error', v_run.error) ELSE '{}' END || CASE WHEN v_run.status = 'waiting' THEN jsonb_build_object('reason', v_run.wait_reason) ELSE '{}' END
      FROM (SELECT CASE v_run.status WHEN 'running' THEN 'run.resumed' ELSE 'run.' || v_run.status END) AS e(type);
    RETURN QUERY SELECT v_run.id, v_run.tenant_id, v_run.attempt, v_run.workflow_name,
                        v_run.workflow_version, v_run.input, v_run.failures,
                        v_run.cancel_requested, v_run.concurrency_key, v_run.concurrency_limit,
                        v_run.goal_id, v_run.definition_hash, v_run.created_at,
                        v_run.started_at, v_run.traceparent, v_run.tracestate,
                        (SELECT to_jsonb(e) FROM step_entries e WHERE e.run_id = v_run.id ORDER BY e.entry_no DESC LIMIT 1),
                        v_run.status, v_run.takeovers, v_run.error, v_run.wait_reason,
                        CASE WHEN v_run.status IN ('succeeded', 'failed', 'cancelled', 'poisoned', 'expired')
                             THEN (SELECT e.woken FROM poimen_ended(
                                       ARRAY[v_run.id],
                                       CASE WHEN v_locks > 0 THEN ARRAY[v_run.id] ELSE '{}' END) AS e)
                             ELSE '[]'::jsonb END;
END
$body$;

-- name: adopt
-- The process that lost its lock is still executing the run and registered a new
-- boot: it moves its own claim over (``run.adopted``), a compare-and-set on the dead boot,
-- for a live new boot, unless someone took the run over first.
-- A run of a limited group (after ``poimen_lock_slots``) keeps its slot only if it is still
-- free (``poimen_slot_verdict``, NULL for a run of no limited group): while its boot was
-- dead the slot was free, and another run may have it.
WITH  changed AS (
UPDATE runs SET claimed_by = :boot, updated_at = now()
 WHERE id = :run AND (runs.status || '') = 'running' AND claimed_by = :dead AND EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = :boot AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key))
   AND (SELECT v.reason FROM poimen_slot_verdict(:run) AS v) IS NULL
 RETURNING id, tenant_id, attempt, workflow_name, workflow_version, input, failures, cancel_requested, concurrency_key, concurrency_limit),
    event AS (
    INSERT INTO outbox (tenant_id, run_id, event_type, payload)
    SELECT tenant_id, id, 'run.adopted',
           jsonb_build_object('run_id', (id)::text, 'type', 'run.adopted') || jsonb_build_object('previous_boot', CAST(:dead AS text))
      FROM changed
     WHERE true

)

    SELECT * FROM changed;

-- name: poimen_finish
-- A run's end, fenced by the claim (held by one of ``:boots``), with its last step entry
-- and their events, in one call: one round trip, in autocommit (README.md, "Slot
-- functions"). In order, each statement seeing the ones before:
-- the run's slot locks (``poimen_lock_slots``: none for a run of no limited group); the run
-- ends, fenced; its last entry (``entry_mode``): ``none``, no entry to write; ``insert``,
-- the entry needed no row while it ran and is written now (with its ``step.entered``);
-- ``close``, its row is closed, and the run ends only if that entry is still open; the
-- events ``step.entered``, ``step.<status>``, ``run.<status>``, in that order, in one
-- INSERT; then what the end sets off (``poimen_ended``): it counts for its parent's join,
-- and a run that took its slot locks hands its slot on. Returns the ended run and the
-- runs it re-queued (``woken``).
CREATE OR REPLACE FUNCTION poimen_finish(
    p_status text, p_result text, p_error text, p_failed integer, p_run uuid,
    p_boots uuid[], p_event_type text, p_event_extra text, p_entry_mode text,
    p_entry bigint, p_entry_no integer, p_step text, p_entry_status text,
    p_actions text, p_outputs text, p_entry_error text, p_next_step text,
    p_events boolean, p_entry_event text
) RETURNS TABLE (
    id runs.id%TYPE, tenant_id runs.tenant_id%TYPE, attempt runs.attempt%TYPE,
    workflow_name runs.workflow_name%TYPE, workflow_version runs.workflow_version%TYPE,
    input runs.input%TYPE, failures runs.failures%TYPE,
    cancel_requested runs.cancel_requested%TYPE,
    concurrency_key runs.concurrency_key%TYPE,
    concurrency_limit runs.concurrency_limit%TYPE, status runs.status%TYPE, woken jsonb
) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_locks integer;
    v_run runs%ROWTYPE;
    v_entry step_entries%ROWTYPE;
    v_woken jsonb;
BEGIN
    v_locks := poimen_lock_slots(p_run);
    UPDATE runs
       SET status = p_status, result = CAST(p_result AS jsonb), error = CAST(p_error AS jsonb),
           finished_at = now(), updated_at = now(), failures = failures + p_failed
     WHERE id = p_run AND (runs.status || '') = 'running' AND claimed_by = ANY(p_boots)
       AND (p_entry_mode <> 'close'
            OR EXISTS (SELECT 1 FROM step_entries e WHERE e.id = p_entry AND e.run_id = p_run
                       AND e.status IN ('running', 'waiting')))
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_entry_mode = 'insert' THEN
        INSERT INTO step_entries (run_id, entry_no, step_id, status, actions, outputs, error,
                                  next_step, finished_at)
        VALUES (v_run.id, p_entry_no, p_step, p_entry_status, CAST(p_actions AS jsonb),
                CAST(p_outputs AS jsonb), CAST(p_entry_error AS jsonb), p_next_step, now())
        RETURNING * INTO v_entry;
    ELSIF p_entry_mode = 'close' THEN
        UPDATE step_entries e
           SET status = p_entry_status, actions = CAST(p_actions AS jsonb),
               outputs = CAST(p_outputs AS jsonb), error = CAST(p_entry_error AS jsonb),
               next_step = p_next_step, finished_at = now()
         WHERE e.id = p_entry AND e.status IN ('running', 'waiting')
        RETURNING e.* INTO v_entry;
    END IF;
    INSERT INTO outbox (tenant_id, run_id, event_type, payload)
    SELECT v_run.tenant_id, v_run.id, e.type,
           jsonb_build_object('run_id', (v_run.id)::text, 'type', e.type) || e.fields
      FROM (SELECT 1, 'step.entered', jsonb_build_object('step', v_entry.step_id, 'entry', v_entry.entry_no, 'entry_id', v_entry.id) WHERE p_entry_mode = 'insert' AND v_entry.id IS NOT NULL AND p_events
            UNION ALL SELECT 2, p_entry_event, jsonb_build_object('step', v_entry.step_id, 'entry', v_entry.entry_no, 'entry_id', v_entry.id) || jsonb_build_object('next_step', v_entry.next_step) || CASE WHEN v_entry.error IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('error', v_entry.error - 'traceback') END WHERE v_entry.id IS NOT NULL AND p_events
            UNION ALL SELECT 3, p_event_type, jsonb_build_object('attempt', v_run.attempt) || coalesce(CAST(p_event_extra AS jsonb), '{}'::jsonb)) AS e(ord, type, fields)
     ORDER BY e.ord;
    IF v_locks > 0 OR EXISTS (SELECT 1 FROM step_children c WHERE c.child_run_id = v_run.id)
    THEN
        v_woken := (SELECT e.woken FROM poimen_ended(
                        ARRAY[v_run.id], CASE WHEN v_locks > 0 THEN ARRAY[v_run.id] ELSE '{}' END)
                    AS e);
    ELSE
        v_woken := '[]';  -- no slot to hand on, no join to count: nothing to set off
    END IF;
    RETURN QUERY SELECT v_run.id, v_run.tenant_id, v_run.attempt, v_run.workflow_name,
                        v_run.workflow_version, v_run.input, v_run.failures,
                        v_run.cancel_requested, v_run.concurrency_key, v_run.concurrency_limit,
                        v_run.status, v_woken;
END
$body$;

-- name: poimen_finish_batch
-- The batching worker's finish (docs/internals/batching.md): the ends of many runs in one
-- call, one statement and one commit for all of them. Each argument but ``p_boots`` is an
-- array of ``poimen_finish``'s, one element per run, in run-id order (the caller sorts);
-- ``p_boots`` are this process's boots that hold any run of the batch (each a boot of
-- this process: a run another process took over is refused as on its own). Returns one row
-- per run ended, with its position in the arrays (``n``, 1-based); a refused run has no
-- row. One error (a value ``jsonb`` refuses) fails the whole statement: the worker then
-- ends each run on the single-run path, so only the bad one fails.
-- Two ways, the same ends:
-- * A batch of which no run sets anything off (no run of a limited group or of a capped
--   tenant: no slot to lock and hand on; no fan-out's child: no join to count) is ended
--   set-wise: one UPDATE ends every run of it, fenced row by row as ``poimen_finish``
--   fences one, and the entries and the events of all of them are one INSERT each, each
--   run's events in ``poimen_finish``'s order. No end of such a batch reads another's. The
--   rows are locked in the arrays' order (a nested loop over the primary key): id order.
-- * Any other batch is ended run by run: ``poimen_finish`` for each run, in the arrays'
--   order, each end seeing the ends before it, so two children of one join that end in
--   one batch count twice and wake their parent once, and a run's freed slot is handed on.
CREATE OR REPLACE FUNCTION poimen_finish_batch(
    p_status text[], p_result text[], p_error text[], p_failed integer[], p_run uuid[],
    p_boots uuid[], p_event_type text[], p_event_extra text[], p_entry_mode text[],
    p_entry bigint[], p_entry_no integer[], p_step text[], p_entry_status text[],
    p_actions text[], p_outputs text[], p_entry_error text[], p_next_step text[],
    p_events boolean[], p_entry_event text[]
) RETURNS TABLE (n integer, id runs.id%TYPE, status runs.status%TYPE, woken jsonb)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
BEGIN
    IF EXISTS (SELECT 1 FROM runs r JOIN tenants t ON t.id = r.tenant_id
                WHERE r.id = ANY(p_run)
                  AND (r.concurrency_limit IS NOT NULL OR t.max_running IS NOT NULL))
       OR EXISTS (SELECT 1 FROM step_children c WHERE c.child_run_id = ANY(p_run)) THEN
        FOR i IN 1 .. coalesce(cardinality(p_run), 0) LOOP
            RETURN QUERY SELECT i, f.id, f.status, f.woken
              FROM poimen_finish(p_status[i], p_result[i], p_error[i], p_failed[i], p_run[i],
                             p_boots, p_event_type[i], p_event_extra[i], p_entry_mode[i],
                             p_entry[i], p_entry_no[i], p_step[i], p_entry_status[i],
                             p_actions[i], p_outputs[i], p_entry_error[i], p_next_step[i],
                             p_events[i], p_entry_event[i]) AS f;
        END LOOP;
        RETURN;
    END IF;
    RETURN QUERY
    WITH b AS (
        SELECT * FROM unnest(p_run, p_status, p_result, p_error, p_failed, p_event_type,
                             p_event_extra, p_entry_mode, p_entry, p_entry_no, p_step,
                             p_entry_status, p_actions, p_outputs, p_entry_error, p_next_step,
                             p_events, p_entry_event)
               WITH ORDINALITY AS b(run, status, result, error, failed, event_type,
                                    event_extra, entry_mode, entry, entry_no, step,
                                    entry_status, actions, outputs, entry_error, next_step,
                                    events, entry_event, n)),
    ended AS (
        UPDATE runs r
           SET status = b.status, result = CAST(b.result AS jsonb),
               error = CAST(b.error AS jsonb), finished_at = now(), updated_at = now(),
               failures = r.failures + b.failed
          FROM b
         WHERE r.id = b.run AND (r.status || '') = 'running' AND r.claimed_by = ANY(p_boots)
           AND (b.entry_mode <> 'close'
                OR EXISTS (SELECT 1 FROM step_entries e WHERE e.id = b.entry
                              AND e.run_id = b.run AND e.status IN ('running', 'waiting')))
        RETURNING b.n, r.id, r.tenant_id, r.attempt, r.status, b.entry_mode, b.entry,
                  b.entry_no, b.step, b.entry_status, b.actions, b.outputs, b.entry_error,
                  b.next_step, b.events, b.entry_event, b.event_type, b.event_extra),
    inserted AS (
        INSERT INTO step_entries (run_id, entry_no, step_id, status, actions, outputs, error,
                                  next_step, finished_at)
        SELECT d.id, d.entry_no, d.step, d.entry_status, CAST(d.actions AS jsonb),
               CAST(d.outputs AS jsonb), CAST(d.entry_error AS jsonb), d.next_step, now()
          FROM ended d
         WHERE d.entry_mode = 'insert'
        RETURNING *),
    closed AS (
        UPDATE step_entries e
           SET status = d.entry_status, actions = CAST(d.actions AS jsonb),
               outputs = CAST(d.outputs AS jsonb), error = CAST(d.entry_error AS jsonb),
               next_step = d.next_step, finished_at = now()
          FROM ended d
         WHERE d.entry_mode = 'close' AND e.id = d.entry AND e.status IN ('running', 'waiting')
        RETURNING e.*),
    entries AS (SELECT * FROM inserted UNION ALL SELECT * FROM closed),
    events AS (
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT d.tenant_id, d.id, ev.type,
               jsonb_build_object('run_id', (d.id)::text, 'type', ev.type) || ev.fields
          FROM ended d
          LEFT JOIN entries en ON en.run_id = d.id
         CROSS JOIN LATERAL (
               SELECT 1, 'step.entered', jsonb_build_object('step', en.step_id, 'entry', en.entry_no, 'entry_id', en.id)
                WHERE d.entry_mode = 'insert' AND en.id IS NOT NULL AND d.events
               UNION ALL SELECT 2, d.entry_event, jsonb_build_object('step', en.step_id, 'entry', en.entry_no, 'entry_id', en.id) || jsonb_build_object('next_step', en.next_step) || CASE WHEN en.error IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('error', en.error - 'traceback') END
                WHERE en.id IS NOT NULL AND d.events
               UNION ALL SELECT 3, d.event_type, jsonb_build_object('attempt', d.attempt) || coalesce(CAST(d.event_extra AS jsonb), '{}'::jsonb)
             ) AS ev(ord, type, fields)
         ORDER BY d.n, ev.ord)
    SELECT CAST(d.n AS integer), d.id, d.status, CAST('[]' AS jsonb) FROM ended d;
END
$body$;

-- name: finish_batch_call
-- The call of ``poimen_finish_batch`` with each array typed (an array of NULLs alone has
-- no element type to resolve the function by).
SELECT * FROM poimen_finish_batch(
    CAST(:status AS text[]), CAST(:result AS text[]), CAST(:error AS text[]),
    CAST(:failed AS integer[]), CAST(:run AS uuid[]), CAST(:boots AS uuid[]),
    CAST(:event_type AS text[]), CAST(:event_extra AS text[]), CAST(:entry_mode AS text[]),
    CAST(:entry AS bigint[]), CAST(:entry_no AS integer[]), CAST(:step AS text[]),
    CAST(:entry_status AS text[]), CAST(:actions AS text[]), CAST(:outputs AS text[]),
    CAST(:entry_error AS text[]), CAST(:next_step AS text[]), CAST(:events AS boolean[]),
    CAST(:entry_event AS text[]));

-- name: claimed_in_batch
-- After a batch claim whose outcome was unknown, and once its backend is gone: the runs of
-- ``:runs`` this boot holds, with the claim's columns. A run of the batch is held by its
-- boot only if that batch claimed it (docs/internals/batching.md, "An unknown outcome").
SELECT id, tenant_id, attempt, workflow_name, workflow_version, input, failures,
       cancel_requested, concurrency_key, concurrency_limit, goal_id, definition_hash,
       created_at, started_at, traceparent, tracestate,
       (SELECT to_jsonb(e) FROM step_entries e WHERE e.run_id = runs.id
         ORDER BY e.entry_no DESC LIMIT 1) AS last_entry
  FROM runs
 WHERE id = ANY(CAST(:runs AS uuid[])) AND (runs.status || '') = 'running'
   AND claimed_by = :boot;

-- name: end_backend
-- Ends the backend that ran a batch whose outcome is unknown (our own role's), so that
-- its transaction is over, committed or not, before the runs are read.
SELECT pg_terminate_backend(CAST(:pid AS integer));

-- name: backend_gone
-- Whether that backend has ended: its transaction is decided.
SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = CAST(:pid AS integer));

-- name: poimen_release
-- A run this boot claimed goes back to ``queued`` (a failure before user code started),
-- fenced by the claim: if it was taken over meanwhile, this changes nothing. No user code
-- ran, so the claim's attempt is given back. Its slot goes to the next run waiting
-- (``poimen_ended``, after ``poimen_lock_slots``).
CREATE OR REPLACE FUNCTION poimen_release(
    p_run uuid, p_boots uuid[]
) RETURNS TABLE (id runs.id%TYPE, woken jsonb) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_run runs%ROWTYPE;
BEGIN
    UPDATE runs SET status = 'queued', claimed_by = NULL, updated_at = now(),
           attempt = attempt - 1
     WHERE id = p_run AND (runs.status || '') = 'running' AND claimed_by = ANY(p_boots)
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT v_run.id, poimen_event_ended(v_run, 'run.released', '{}',
                                                     '{}', ARRAY[v_run.id]);
END
$body$;

-- name: poimen_retry
-- A failed attempt goes back to ``queued``, due again in ``:delay`` seconds, fenced by the
-- claim. Its delayed message (the worker sends it) counts as sent when due
-- (``last_sent_at = not_before``): beat's ``release_due``, which sends delayed admissions,
-- leaves it alone, and repair re-sends it only once it is overdue. Its slot goes to the next run waiting (``poimen_ended``, after
-- ``poimen_lock_slots``).
CREATE OR REPLACE FUNCTION poimen_retry(
    p_run uuid, p_boots uuid[], p_delay float8, p_error text
) RETURNS TABLE (id runs.id%TYPE, woken jsonb) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_run runs%ROWTYPE;
BEGIN
    UPDATE runs SET status = 'queued', claimed_by = NULL, failures = failures + 1,
           error = CAST(p_error AS jsonb), updated_at = now(),
           not_before = now() + make_interval(secs => p_delay),
           last_sent_at = now() + make_interval(secs => p_delay)
     WHERE id = p_run AND (runs.status || '') = 'running' AND claimed_by = ANY(p_boots)
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT v_run.id, poimen_event_ended(
        v_run, 'run.retrying', jsonb_build_object('attempt', v_run.attempt)
                               || jsonb_build_object('delay', p_delay, 'error', CAST(p_error AS jsonb)),
        '{}', ARRAY[v_run.id]);
END
$body$;

-- name: claim_state
-- A claim that changed nothing reads why: the run's state and the claimer's liveness.
-- ``expired``: never started, and its ``expires_at`` passed.
-- ``slots``: the run is in a limited group (its workflow's or its tenant's), or under a rate
-- limit: ``poimen_claim_slot`` claims it.
SELECT status, claimed_by, cancel_requested, workflow_name, workflow_version, EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = :boot AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key)) AS claimer_live, (not_before IS NULL OR not_before <= now()) AS due, (expires_at <= now() AND started_at IS NULL) IS TRUE AS expired, (concurrency_limit IS NOT NULL OR rate_interval IS NOT NULL OR EXISTS (SELECT 1 FROM tenants t WHERE t.id = runs.tenant_id AND (t.max_running IS NOT NULL OR t.rate_interval IS NOT NULL))) AS slots FROM runs WHERE id = :run;

-- name: holder
-- Who holds a run (an adoption that changed nothing reads why).
SELECT claimed_by, status FROM runs WHERE id = :run;

-- name: gone_in
-- A holder seen dead and not gone yet: how long until it is (NULL: not seen dead).
SELECT GREATEST(0, CAST(extract(epoch FROM b.first_seen_dead_at + make_interval(secs => b.dead_after_seconds) - now()) AS float8)) FROM worker_boots b WHERE b.boot_id = :boot AND b.first_seen_dead_at IS NOT NULL;
