"""Temporary profile (not committed)."""
import os
import time


def _cpu(pg, pid):
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().split(")")[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def test_profile(app, admit, pg, fresh_boot, statements):
    from workers.execution import execute_run
    from app.extensions import db
    n = int(os.environ.get("PROF_N", "300"))
    if os.environ.get("PROF_FGP"):
        from app.state import claims
        for f in claims.SLOT_FUNCTIONS:
            pg.execute(f"ALTER FUNCTION {f.name} SET plan_cache_mode = {os.environ['PROF_FGP']}")
    if os.environ.get("PROF_PREPARE"):
        from app.extensions import prepare_statements
        with app.app_context():
            prepare_statements(db.engine, 5)
    warm = admit("echo", {"x": 0})
    with app.app_context():
        execute_run(str(warm))
    if os.environ.get("PROF_EMPTY"):
        import psycopg
        pg.execute("TRUNCATE runs, outbox CASCADE")
        if os.environ.get("PROF_PLAN_EMPTY"):
            first = [admit("echo", {"x": i}) for i in range(12)]
            pg.execute("UPDATE runs SET concurrency_limit = 100, concurrency_key = 'k1' WHERE id = ANY(%s)", [first])
            with app.app_context():
                for rid in first:
                    execute_run(str(rid), limited=True)
    plain = [admit("echo", {"x": i}) for i in range(n)]
    limited = [admit("echo", {"x": i}) for i in range(n)]
    pg.execute("UPDATE runs SET concurrency_limit = 100, concurrency_key = 'k' || (random()*16)::int "
               "WHERE id = ANY(%s)", [limited])
    if os.environ.get("PROF_ANALYZE"):
        pg.execute("ANALYZE runs")
    for label, ids, lim in (("plain", plain, False), ("limited", limited, True),):
        with app.app_context():
            pid = db.session.execute(db.text("SELECT pg_backend_pid()")).scalar()
            db.session.commit()
            c0 = _cpu(pg, pid); p0 = time.process_time(); t0 = time.perf_counter()
            statements.clear()
            for rid in ids:
                execute_run(str(rid), limited=lim)
            if os.environ.get("PROF_EXPLAIN") and lim:
                db.session.execute(db.text("LOAD 'auto_explain'"))
                db.session.execute(db.text("SET auto_explain.log_min_duration = 0"))
                db.session.execute(db.text("SET auto_explain.log_nested_statements = on"))
                db.session.commit()
                extra = admit("echo", {"x": 1})
                pg.execute("UPDATE runs SET concurrency_limit = 100, concurrency_key = 'k3' WHERE id = %s", [extra])
                execute_run(str(extra), limited=True)
            t1 = time.perf_counter(); p1 = time.process_time(); c1 = _cpu(pg, pid)
        print(f"\n{label}: wall {(t1-t0)/n*1000:.2f} ms/run, py cpu {(p1-p0)/n*1000:.2f}, "
              f"pg cpu {(c1-c0)/n*1000:.2f}, statements/run {len(statements)/n:.1f}")


def test_explain(app, admit, pg, fresh_boot, database_url):
    import psycopg
    from sqlalchemy import event
    from workers.execution import execute_run
    from app.extensions import db
    warm = admit("echo", {"x": 0})
    with app.app_context():
        execute_run(str(warm))
    ids = [admit("echo", {"x": i}) for i in range(200)]
    pg.execute("UPDATE runs SET concurrency_limit = 100, concurrency_key = 'k' || (random()*16)::int "
               "WHERE id = ANY(%s)", [ids[100:]])
    for a, b in ((0, 50), (100, 150)):
        with app.app_context():
            for rid in ids[a:b]:
                execute_run(str(rid), limited=a == 100)
    seen = []
    def record(conn, cursor, statement, parameters, context, executemany):
        seen.append((statement, parameters))
    with app.app_context():
        engine = db.engine
    event.listen(engine, "before_cursor_execute", record)
    for rid, lim in ((ids[50], False), (ids[150], True)):
        seen.clear()
        with app.app_context():
            execute_run(str(rid), limited=lim)
        target = ids[51] if not lim else ids[151]
        with psycopg.connect(database_url.replace("+psycopg", "")) as conn:
            for stmt, params in seen:
                if isinstance(params, dict):
                    params = {k: (target if v == rid else v) for k, v in params.items()}
                plan = conn.execute("EXPLAIN (ANALYZE, SUMMARY) " + stmt, params).fetchall()
                print("\n==", "limited" if lim else "plain", stmt.strip().split("\n")[0][:70])
                print("\n".join(r[0] for r in plan if "Time" in r[0] or "cost" in r[0][:12] or r[0].startswith(("Update", "Insert", "Result", "Aggregate", "CTE"))))
            conn.rollback()
    event.remove(engine, "before_cursor_execute", record)


def test_phases(app, admit, pg, fresh_boot):
    import json, uuid
    from app.extensions import db, prepare_statements, autocommit_next
    from app.state import claims, runs
    from workers.execution import execute_run
    from workers.boots import current_boot
    from workers.fence import boot_dsn
    n = int(os.environ.get("PROF_N", "300"))
    with app.app_context():
        prepare_statements(db.engine, 5)
    warm = admit("echo", {"x": 0})
    with app.app_context():
        execute_run(str(warm))
    plain = [admit("echo", {"x": i}) for i in range(n)]
    limited = [admit("echo", {"x": i}) for i in range(n)]
    pg.execute("UPDATE runs SET concurrency_limit = 100, concurrency_key = 'k' || (random()*16)::int "
               "WHERE id = ANY(%s)", [limited])
    with app.app_context():
        boot = current_boot(boot_dsn).boot_id
        s = db.session
        pid = s.execute(db.text("SELECT pg_backend_pid()")).scalar(); s.commit()
        if os.environ.get("PROF_FGP"):
            for f in claims.SLOT_FUNCTIONS:
                pg.execute(f"ALTER FUNCTION {f.name} SET plan_cache_mode = {os.environ['PROF_FGP']}")
        if os.environ.get("PROF_GENERIC"):
            s.execute(db.text("SET plan_cache_mode = force_generic_plan")); s.commit()
        def phase(label, fn, ids):
            c0 = _cpu(pg, pid); p0 = time.process_time(); t0 = time.perf_counter()
            for rid in ids:
                fn(rid)
            t1 = time.perf_counter(); p1 = time.process_time(); c1 = _cpu(pg, pid)
            print(f"\n{label:28s} wall {(t1-t0)/len(ids)*1000:.3f} ms, py {(p1-p0)/len(ids)*1000:.3f}, pg {(c1-c0)/len(ids)*1000:.3f}")
        def claim_plain(rid):
            autocommit_next(s); s.execute(claims.CLAIM_QUEUED, {"run": rid, "boot": boot}).one(); s.commit()
        def lock_only(rid):
            s.execute(runs.LOCK_SLOTS, {"run": rid}).scalar_one(); s.rollback()
        def claim_limited(rid):
            s.execute(runs.LOCK_SLOTS, {"run": rid}).scalar_one()
            s.execute(claims.CLAIM_SLOT, {"run": rid, "boot": boot}).one(); s.commit()
        def fin(stmt, lock):
            def f(rid):
                p = {"run": rid, "boots": [boot], "status": "succeeded", "result": None, "error": None,
                     "failed": 0, "event_type": "run.succeeded", "event_extra": None}
                if lock:
                    s.execute(runs.LOCK_SLOTS, {"run": rid}).scalar_one()
                else:
                    autocommit_next(s)
                s.execute(stmt, p).one(); s.commit()
            return f
        def claim_fn(rid):
            autocommit_next(s); s.execute(claims.CLAIM_SLOT_LOCKED.call, {"run": rid, "boot": boot}).one(); s.commit()
        def fin_fn(rid):
            p = {"run": rid, "boots": [boot], "status": "succeeded", "result": None, "error": None,
                 "failed": 0, "event_type": "run.succeeded", "event_extra": None}
            autocommit_next(s); s.execute(claims.FINISH_LOCKED.call, p).one(); s.commit()
        half = len(limited) // 2
        phase("lock only (begin/rollback)", lock_only, limited)
        phase("claim plain (autocommit)", claim_plain, plain)
        phase("claim limited (tx)", claim_limited, limited[:half])
        phase("claim limited (function)", claim_fn, limited[half:])
        phase("finish plain (autocommit)", fin(claims.FINISH_UNLIMITED, False), plain)
        phase("finish limited (tx)", fin(claims.FINISH, True), limited[:half])
        phase("finish limited (function)", fin_fn, limited[half:])


def test_explain_slot(app, admit, pg, fresh_boot, database_url):
    import psycopg
    from app.state import claims
    from workers.execution import execute_run
    from workers.boots import current_boot
    from workers.fence import boot_dsn
    warm = admit("echo", {"x": 0})
    with app.app_context():
        execute_run(str(warm))
        boot = current_boot(boot_dsn).boot_id
    ids = [admit("echo", {"x": i}) for i in range(300)]
    pg.execute("UPDATE runs SET concurrency_limit = 100, concurrency_key = 'k' || (random()*16)::int "
               "WHERE id = ANY(%s)", [ids])
    pg.execute("ANALYZE runs")
    with app.app_context():
        for rid in ids[:100]:
            execute_run(str(rid), limited=True)
    sql = claims.CLAIM_SLOT.compile().string if False else None
    from sqlalchemy.dialects import postgresql
    compiled = claims.CLAIM_SLOT.compile(dialect=postgresql.psycopg.dialect())
    with psycopg.connect(database_url.replace("+psycopg", "")) as conn:
        for i, rid in enumerate(ids[100:110]):
            plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + compiled.string, {"run": rid, "boot": boot}).fetchall()
            if i == 9:
                print("\n".join(r[0] for r in plan))
        conn.rollback()


