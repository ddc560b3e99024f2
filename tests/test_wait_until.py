"""The suite's one wait helper: "not yet" is retried, a verdict fails at once."""

from __future__ import annotations

import time

import pytest

from tests.processes import wait_until


def test_an_assertion_in_the_check_fails_the_wait_at_once():
    calls = []

    def check():
        calls.append(1)
        raise AssertionError("the relay died")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="the relay died"):
        wait_until(check, timeout=30, what="never")
    assert time.monotonic() - started < 1 and len(calls) == 1


def test_errors_and_falsy_values_are_retried_until_the_check_holds():
    answers = iter([ConnectionError("not listening yet"), 0, None, "ready"])

    def check():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_until(check, timeout=5, interval=0.01) == "ready"


def test_the_deadline_reports_what_was_awaited_and_the_last_error():
    def check():
        raise ConnectionError("refused")

    with pytest.raises(AssertionError, match=r"waiting for the broker \(last error: refused\)"):
        wait_until(check, timeout=0.2, interval=0.05, what="the broker")
