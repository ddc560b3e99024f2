-- The statements of app/state/boots.py, each bound to the constant of its name in capitals
-- (``-- name: admit`` is ``ADMIT``). The parts many statements share: README.md.

-- name: register_boot
-- psycopg placeholders: the lock connection runs without SQLAlchemy.
-- ``dead_after_seconds``: the boot's own T_c + kill + margin (``lease.dead_after``), how
-- long after its lock is first seen free its runs stay held.
INSERT INTO worker_boots (boot_id, lock_key, hostname, pid, node, dead_after_seconds) VALUES (%s, %s, %s, %s, %s, %s);

-- name: mark_boot_dead
-- A boot's lock seen free for the first time: stamp when, by the server's clock at the
-- moment of seeing it (clock_timestamp(): never before the lock went, whenever the
-- transaction began). Its runs stay held until the stamp is the boot's bound old
-- (``app/liveness.py``). Only the first sight counts: a stamp is never moved.
--
-- One boot (a delivery found a run held by a boot whose lock is free): the lock manager
-- asked for its one key, like a claimer's own check (``claimer_live_sql``).
UPDATE worker_boots b SET first_seen_dead_at = clock_timestamp()
 WHERE b.boot_id = :boot AND b.first_seen_dead_at IS NULL
   AND pg_try_advisory_xact_lock_shared(1347373389, b.lock_key);

-- name: mark_dead_boots
-- Every boot whose lock is free (beat's repair, each tick, and ``flask runs redrive``):
-- so a boot nobody asked about is gone within one tick of its bound.
UPDATE worker_boots b SET first_seen_dead_at = clock_timestamp()
 WHERE b.first_seen_dead_at IS NULL
   AND b.boot_id NOT IN (SELECT v.boot_id FROM poimen_live_boots v);

-- name: prune_dead_boots
-- A dead boot that no run points at any more is history: without pruning, the
-- table (and the join every liveness check makes) grows by one row per worker
-- process lifetime, forever (think --max-tasks-per-child at high throughput).
DELETE FROM worker_boots b
 WHERE b.boot_id IN (
       SELECT d.boot_id FROM worker_boots d
        WHERE d.boot_id NOT IN (SELECT v.boot_id FROM poimen_live_boots v)
          AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.claimed_by = d.boot_id)
        LIMIT :limit);

-- name: live_boots
-- The one definition of a live boot (``app/liveness.py``), the view every statement and
-- query that lists live boots reads: each boot whose lock ``(1347373389 "POIM",
-- lock_key)`` is granted *exclusively* in this database (only the boot's own lock session
-- holds it so; a claimer's check holds it shared), with the backend that holds it
-- (``lock_pid``). A simple view: the planner inlines it into each statement.
-- Migration 0025 installs it; a change to it needs a migration that runs it again.
CREATE OR REPLACE VIEW poimen_live_boots AS
SELECT b.boot_id, b.hostname, b.pid, l.pid AS lock_pid
  FROM worker_boots b
  JOIN pg_locks l
    ON l.locktype = 'advisory'
   AND l.classid = CAST(1347373389 AS oid)
   AND l.objid = CAST(b.lock_key AS oid)
   AND l.objsubid = 2
   AND l.granted
   AND l.mode = 'ExclusiveLock'
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
