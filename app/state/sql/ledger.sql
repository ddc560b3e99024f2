-- The statements of app/state/ledger.py, each bound to the constant of its name in capitals
-- (``-- name: admit`` is ``ADMIT``). The parts many statements share: README.md.

-- name: enter
-- A new entry into a step (``step.entered`` if ``:events``), fenced: the ``run`` part is
-- the fence of every ledger write, the run held by one of this process's boots
-- (``claimed_by = ANY(:boots)``), locked FOR SHARE so a takeover (an UPDATE of that row)
-- waits for this transaction, or this statement sees the takeover and writes nothing.
WITH
    run AS (SELECT id, tenant_id, cancel_requested FROM runs
             WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots) FOR SHARE)
,
    entry AS (
        INSERT INTO step_entries (run_id, entry_no, step_id, status, actions)
        SELECT id, :entry_no, :step, 'running', CAST(:actions AS jsonb) FROM run
        RETURNING id, run_id, entry_no, step_id, children_total, children_done
    ),
    event AS (
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT run.tenant_id, entry.run_id, 'step.entered',
               jsonb_build_object('run_id', (entry.run_id)::text, 'type', 'step.entered') || jsonb_build_object('step', entry.step_id, 'entry', entry.entry_no, 'entry_id', entry.id)
          FROM entry JOIN run ON run.id = entry.run_id
         WHERE CAST(:events AS boolean)

    )
    SELECT entry.id, run.cancel_requested FROM entry JOIN run ON run.id = entry.run_id;

-- name: claim_marker
-- A marker's claim: inserted for ``:claimer`` unless the marker exists (ON CONFLICT DO
-- NOTHING), fenced, and only while the claimer's boot is live, evaluated in the claim
-- statement itself (``live``). Returns whether the run is held, the claimer live, and the
-- claim count when it claimed.
WITH
    run AS (SELECT id, tenant_id, cancel_requested FROM runs
             WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots) FOR SHARE)
, live AS (SELECT EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = :claimer AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key)) AS ok),
    claimed AS (
        INSERT INTO step_markers (entry_id, position, run_id, claimed_by, status)
        SELECT :entry, :position, run.id, :claimer, 'claimed' FROM run, live WHERE live.ok
        ON CONFLICT (entry_id, position) DO NOTHING
        RETURNING claims
    )
    SELECT EXISTS (SELECT 1 FROM run) AS held, (SELECT ok FROM live) AS claimer_live,
           (SELECT claims FROM claimed) AS claims;

-- name: marker_state
-- A marker's state after a claim that inserted nothing, and whether its holder is live.
SELECT m.status, m.claimed_by, m.claims, m.result, m.error,
          EXISTS (SELECT 1 FROM poimen_live_boots v WHERE v.boot_id = m.claimed_by) AS holder_live
     FROM step_markers m WHERE m.entry_id = :entry AND m.position = :position;

-- name: take_over_marker
-- Wreckage: the holder is dead (its lock is gone, and a dead boot never comes
-- back). A compare-and-set on its id, so of two rescuers exactly one wins.
WITH
    run AS (SELECT id, tenant_id, cancel_requested FROM runs
             WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots) FOR SHARE)
, live AS (SELECT EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = :claimer AND NOT pg_try_advisory_xact_lock_shared(1347373389, b.lock_key)) AS ok)
    UPDATE step_markers m SET claimed_by = :claimer, claims = m.claims + 1, claimed_at = now()
      FROM run, live
     WHERE m.entry_id = :entry AND m.position = :position AND m.status = 'claimed'
       AND m.claimed_by = :dead AND live.ok
    RETURNING m.claims;

-- name: complete_marker
-- A marker this process holds completes (or fails), fenced, with its ``action.<status>``
-- event. A fan-out's marker (``:children``, with their ``:ordinals`` and ``:item_keys``;
-- empty for any other action) links its children to the entry (for the join) in the
-- statement that completes it, in the transaction that admitted them, and counts the
-- children that already ended.
WITH
    run AS (SELECT id, tenant_id, cancel_requested FROM runs
             WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots) FOR SHARE)
,
    done AS (
        UPDATE step_markers m
           SET status = :status, result = CAST(:result AS jsonb), error = CAST(:error AS jsonb),
               finished_at = now()
          FROM run
         WHERE m.entry_id = :entry AND m.position = :position AND m.status = 'claimed'
           AND m.claimed_by = ANY(:boots)
        RETURNING m.position, m.error, run.id AS run_id, run.tenant_id
    ),
    linked AS (
        INSERT INTO step_children (child_run_id, entry_id, position, ordinal, item_key)
        SELECT c.child, :entry, :position, c.ordinal, c.item_key
          FROM done, unnest(CAST(:children AS uuid[]), CAST(:ordinals AS int[]),
                            CAST(:item_keys AS text[])) AS c(child, ordinal, item_key)
        ON CONFLICT (child_run_id) DO NOTHING
        RETURNING child_run_id
    ),
    counted AS (
        UPDATE step_entries e
           SET children_total = e.children_total + (SELECT count(*) FROM linked),
               children_done = e.children_done + (
                   SELECT count(*) FROM linked l JOIN runs r ON r.id = l.child_run_id
                    WHERE r.status IN ('succeeded', 'failed', 'cancelled', 'poisoned', 'expired'))
         WHERE e.id = :entry AND EXISTS (SELECT 1 FROM linked)
    ),
    event AS (
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT tenant_id, done.run_id, CAST(:event_type AS text),
               jsonb_build_object('run_id', (done.run_id)::text, 'type', CAST(:event_type AS text)) || jsonb_build_object('step', CAST(:step AS text), 'entry', CAST(:entry_no AS int), 'position', done.position, 'action', CAST(:name AS text), 'idempotency_key', CAST(:key AS text)) || CASE WHEN done.error IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('error', done.error - 'traceback') END
          FROM done
         WHERE true

    )
    SELECT count(*) AS completed FROM done;

