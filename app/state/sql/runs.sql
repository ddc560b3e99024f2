-- The statements of app/state/runs.py, each bound to the constant of its name in capitals
-- (``-- name: admit`` is ``ADMIT``). The parts many statements share: README.md.

-- name: admit
-- A run is admitted unless its ``(tenant_id, dispatch_key)`` is taken, decided by the
-- partial unique index (ON CONFLICT DO NOTHING), never by a read first; with its
-- ``run.admitted`` event. A miss reads the holder with ``existing``. A fan-out child's
-- root_run_id is its parent's root, or its parent (``parent``: one lookup by the primary
-- key, of nothing for a run that is no child). The lookup locks the parent's row FOR
-- SHARE: a cascading cancel of the parent (``poimen_cancel``) either waits for this
-- admission's commit and then finds the child, or commits first and the child is admitted
-- with its cancellation requested, and the cascade for its own children (never started).
-- A delayed run
-- (``:not_before``, or ``:delay`` seconds from now, by Postgres's clock) keeps the time it
-- was admitted with in ``admitted_not_before`` (a retry moves ``not_before``, never that);
-- ``due`` says whether it may be sent now (else beat's ``release_due`` sends it).
-- ``expires_at`` (or ``:expires_in`` seconds from now): a run not started by then ends
-- ``expired`` (``poimen_expire``). ``rate_interval`` and ``rate_key``: its workflow's rate
-- limit, pinned as the seconds between two starts of its key (``poimen_rate_start``).
WITH  parent AS (
    SELECT coalesce(p.root_run_id, p.id) AS root_id, p.cancel_requested AND p.cancel_cascade AS cancelled
      FROM runs p WHERE p.id = CAST(:parent_run_id AS uuid) FOR SHARE),
      changed AS (
INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, input,
                  goal_id, dispatch_key, status, attempt, failures, cancel_requested,
                  origin, origin_detail, parent_run_id, root_run_id, definition_hash,
                  traceparent, tracestate, concurrency_key, concurrency_limit, rate_key,
                  rate_interval, not_before, admitted_not_before, expires_at, cancel_cascade)
VALUES (:id, :tenant_id, :workflow_ref, :workflow_name, :workflow_version,
        CAST(:input AS jsonb), :goal_id, :dispatch_key, 'queued', 0, 0,
        coalesce((SELECT cancelled FROM parent), false), :origin,
        :origin_detail, :parent_run_id, (SELECT root_id FROM parent), :definition_hash,
        :traceparent, :tracestate, :concurrency_key, :concurrency_limit, :rate_key,
        :rate_interval,
        coalesce(CAST(:not_before AS timestamptz), now() + make_interval(secs => CAST(:delay AS float8))),
        coalesce(CAST(:not_before AS timestamptz), now() + make_interval(secs => CAST(:delay AS float8))),
        coalesce(CAST(:expires_at AS timestamptz), now() + make_interval(secs => CAST(:expires_in AS float8))),
        coalesce((SELECT cancelled FROM parent), false))
ON CONFLICT (tenant_id, dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING
 RETURNING *),
    event AS (
    INSERT INTO outbox (tenant_id, run_id, event_type, payload)
    SELECT tenant_id, id, 'run.admitted',
           jsonb_build_object('run_id', (id)::text, 'type', 'run.admitted') || CAST(:event AS jsonb)
      FROM changed
     WHERE true

)

    SELECT *, (not_before IS NULL OR not_before <= now()) AS due FROM changed;

-- name: existing
-- A miss: the row that holds the key, and whether it was admitted with this very
-- request, decided by Postgres on the stored values: jsonb equality compares
-- numbers as numbers (1e23 = 100000000000000000000000) and never equates true
-- with 1, which Python's == does and a float round trip cannot get right.
-- A delay compares as the run was admitted (``admitted_not_before``): an instant
-- (``:not_before``) must be the same instant; a relative one (``:delayed``, counted from
-- the first admission) only asks that the run was admitted delayed. Expiry likewise.
SELECT runs.*, (not_before IS NULL OR not_before <= now()) AS due,
       workflow_ref IS NOT DISTINCT FROM :workflow_ref AS same_workflow_ref,
       input = CAST(:input AS jsonb) AS same_input,
       goal_id IS NOT DISTINCT FROM :goal_id AS same_goal_id,
       CASE WHEN CAST(:not_before AS timestamptz) IS NOT NULL
            THEN admitted_not_before IS NOT DISTINCT FROM CAST(:not_before AS timestamptz)
            ELSE (admitted_not_before IS NOT NULL) = CAST(:delayed AS boolean) END
         AS same_not_before,
       CASE WHEN CAST(:expires_at AS timestamptz) IS NOT NULL
            THEN expires_at IS NOT DISTINCT FROM CAST(:expires_at AS timestamptz)
            ELSE (expires_at IS NOT NULL) = CAST(:expiring AS boolean) END
         AS same_expires_at
  FROM runs
 WHERE tenant_id = :tenant_id AND dispatch_key = :dispatch_key;

-- name: admit_many
-- A batch (``POST /v1/runs/batch``, a parent's fan-out): ``admit``'s rule for many runs in
-- one statement. The requests come as one jsonb array (``:runs``: one object per run, its
-- ``ord`` the request's position); each row the index lets in gets its ``run.admitted``
-- event in the same statement, and a key already held (or taken by an earlier request of
-- the same batch) is skipped, to be read back with ``holders``. The rows go in ordered by
-- key: two batches that share keys take them in one order, so neither can hold a key the
-- other waits for while it waits for one the other holds (a deadlock).
WITH  parent AS (
    SELECT coalesce(p.root_run_id, p.id) AS root_id, p.cancel_requested AND p.cancel_cascade AS cancelled
      FROM runs p WHERE p.id = CAST(:parent_run_id AS uuid) FOR SHARE),
      changed AS (
INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, input,
                  goal_id, dispatch_key, status, attempt, failures, cancel_requested,
                  origin, origin_detail, parent_run_id, root_run_id, definition_hash,
                  traceparent, tracestate, concurrency_key, concurrency_limit, rate_key,
                  rate_interval, not_before, admitted_not_before, expires_at, cancel_cascade)
SELECT r.id, :tenant_id, r.workflow_ref, r.workflow_name, r.workflow_version, r.input,
       r.goal_id, r.dispatch_key, 'queued', 0, 0,
       coalesce((SELECT cancelled FROM parent), false), :origin,
       :origin_detail, :parent_run_id, (SELECT root_id FROM parent), r.definition_hash,
       r.traceparent, r.tracestate, r.concurrency_key, r.concurrency_limit, r.rate_key,
       r.rate_interval,
       coalesce(r.not_before, now() + make_interval(secs => r.delay)),
       coalesce(r.not_before, now() + make_interval(secs => r.delay)),
       coalesce(r.expires_at, now() + make_interval(secs => r.expires_in)),
       coalesce((SELECT cancelled FROM parent), false)
  FROM jsonb_to_recordset(CAST(:runs AS jsonb)) AS r(
       ord int, id uuid, workflow_ref text, workflow_name text, workflow_version text,
       input jsonb, goal_id text, dispatch_key text, definition_hash text,
       traceparent text, tracestate text, concurrency_key text, concurrency_limit int,
       rate_key text, rate_interval float8, not_before timestamptz, delay float8, expires_at timestamptz, expires_in float8)
 ORDER BY r.dispatch_key, r.ord
ON CONFLICT (tenant_id, dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING
 RETURNING *),
    event AS (
    INSERT INTO outbox (tenant_id, run_id, event_type, payload)
    SELECT tenant_id, id, 'run.admitted',
           jsonb_build_object('run_id', (id)::text, 'type', 'run.admitted') || jsonb_build_object('workflow_ref', workflow_name || '@' || workflow_version, 'goal_id', goal_id, 'dispatch_key', dispatch_key, 'origin', origin)
      FROM changed
     WHERE true

)

    SELECT *, (not_before IS NULL OR not_before <= now()) AS due FROM changed;

-- name: holders
-- A batch's misses: for each request (``:requests``, its ``ord``, key and compared fields)
-- whose key was taken, the run that holds it, compared by Postgres as ``existing`` does.
SELECT q.ord AS request_ord, runs.*,
       (runs.not_before IS NULL OR runs.not_before <= now()) AS due,
       runs.workflow_ref IS NOT DISTINCT FROM q.workflow_ref AS same_workflow_ref,
       runs.input = q.input AS same_input,
       runs.goal_id IS NOT DISTINCT FROM q.goal_id AS same_goal_id,
       CASE WHEN q.not_before IS NOT NULL
            THEN runs.admitted_not_before IS NOT DISTINCT FROM q.not_before
            ELSE (runs.admitted_not_before IS NOT NULL) = q.delayed END AS same_not_before,
       CASE WHEN q.expires_at IS NOT NULL
            THEN runs.expires_at IS NOT DISTINCT FROM q.expires_at
            ELSE (runs.expires_at IS NOT NULL) = q.expiring END AS same_expires_at
  FROM jsonb_to_recordset(CAST(:requests AS jsonb)) AS q(
       ord int, dispatch_key text, workflow_ref text, input jsonb, goal_id text,
       not_before timestamptz, delayed boolean, expires_at timestamptz, expiring boolean)
  JOIN runs ON runs.tenant_id = :tenant_id AND runs.dispatch_key = q.dispatch_key
           AND runs.dispatch_key IS NOT NULL;

-- name: release_key
-- Key reuse: move the key off the run that holds it, if that run ended in a status the
-- policy names (and, with a ttl, long enough ago), so the next insert can take it. The
-- status is checked here, in the statement that takes the row lock, never by an earlier
-- read: of N racing re-admissions one releases the ended run and inserts; the others
-- find the key held by that new run (not ended) and replay it.
UPDATE runs SET released_key = dispatch_key, dispatch_key = NULL, updated_at = now()
 WHERE tenant_id = :tenant_id AND dispatch_key = :dispatch_key
   AND workflow_name = :workflow_name
   AND status = ANY(CAST(:reusable AS text[]))
   AND finished_at <= now() - make_interval(secs => :ttl)
RETURNING id;

-- name: poimen_cancel
-- One call, so no interleaving can slip between "cancel if queued" and
-- "flag if running": a run that moves running -> queued (a retry, a release)
-- while we wait on its row lock is re-checked on its new version by Postgres
-- and cancelled outright.
-- A waiting run (a join) holds no worker: it is cancelled outright, like a queued one.
-- A run it ends counts for its parent's join (``poimen_ended``). ``p_cascade``: the cancel
-- reaches the run's descendants (``cancel_cascade``): the children admitted after it are
-- admitted cancelled (``admit``), and the caller cancels those found (``descendants``).
CREATE OR REPLACE FUNCTION poimen_cancel(
    p_run uuid, p_tenant integer, p_cascade boolean DEFAULT false
) RETURNS TABLE (
    id runs.id%TYPE, tenant_id runs.tenant_id%TYPE, status runs.status%TYPE,
    cancel_requested runs.cancel_requested%TYPE, woken jsonb
) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_run runs%ROWTYPE;
BEGIN
    UPDATE runs
       SET status = CASE WHEN status IN ('queued', 'waiting')
                         THEN 'cancelled' ELSE status END,
           finished_at = CASE WHEN status IN ('queued', 'waiting')
                              THEN now() ELSE finished_at END,
           wait_reason = CASE WHEN status IN ('queued', 'waiting') THEN NULL
                              ELSE wait_reason END,
           cancel_requested = true, cancel_cascade = cancel_cascade OR p_cascade,
           updated_at = now()
     WHERE id = p_run AND tenant_id = p_tenant
       AND status IN ('queued', 'running', 'waiting')
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT v_run.id, v_run.tenant_id, v_run.status, v_run.cancel_requested,
                        poimen_event_ended(v_run, CASE WHEN v_run.status = 'cancelled'
                                                       THEN 'run.cancelled' END,
                                           '{}', ARRAY[v_run.id], '{}');
END
$body$;

-- name: descendants
-- A cascading cancel's next page: the runs below ``:run`` (its children, theirs, ...,
-- through ``ix_runs_parent``) not ended and not yet cancelled with the cascade, the
-- running ones last (a running one asked to stop frees its worker for a sibling). Each is
-- cancelled by its own ``poimen_cancel`` call (one run's row lock at a time: a child's end
-- locks the child, then its parent's entry and row, so holding several would deadlock).
WITH RECURSIVE tree(id) AS (
    SELECT c.id FROM runs c WHERE c.parent_run_id = :run
    UNION ALL
    SELECT c.id FROM tree JOIN runs c ON c.parent_run_id = tree.id)
SELECT r.id FROM tree JOIN runs r ON r.id = tree.id
 WHERE (r.status || '') IN ('queued', 'running', 'waiting')
   AND NOT (r.cancel_requested AND r.cancel_cascade)
 ORDER BY (r.status || '') = 'running'
 LIMIT :limit;

-- name: poimen_cancel_queued
-- A delivery found a queued run whose cancellation was requested: it ends cancelled, and
-- counts for its parent's join (``poimen_ended``).
CREATE OR REPLACE FUNCTION poimen_cancel_queued(
    p_run uuid
) RETURNS TABLE (id runs.id%TYPE, woken jsonb) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_run runs%ROWTYPE;
BEGIN
    UPDATE runs SET status = 'cancelled', finished_at = now(), updated_at = now(),
           wait_reason = NULL
     WHERE id = p_run AND status = 'queued' AND cancel_requested
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT v_run.id, poimen_event_ended(v_run, 'run.cancelled', '{}',
                                                     ARRAY[v_run.id], '{}');
END
$body$;

-- name: poimen_expire
-- A run nobody started by its ``expires_at`` ends ``expired``: queued (sent, delayed, or
-- re-queued for a slot) or waiting for a slot, never started (``started_at IS NULL``; a run
-- a worker started, a join's parent among them, runs to its end). Conditional on all of it
-- in the statement, so it races a claim, a cancel and another beat safely: one wins, and a
-- claim refuses an expired run (``claim_queued``). It counts for its parent's join
-- (``poimen_ended``); it held no slot, so it hands none on (repair wakes a run waiting
-- behind it, as after a cancel).
CREATE OR REPLACE FUNCTION poimen_expire(
    p_run uuid
) RETURNS TABLE (id runs.id%TYPE, woken jsonb) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_run runs%ROWTYPE;
BEGIN
    UPDATE runs SET status = 'expired', finished_at = now(), updated_at = now(),
           wait_reason = NULL
     WHERE id = p_run AND (runs.status || '') IN ('queued', 'waiting')
       AND started_at IS NULL AND expires_at <= now()
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT v_run.id, poimen_event_ended(
        v_run, 'run.expired', jsonb_build_object('expires_at', v_run.expires_at),
        ARRAY[v_run.id], '{}');
END
$body$;

-- name: poimen_end_abandoned
-- Celery's revoke of a run whose cancel was requested and whose holder is gone
-- (``app/liveness.py``: its lock first seen free its bound ago, so no body of it
-- runs): it ends cancelled, as a takeover would end it (claims.sql, take_over), and its
-- slot goes to the next run (``poimen_ended``, after ``poimen_lock_slots``). Conditional on
-- both, so it races a takeover or the run's own finish safely: one wins.
CREATE OR REPLACE FUNCTION poimen_end_abandoned(
    p_run uuid
) RETURNS TABLE (id runs.id%TYPE, woken jsonb) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_run runs%ROWTYPE;
BEGIN
    UPDATE runs SET status = 'cancelled', finished_at = now(), updated_at = now()
     WHERE id = p_run AND status = 'running' AND cancel_requested
       AND EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = runs.claimed_by AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds))
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT v_run.id, poimen_event_ended(
        v_run, 'run.cancelled', jsonb_build_object('attempt', v_run.attempt),
        ARRAY[v_run.id], ARRAY[v_run.id]);
END
$body$;

-- name: poimen_time_limit
-- Celery's hard time limit: only the run held by the very pool process Celery
-- is about to kill: its boots are this worker's (node: the main process's own
-- id) with its pid, and only while it runs there. Another container's process
-- with the same hostname and pid is another node. The run fails; it counts for its
-- parent's join and its slot goes to the next run (``poimen_ended``, after
-- ``poimen_lock_slots``).
CREATE OR REPLACE FUNCTION poimen_time_limit(
    p_run uuid, p_node uuid, p_pid integer, p_error text
) RETURNS TABLE (id runs.id%TYPE, woken jsonb) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_run runs%ROWTYPE;
BEGIN
    UPDATE runs SET status = 'failed', error = CAST(p_error AS jsonb),
           failures = failures + 1, finished_at = now(), updated_at = now()
     WHERE id = p_run AND status = 'running'
       AND claimed_by IN (SELECT boot_id FROM worker_boots
                           WHERE node = p_node AND pid = p_pid)
     RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT v_run.id, poimen_event_ended(
        v_run, 'run.failed', jsonb_build_object('attempt', v_run.attempt, 'error', v_run.error),
        ARRAY[v_run.id], ARRAY[v_run.id]);
END
$body$;

-- name: poimen_event_ended
-- The tail of a function that changed one run (``p_run``, as its UPDATE returned it): the
-- run's event ``p_event`` (none when NULL), its payload the run's id and the type, then
-- ``p_fields``; then what the change sets off (``poimen_ended(p_ended, p_freed)``), whose
-- ``woken`` it returns. ``poimen_release``, ``poimen_retry``, ``poimen_wait``,
-- ``poimen_cancel``, ``poimen_cancel_queued``, ``poimen_end_abandoned`` and
-- ``poimen_time_limit`` end so.
CREATE OR REPLACE FUNCTION poimen_event_ended(
    p_run runs, p_event text, p_fields jsonb, p_ended uuid[], p_freed uuid[]
) RETURNS jsonb LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
BEGIN
    IF p_event IS NOT NULL THEN
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        VALUES (p_run.tenant_id, p_run.id, p_event,
                jsonb_build_object('run_id', (p_run.id)::text, 'type', p_event) || p_fields);
    END IF;
    RETURN (SELECT e.woken FROM poimen_ended(p_ended, p_freed) AS e);
END
$body$;

-- name: poimen_lock_slots
-- The locks of a run's groups, taken before any statement that claims, ends or
-- parks a run of a limited group (README.md, "An end frees a slot"): its capped
-- tenant first, then its (tenant, workflow, key), in that order everywhere, held
-- until the transaction ends. Returns how many: 0 for a run of an unlimited workflow of an
-- uncapped tenant (no lock). One read of the run and its tenant decides both; the locks
-- are taken after it, one by one.
CREATE OR REPLACE FUNCTION poimen_lock_slots(
    p_run uuid
) RETURNS integer LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
DECLARE
    v_capped boolean;
    v_limited boolean;
    v_tenant integer;
    v_group integer;
BEGIN
    SELECT t.max_running IS NOT NULL, r.concurrency_limit IS NOT NULL, r.tenant_id,
           hashtext((CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|' || coalesce(r.concurrency_key, '')))
      INTO v_capped, v_limited, v_tenant, v_group
      FROM runs r JOIN tenants t ON t.id = r.tenant_id
     WHERE r.id = p_run;
    IF v_capped THEN
        PERFORM pg_advisory_xact_lock(1347373396, v_tenant);
    END IF;
    IF v_limited THEN
        PERFORM pg_advisory_xact_lock(1347373379, v_group);
    END IF;
    RETURN CAST(coalesce(v_capped, false) AS integer)
           + CAST(coalesce(v_limited, false) AS integer);
END
$body$;

-- name: poimen_ended
-- What follows runs' ends, after the statements that ended them: the runs ``p_ended``
-- (each in a status it never leaves) count for their parents' joins (README.md, "An end
-- counts for the parent's join": ``joined``, ``woken``), a statement run only when one of
-- them is a fan-out's child; then the runs ``p_freed`` (each out of ``running``, after
-- its slot locks) hand their slots on (README.md, "An end frees a slot": ``slot_woken``).
-- The two parts re-queue different runs (a parent waits for its join, a slot's waiter
-- for a slot). Returns the runs they re-queued (``woken``: the parents first), for the
-- caller's row.
CREATE OR REPLACE FUNCTION poimen_ended(
    p_ended uuid[], p_freed uuid[]
) RETURNS TABLE (woken jsonb) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_joined jsonb := '[]';
BEGIN
    IF EXISTS (SELECT 1 FROM step_children c WHERE c.child_run_id = ANY(p_ended)) THEN
    WITH
    joined AS (
        UPDATE step_entries e SET children_done = e.children_done + 1
          FROM step_children c JOIN runs s ON s.id = c.child_run_id
         WHERE c.child_run_id = ANY(p_ended) AND e.id = c.entry_id
           AND s.status IN ('succeeded', 'failed', 'cancelled', 'poisoned', 'expired')
        RETURNING e.id AS entry_id, e.run_id, e.status, e.children_done, e.children_total
    ),
    woken AS (
        UPDATE runs p
           SET status = CASE WHEN p.status = 'waiting' THEN 'queued'
                             ELSE p.status END,
               wait_reason = CASE WHEN p.status = 'waiting' THEN NULL
                                  ELSE p.wait_reason END,
               updated_at = now(), last_sent_at = now()
          FROM joined j
         WHERE p.id = j.run_id AND j.status = 'waiting' AND j.children_done = j.children_total
           AND p.status NOT IN ('succeeded', 'failed', 'cancelled', 'poisoned', 'expired')
        RETURNING p.id, p.tenant_id, p.status, p.workflow_name, p.workflow_version, j.entry_id,
                  p.traceparent, p.tracestate, p.attempt, p.parent_run_id, p.root_run_id
    ),
    woken_event AS (
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT tenant_id, id, 'run.joined',
               jsonb_build_object('run_id', (id)::text, 'type', 'run.joined') || jsonb_build_object('entry_id', entry_id)
          FROM woken
         WHERE status = 'queued'
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object('id', w.id, 'ref', w.workflow_name || '@' || w.workflow_version, 'traceparent', w.traceparent, 'tracestate', w.tracestate, 'attempt', w.attempt, 'parent_run_id', w.parent_run_id, 'root_run_id', w.root_run_id)), '[]')
      INTO v_joined FROM woken w WHERE w.status = 'queued';
    END IF;
    RETURN QUERY WITH
    slot_woken AS (
        UPDATE runs w
           SET status = 'queued', wait_reason = NULL, updated_at = now(),
               last_sent_at = now()
         WHERE w.id IN (
               SELECT (SELECT r.id FROM runs r
                        WHERE (CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|' || coalesce(r.concurrency_key, '')) = (CAST(s.tenant_id AS text) || '|' || s.workflow_name || '|' || coalesce(s.concurrency_key, '')) AND r.concurrency_limit IS NOT NULL AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'waiting'
                          AND r.wait_reason = 'concurrency'
                        ORDER BY r.created_at, r.id LIMIT 1)
                 FROM runs s WHERE s.id = ANY(p_freed) AND s.concurrency_limit IS NOT NULL
               UNION
               SELECT (SELECT r.id FROM runs r
                        WHERE CAST(r.tenant_id AS text) = CAST(s.tenant_id AS text) AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'waiting'
                          AND r.wait_reason = 'tenant_cap'
                        ORDER BY r.created_at, r.id LIMIT 1)
                 FROM runs s JOIN tenants t ON t.id = s.tenant_id
                WHERE s.id = ANY(p_freed) AND t.max_running IS NOT NULL)
           AND (w.status || '') = 'waiting' AND w.wait_reason IN ('concurrency', 'tenant_cap')
        RETURNING w.id, w.tenant_id, w.workflow_name, w.workflow_version, w.traceparent,
                  w.tracestate, w.attempt, w.parent_run_id, w.root_run_id
    ),
    slot_woken_event AS (
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT tenant_id, id, 'run.woken',
               jsonb_build_object('run_id', (id)::text, 'type', 'run.woken') || '{}'::jsonb
          FROM slot_woken
    )
    SELECT v_joined || coalesce(jsonb_agg(jsonb_build_object('id', w.id, 'ref', w.workflow_name || '@' || w.workflow_version, 'traceparent', w.traceparent, 'tracestate', w.tracestate, 'attempt', w.attempt, 'parent_run_id', w.parent_run_id, 'root_run_id', w.root_run_id)), '[]')
      FROM slot_woken w;
END
$body$;

-- name: mark_holder_dead
-- The holder of one run seen without its lock: stamped as ``mark_boot_dead`` (boots.sql) does.
UPDATE worker_boots b SET first_seen_dead_at = clock_timestamp()
  FROM runs r
 WHERE r.id = :run AND b.boot_id = r.claimed_by AND b.first_seen_dead_at IS NULL
   AND pg_try_advisory_xact_lock_shared(1347373389, b.lock_key);

-- name: dead_boot_runs
-- Repair: two statements, so neither kind of stranded run waits behind the other.
-- Each marks what it returns as sent (``last_sent_at = now()``) in the same
-- statement; the sends follow the commit. ``FOR UPDATE SKIP LOCKED`` lets two
-- repairs (two beats by mistake, beat and an operator) split the work instead
-- of sending the same runs twice.
--
-- Runs held by a dead boot, first seen so (``app/liveness.py``: its lock free; the
-- repair stamps every such boot just before, ``mark_dead_boots``): re-sent on the
-- first tick after the boot was seen dead, i.e. if not re-sent since the claim (a
-- claim or takeover sets updated_at), and after that only once the repair age has
-- passed again. Each comes with ``gone_in``: the seconds until its boot is gone (its
-- stamp T_c + kill + margin old), which the message waits out (``app/run_service.py``): a
-- boot whose lock went early may run its bodies until then, and a delivery before it
-- takes nothing over (the claim decides; this only saves a repair tick).
UPDATE runs SET last_sent_at = now()
  FROM (SELECT r.id, GREATEST(0, CAST(extract(epoch FROM g.first_seen_dead_at + make_interval(secs => g.dead_after_seconds) - now()) AS float8)) AS gone_in
          FROM runs r JOIN worker_boots g ON g.boot_id = r.claimed_by
         WHERE r.status = 'running'
           AND g.first_seen_dead_at IS NOT NULL
           AND (r.last_sent_at <= r.updated_at
                OR r.last_sent_at <= now() - make_interval(secs => :min_age))
         ORDER BY r.updated_at
         LIMIT :limit
           FOR UPDATE OF r SKIP LOCKED) AS dead
 WHERE runs.id = dead.id
RETURNING runs.id, workflow_name, workflow_version, traceparent, tracestate, dead.gone_in,
          attempt, parent_run_id, root_run_id;

-- name: queued_runs
-- Queued runs whose last send is older than the repair age (a retry's delayed
-- message counts as sent at not_before), oldest send first: each tick takes
-- the next page instead of the same oldest runs again.
UPDATE runs SET last_sent_at = now()
 WHERE id IN (
       SELECT r.id FROM runs r
        WHERE r.status = 'queued'
          AND r.last_sent_at <= now() - make_interval(secs => :min_age)
          AND (r.not_before IS NULL
               OR r.not_before <= now() - make_interval(secs => :min_age))
          AND (r.workflow_name, r.workflow_version) IN (
               SELECT unnest(CAST(:names AS text[])), unnest(CAST(:versions AS text[])))
        ORDER BY r.last_sent_at
        LIMIT :limit
          FOR UPDATE OF r SKIP LOCKED)
RETURNING id, workflow_name, workflow_version, traceparent, tracestate, attempt,
          parent_run_id, root_run_id;

-- name: release_due
-- Delayed admissions now due and never sent since (``last_sent_at < not_before``: a retry's
-- delayed message counts as sent at its ``not_before``, ``poimen_retry``), earliest due
-- first, a page at a time, marked sent in the statement that picks them (two beats never
-- send one twice; a lost send is repair's, like any queued run's). Served by
-- ``ix_runs_delayed``, whose predicate this repeats.
UPDATE runs SET last_sent_at = now()
 WHERE id IN (
       SELECT r.id FROM runs r
        WHERE r.status = 'queued' AND r.last_sent_at < r.not_before
          AND r.not_before <= now()
        ORDER BY r.not_before
        LIMIT :limit
          FOR UPDATE OF r SKIP LOCKED)
RETURNING id, workflow_name, workflow_version, traceparent, tracestate, attempt,
          parent_run_id, root_run_id;

-- name: next_due
-- The seconds until the earliest run ``release_due`` would send comes due (a delayed
-- admission, a start its rate limits reserved), by Postgres's clock; NULL when there is
-- none. Served by ``ix_runs_delayed`` (the first entry of its order), whose predicate this
-- repeats: beat's timer sleeps until then, so a reserved start is sent on time, not at the
-- next tick.
SELECT CAST(extract(epoch FROM r.not_before - clock_timestamp()) AS float8)
  FROM runs r
 WHERE r.status = 'queued' AND r.last_sent_at < r.not_before
 ORDER BY r.not_before
 LIMIT 1;

-- name: expire_due
-- Runs never started whose ``expires_at`` passed, earliest first, a page at a time, each
-- ended by ``poimen_expire`` (which decides again on the row: a claim may win). Served by
-- ``ix_runs_expiring``, whose predicate this repeats.
SELECT e.* FROM (
       SELECT r.id FROM runs r
        WHERE r.expires_at IS NOT NULL AND r.started_at IS NULL
          AND r.status IN ('queued', 'waiting') AND r.expires_at <= now()
        ORDER BY r.expires_at
        LIMIT :limit) AS due,
       LATERAL poimen_expire(due.id) AS e;

-- name: queued_workflows
-- The workflows (name, version) that have queued runs due for a re-send: repair
-- budgets each Celery queue by its own depth, and a workflow's queue is its
-- definition's (``@workflow(queue=...)``), known to the registry, not the row.
SELECT DISTINCT r.workflow_name, r.workflow_version FROM runs r
 WHERE r.status = 'queued'
   AND r.last_sent_at <= now() - make_interval(secs => :min_age)
   AND (r.not_before IS NULL
        OR r.not_before <= now() - make_interval(secs => :min_age));

-- name: try_repair_lock
-- One repair at a time (``runs.repair_lock``): the lock, if free.
SELECT pg_try_advisory_xact_lock(:namespace, 0);

-- name: wait_repair_lock
-- One repair at a time: the lock, waited for.
SELECT true FROM (SELECT pg_advisory_xact_lock(:namespace, 0)) AS held;

-- name: cap_wakes
-- The runs waiting for their tenant's cap that the cap lets go, as a view that
-- ``wake_waiting`` and ``wake_tenant`` read (the planner inlines it, and a statement's test
-- of the tenant reaches the scan of ``runs``; migration 0025 installs it, a change to it
-- needs a migration that runs it again). A tenant whose cap is gone (NULL) holds no run
-- back: every run that waited for its cap. Else the waiter at ``tenant_place`` in its
-- tenant's line (1: the oldest), when place + the tenant's slots held by live boots + its
-- queued due runs older than the waiter <= the cap: as many as the slots free, never one
-- that would park again behind an older one.
CREATE OR REPLACE VIEW poimen_cap_wakes AS
SELECT w.id, w.tenant_id, w.created_at
  FROM (SELECT w.id, w.tenant_id, w.created_at,
               row_number() OVER (PARTITION BY w.tenant_id
                                  ORDER BY w.created_at, w.id) AS tenant_place
          FROM runs w
         WHERE ('' || w.status) = 'waiting' AND w.wait_reason = 'tenant_cap') AS w
  JOIN tenants t ON t.id = w.tenant_id
 WHERE CASE WHEN t.max_running IS NULL THEN true
            ELSE w.tenant_place <= t.max_running
                 AND w.tenant_place + (SELECT count(*) FROM runs r WHERE CAST(r.tenant_id AS text) = CAST(w.tenant_id AS text) AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'running' AND NOT EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = r.claimed_by AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds)))
                   + (SELECT count(*) FROM runs r WHERE CAST(r.tenant_id AS text) = CAST(w.tenant_id AS text) AND ('' || r.status) IN ('queued', 'running', 'waiting')
                         AND ('' || r.status) = 'queued' AND NOT r.cancel_requested AND (r.not_before IS NULL OR r.not_before <= now()) AND (r.created_at, r.id) < (w.created_at, w.id))
                     <= t.max_running
       END;

