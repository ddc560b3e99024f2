"""A hung middlebox between a worker and Postgres.

The victim worker reaches the private Postgres only through a proxy
(``tests/proxy.py``) that stops forwarding with its sockets open: TCP on both
ends sees a healthy peer, so neither keepalives nor ``tcp_user_timeout`` can
notice. Only the lease's own bounds can: the server's ``idle_session_timeout``
(T_s) and the worker's kernel fence (T_c). Default lease settings.
"""

from __future__ import annotations

import time

import pytest

from app.state.executor import on_session
from tests.chaos.test_partition import LONG_RUN_SECONDS, TAKEOVER_BOUND, run_state, ticks
from tests.processes import free_port, start_beat, start_worker, wait_until
from tests.proxy import StallingProxy

pytestmark = pytest.mark.slow

DEFAULTS = ("POIMEN_BOOT_PROBE_INTERVAL", "POIMEN_LEASE_CLIENT_SECONDS",
            "POIMEN_LEASE_SERVER_SECONDS", "POIMEN_TAKEOVER_DELAY", "POIMEN_REPAIR_INTERVAL",
            "POIMEN_REPAIR_MIN_AGE", "POIMEN_LOCK_DATABASE_URL", "METRICS_PORT", "PORT")


def test_a_worker_behind_a_hung_proxy_stops_before_its_run_is_started_elsewhere(
        private_postgres, chaos_env, chaos_app, chaos_tenant, chaos_redis, processes, tmp_path):
    from app.admission import admit_run
    from app.extensions import db

    env = {k: v for k, v in chaos_env.items() if k not in DEFAULTS}
    proxy = StallingProxy.to_postgres(private_postgres.url)
    try:
        via_proxy = proxy.url(private_postgres.url)
        path = tmp_path / "ticks"
        processes.append(start_worker({**env, "DATABASE_URL": via_proxy,
                                       "METRICS_PORT": str(free_port())}, tmp_path, "victim"))
        with chaos_app.app_context():
            run_id = admit_run(on_session(db.session), tenant_id=chaos_tenant.id,
                               workflow_ref="tick",
                               input={"path": str(path), "every": 0.25,
                                      "until": time.time() + LONG_RUN_SECONDS}).run.id
            db.session.commit()
        wait_until(lambda: len(ticks(path)) >= 8, timeout=60, what="the victim to run the body")
        victim_pid = ticks(path)[0][1]
        processes.append(start_worker({**env, "METRICS_PORT": str(free_port())}, tmp_path,
                                      "rescuer"))
        processes.append(start_beat({**env, "METRICS_PORT": str(free_port())}, tmp_path))
        time.sleep(3)
        proxy.stall()
        cut = time.time()

        wait_until(lambda: any(pid != victim_pid for _, pid in ticks(path)),
                   timeout=TAKEOVER_BOUND + 30, interval=0.25,
                   what="another worker to start the run")
        time.sleep(5)  # a cut-off body still running would tick on beside the rescuer's
        rows = ticks(path)
        last_victim = max(t for t, pid in rows if pid == victim_pid)
        first_rescuer = min(t for t, pid in rows if pid != victim_pid)
        print(f"\nhung proxy: victim's last tick {last_victim - cut:+.1f}s after the stall, "
              f"rescuer's first {first_rescuer - cut:+.1f}s; gap {first_rescuer - last_victim:.1f}s")
        assert last_victim < first_rescuer, "two processes ran the body at once"
        assert first_rescuer - cut < TAKEOVER_BOUND

        proxy.resume()
        wait_until(lambda: run_state(private_postgres, run_id)[0] == "succeeded",
                   timeout=LONG_RUN_SECONDS + 90, interval=0.5, what="the run to succeed")
        time.sleep(3)
        assert run_state(private_postgres, run_id)[1].count("run.succeeded") == 1
        assert max(t for t, pid in ticks(path) if pid == victim_pid) == last_victim
    finally:
        proxy.close()