-- name: close_entry
-- An entry ends (fenced) with its actions' outcomes and its ``step.<status>`` event.
WITH
    run AS (SELECT id, tenant_id, cancel_requested FROM runs
             WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots) FOR SHARE)
,
    entry AS (
        UPDATE step_entries e
           SET status = :status, actions = CAST(:actions AS jsonb),
               outputs = CAST(:outputs AS jsonb), error = CAST(:error AS jsonb),
               next_step = :next_step, finished_at = now()
          FROM run
         WHERE e.id = :entry AND e.status IN ('running', 'waiting')
        RETURNING e.id, e.run_id, e.entry_no, e.step_id, e.next_step, e.error, run.tenant_id,
                  run.cancel_requested
    ),
    event AS (
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT entry.tenant_id, entry.run_id, CAST(:event_type AS text),
               jsonb_build_object('run_id', (entry.run_id)::text, 'type', CAST(:event_type AS text)) || jsonb_build_object('step', entry.step_id, 'entry', entry.entry_no, 'entry_id', entry.id) || jsonb_build_object('next_step', entry.next_step) || CASE WHEN entry.error IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('error', entry.error - 'traceback') END
          FROM entry
         WHERE CAST(:events AS boolean)

    )
    SELECT id, cancel_requested FROM entry;

-- name: insert_closed
-- An entry that needed no row while it ran is written when it ends (its
-- step.entered and step.<status> events in that order, in one INSERT).
WITH
    run AS (SELECT id, tenant_id, cancel_requested FROM runs
             WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots) FOR SHARE)
,
    entry AS (
        INSERT INTO step_entries (run_id, entry_no, step_id, status, actions, outputs, error,
                                  next_step, finished_at)
        SELECT id, :entry_no, :step, :status, CAST(:actions AS jsonb), CAST(:outputs AS jsonb),
               CAST(:error AS jsonb), :next_step, now()
          FROM run
        RETURNING id, run_id, entry_no, step_id, next_step, error
    ),
    event AS (
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT run.tenant_id, entry.run_id, t.type,
               jsonb_build_object('run_id', (entry.run_id)::text, 'type', t.type) || CASE t.ord WHEN 1 THEN jsonb_build_object('step', entry.step_id, 'entry', entry.entry_no, 'entry_id', entry.id) ELSE jsonb_build_object('step', entry.step_id, 'entry', entry.entry_no, 'entry_id', entry.id) || jsonb_build_object('next_step', entry.next_step) || CASE WHEN entry.error IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('error', entry.error - 'traceback') END END
          FROM entry JOIN run ON run.id = entry.run_id, (VALUES (1, 'step.entered'), (2, CAST(:event_type AS text))) AS t(ord, type)
         WHERE CAST(:events AS boolean)
         ORDER BY t.ord
    )
    SELECT entry.id, run.cancel_requested FROM entry JOIN run ON run.id = entry.run_id;

-- name: poimen_wait
-- A join releases its worker: the entry waits (only while some child is still
-- running: its counters are on this row, which every child's end locks too,
-- README.md, "An end counts for the parent's join") and the run becomes 'waiting', unclaimed,
-- fenced by the claim; a run that held a slot hands it on (``poimen_ended``, after
-- ``poimen_lock_slots``). ``entry_waits`` without ``run_waits``: the entry would wait for a
-- run that is not ours (the caller rolls back).
CREATE OR REPLACE FUNCTION poimen_wait(
    p_run uuid, p_boots uuid[], p_entry bigint, p_actions text, p_outputs text
) RETURNS TABLE (entry_waits integer, run_waits integer, woken jsonb)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $body$
#variable_conflict use_column
DECLARE
    v_entry step_entries%ROWTYPE;
    v_run runs%ROWTYPE;
BEGIN
    UPDATE step_entries e
       SET status = 'waiting', actions = CAST(p_actions AS jsonb),
           outputs = CAST(p_outputs AS jsonb)
     WHERE e.id = p_entry AND e.status = 'running' AND e.children_done < e.children_total
       AND EXISTS (SELECT 1 FROM runs WHERE id = p_run AND claimed_by = ANY(p_boots))
    RETURNING e.* INTO v_entry;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0, 0, '[]'::jsonb;
        RETURN;
    END IF;
    UPDATE runs r SET status = 'waiting', wait_reason = 'join', claimed_by = NULL,
           updated_at = now()
     WHERE r.id = v_entry.run_id AND r.status = 'running' AND r.claimed_by = ANY(p_boots)
    RETURNING r.* INTO v_run;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 1, 0, '[]'::jsonb;
        RETURN;
    END IF;
    RETURN QUERY SELECT 1, 1, poimen_event_ended(
        v_run, 'run.waiting', jsonb_build_object('attempt', v_run.attempt, 'reason', 'join', 'step', v_entry.step_id, 'entry', v_entry.entry_no, 'children', v_entry.children_total, 'children_done', v_entry.children_done),
        '{}', ARRAY[v_run.id]);
END
$body$;

-- name: children
-- The child runs an entry spawned, in position and item order.
SELECT c.child_run_id, c.position, c.item_key, r.status, r.result, r.error, r.dispatch_key
  FROM step_children c JOIN runs r ON r.id = c.child_run_id
 WHERE c.entry_id = :entry
 ORDER BY c.position, c.ordinal;

-- name: history
-- A run's entries before one, oldest first.
SELECT id, entry_no, step_id, status, outputs, next_step
  FROM step_entries WHERE run_id = :run AND entry_no < :entry_no ORDER BY entry_no;
