"""The benchmarks' shared helpers that decide what a killed benchmark leaves behind."""

from __future__ import annotations

import os
import re
import signal

import pytest

from bench._common import stop_on_sigterm


def test_a_second_sigterm_does_not_cut_a_benchmarks_clean_up_short():
    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    try:
        stop_on_sigterm()
        with pytest.raises(SystemExit) as first:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                raise AssertionError("SIGTERM did not stop the benchmark")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # a second kill during the clean-up
                cleaned.append("every process stopped")
        assert first.value.code == 128 + signal.SIGTERM
        assert cleaned == ["every process stopped"]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_stuck_end_to_end_wait_says_where_it_stands_before_its_timeout(capsys):
    from bench.e2e import wait_for

    with pytest.raises(RuntimeError, match="only 7/10 after 1 s"):
        wait_for(lambda: 7, 10, timeout=1.0, what="poimen", stall_s=0.3)
    reports = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("poimen: 7/10, no progress for")]
    assert 2 <= len(reports) <= 4, reports


def test_a_benchmark_case_starts_just_after_a_checkpoint(database_url):
    """``settle(url)`` checkpoints before it waits, so a case of ``make bench`` does not
    pay for a checkpoint the previous script's writes (or its ``DROP DATABASE``) left."""
    import psycopg

    from bench._common import settle
    from poimenconfig import libpq_url

    def last_checkpoint() -> object:
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            conn.execute("CREATE TEMP TABLE wal_maker (x int); DROP TABLE wal_maker")
            return conn.execute("SELECT checkpoint_lsn FROM pg_control_checkpoint()").fetchone()

    before = last_checkpoint()
    settle(database_url, limit=1000.0)
    assert last_checkpoint() != before


def test_repeated_end_to_end_rounds_report_each_cases_median_and_every_duplicate():
    from bench.e2e import Case, median_rounds, rounds_lines

    def case(name: str, seconds: float, duplicates: int = 0) -> Case:
        return Case(name, 100, seconds, duplicates, "0.1", "0.1")

    rounds = [
        (case("poimen", 1.0), case("poimen paced", 1.0, duplicates=1), case("plain", 2.0),
         case("naive", 1.0)),
        (case("poimen", 4.0), None, case("plain", 1.0), case("naive", 4.0)),
        (case("poimen", 2.0), case("poimen paced", 1.0), case("plain", 4.0),
         case("naive", 2.0, duplicates=2)),
    ]
    burst, paced, plain, naive = median_rounds(rounds)
    assert (burst, paced) == (rounds[2][0], rounds[2][1])  # the paced phase of its round
    assert plain is rounds[0][2] and naive is rounds[2][3]
    lines = rounds_lines(rounds)
    assert "Poimen 100, 25, 50" in lines[0]
    # A duplicate in a round that is not the median one is still reported.
    assert lines[1].startswith("- duplicates over every round: Poimen 1 (target 0)")
    assert lines[1].endswith("naive bridge 2")


def test_every_benchmark_report_says_how_fast_this_boot_runs_python(database_url):
    # Two boots of one machine type ran the same tree 2-3x apart (bench/RESULTS.md): a
    # report says how fast the machine was when it started.
    from bench._common import cpu_probe_ms, machine_line, machine_summary

    fast, slow = cpu_probe_ms(20_000), cpu_probe_ms(2_000_000)
    assert 0 < fast < slow
    assert float(machine_summary(database_url)["cpu probe ms"]) > 0
    assert re.search(r"CPU probe [0-9.]+ ms", machine_line())