-- name: wake_waiting
-- Beat's backstop: runs waiting for a slot that is free (a slot's holder died: its
-- boot's lock is gone; a queued run ahead of them was cancelled; a cap was raised or
-- lifted, or set while runs ran, behind a claim's back), in every group and tenant.
-- The statement that ends a slot's holder wakes the next run itself, and a cap change
-- wakes its tenant's runs itself (``wake_tenant``).
-- Waking runs that wait for a slot: as many as will pass the claim, oldest first. The
-- claim (``poimen_claim_slot``'s verdict) lets a run take a slot of its group (a limited
-- (tenant, workflow, key); a capped tenant) while the slots held by live boots, the queued
-- due runs older than it and the older runs waiting for that slot number fewer than the
-- limit. So the waiter at ``place`` in its group's line (1: the oldest) is woken when
-- place + held + older queued <= limit: as many as the slots free, never one that would park
-- again behind an older one; a run waiting for its tenant's cap, when ``cap_wakes`` lets it
-- go. In a group's line, runs that wait for the tenant's cap stand too (the claim counts
-- them ahead of the group's newer runs). The woken runs go back to ``queued``
-- (``run.woken``), marked sent; each claims again under its group's locks.
WITH
waiters AS (
    SELECT w.id, w.tenant_id, w.workflow_name, w.concurrency_key, w.concurrency_limit,
           w.wait_reason, w.created_at,
           row_number() OVER (PARTITION BY (CAST(w.tenant_id AS text) || '|' || w.workflow_name || '|' || coalesce(w.concurrency_key, '')), w.concurrency_limit IS NULL
                              ORDER BY w.created_at, w.id) AS group_place
      FROM runs w
     WHERE w.status = 'waiting' AND w.wait_reason IN ('concurrency', 'tenant_cap')
), changed AS (
UPDATE runs SET status = 'queued', wait_reason = NULL, updated_at = now(),
       last_sent_at = now()
 WHERE id IN (
       SELECT u.id FROM (
              SELECT w.id, w.created_at FROM waiters w
               WHERE w.wait_reason = 'concurrency'
                 AND w.group_place <= w.concurrency_limit
                 AND w.group_place + (SELECT count(*) FROM runs r WHERE (CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|' || coalesce(r.concurrency_key, '')) = (CAST(w.tenant_id AS text) || '|' || w.workflow_name || '|' || coalesce(w.concurrency_key, '')) AND r.concurrency_limit IS NOT NULL AND ('' || r.status) IN ('queued', 'running', 'waiting') AND ('' || r.status) = 'running' AND NOT EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = r.claimed_by AND g.first_seen_dead_at <= now() - make_interval(secs => g.dead_after_seconds)))
                   + (SELECT count(*) FROM runs r WHERE (CAST(r.tenant_id AS text) || '|' || r.workflow_name || '|' || coalesce(r.concurrency_key, '')) = (CAST(w.tenant_id AS text) || '|' || w.workflow_name || '|' || coalesce(w.concurrency_key, '')) AND r.concurrency_limit IS NOT NULL AND ('' || r.status) IN ('queued', 'running', 'waiting')
                         AND ('' || r.status) = 'queued' AND NOT r.cancel_requested AND (r.not_before IS NULL OR r.not_before <= now()) AND (r.created_at, r.id) < (w.created_at, w.id))
                     <= w.concurrency_limit
              UNION ALL
              SELECT c.id, c.created_at FROM poimen_cap_wakes c) AS u
        ORDER BY u.created_at, u.id
        LIMIT :limit)
   AND (runs.status || '') = 'waiting' AND wait_reason IN ('concurrency', 'tenant_cap')
 RETURNING id, tenant_id, workflow_name, workflow_version, traceparent, tracestate, attempt, parent_run_id, root_run_id),
    event AS (
    INSERT INTO outbox (tenant_id, run_id, event_type, payload)
    SELECT tenant_id, id, 'run.woken',
           jsonb_build_object('run_id', (id)::text, 'type', 'run.woken') || '{}'::jsonb
      FROM changed
     WHERE true

)

    SELECT * FROM changed;

-- name: lock_tenant
-- A tenant's cap change: its lock, the cap, then the runs waiting for the tenant's
-- slots that the new cap frees (every one, if the cap was lifted), in one transaction
-- (``change_tenant_cap``). The lock is the one every claim of the capped tenant's runs
-- takes first (``lock_slots``): a claim that read the old cap and is parking a run
-- commits before the wake's snapshot (which sees the run and wakes it), and a claim
-- that comes after reads the new cap. No run is left waiting for a cap that is gone.
SELECT pg_advisory_xact_lock(1347373396, CAST(:tenant AS integer));

-- name: set_tenant_cap
-- A tenant's cap (NULL: none), after ``lock_tenant``; ``wake_tenant`` follows.
UPDATE tenants SET max_running = :max_running WHERE id = :tenant;

-- name: wake_tenant
-- ``wake_waiting`` for a tenant's cap change (``change_tenant_cap``, after ``lock_tenant``
-- and ``set_tenant_cap``): the runs waiting for this tenant's cap that the new cap lets go
-- (``cap_wakes``), every one if it was lifted, oldest first. A run waiting for a group's
-- slot is no change of the cap's to wake.
WITH changed AS (
UPDATE runs SET status = 'queued', wait_reason = NULL, updated_at = now(),
       last_sent_at = now()
 WHERE id IN (
       SELECT c.id FROM poimen_cap_wakes c
        WHERE CAST(c.tenant_id AS text) = CAST(CAST(:tenant AS integer) AS text)
        ORDER BY c.created_at, c.id
        LIMIT :limit)
   AND (runs.status || '') = 'waiting' AND wait_reason IN ('concurrency', 'tenant_cap')
 RETURNING id, tenant_id, workflow_name, workflow_version, traceparent, tracestate, attempt, parent_run_id, root_run_id),
    event AS (
    INSERT INTO outbox (tenant_id, run_id, event_type, payload)
    SELECT tenant_id, id, 'run.woken',
           jsonb_build_object('run_id', (id)::text, 'type', 'run.woken') || '{}'::jsonb
      FROM changed
     WHERE true

)

    SELECT * FROM changed;

-- name: waiting_by_reason
-- What waiting runs wait for, for the poimen_runs_waiting{reason} gauge.
SELECT coalesce(wait_reason, 'join') AS reason, count(*) AS runs
  FROM runs WHERE status = 'waiting' GROUP BY 1;
