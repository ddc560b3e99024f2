"""The benchmarks' shared helpers that decide what a killed benchmark leaves behind."""

from __future__ import annotations

import os
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
