"""Two processes racing deliveries of the same runs (used by test_execution)."""

from __future__ import annotations


def race(barrier, run_ids: list[str], outcomes) -> None:
    """Deliver each run in ``run_ids`` once, in step with the other racer."""
    from app import create_app
    from workers.execution import execute_run

    app = create_app()
    with app.app_context():
        for run_id in run_ids:
            barrier.wait(timeout=60)
            outcomes.put((run_id, execute_run(run_id).outcome.value))