def test_generic(app, admit, pg, fresh_boot):
    from sqlalchemy.dialects import postgresql
    from app.state import claims
    from workers.execution import execute_run
    pg.execute("TRUNCATE runs, outbox CASCADE")
    first = [admit("echo", {"x": i}) for i in range(int(os.environ.get("PROF_FIRST", "12")))]
    pg.execute("UPDATE runs SET concurrency_limit = 100, concurrency_key = 'k1' WHERE id = ANY(%s)", [first])
    if os.environ.get("PROF_ANALYZE_SMALL"):
        pg.execute("ANALYZE runs"); pg.execute("ANALYZE step_entries")
    print(pg.execute("select relpages, reltuples from pg_class where relname='runs'").fetchall())
    for name, stmt in (("claim", claims.CLAIM_SLOT), ("finish", claims.FINISH_INSERTED)):
        sql = stmt.compile(dialect=postgresql.psycopg.dialect()).string
        import re
        names = []
        def sub(m):
            if m.group(1) not in names: names.append(m.group(1))
            return f"${names.index(m.group(1)) + 1}"
        sql2 = re.sub(r"%\((\w+)\)s", sub, sql)
        plan = pg.execute("EXPLAIN (GENERIC_PLAN) " + sql2).fetchall()
        print(f"\n== {name}")
        print("\n".join(r[0] for r in plan if "Scan" in r[0] or "Join" in r[0] or "Loop" in r[0]))
