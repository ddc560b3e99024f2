-- The statements of app/state/outbox.py, each bound to the constant of its name in capitals
-- (``-- name: admit`` is ``ADMIT``). The parts many statements share: README.md.

-- name: insert_event
-- An event written on its own in a transaction (the ledger's ``emit``).
INSERT INTO outbox (tenant_id, run_id, event_type, payload) VALUES (:tenant_id, :run_id, :event_type, CAST(:payload AS jsonb));

-- name: poimen_outbox_mark_published
-- Events Kafka acknowledged, by id (the function's argument ``ids``).
CREATE OR REPLACE FUNCTION poimen_outbox_mark_published(ids bigint[]) RETURNS void LANGUAGE sql AS $body$UPDATE outbox SET published_at = now() WHERE id = ANY(ids)$body$;

-- name: poimen_outbox_prune
-- Published events older than ``retention`` seconds, ``batch`` at a time; answers
-- how many went. Rows another pruner holds are skipped, not waited for.
CREATE OR REPLACE FUNCTION poimen_outbox_prune(retention double precision, batch integer) RETURNS bigint LANGUAGE sql AS $body$
WITH gone AS (
    DELETE FROM outbox WHERE id IN (
        SELECT id FROM outbox
         WHERE published_at < now() - make_interval(secs => retention)
         ORDER BY published_at
         LIMIT batch
           FOR UPDATE SKIP LOCKED)
    RETURNING 1)
SELECT count(*) FROM gone
$body$;
