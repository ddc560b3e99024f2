"""The error text a failure stores with its run, ledger and events is bounded.

Pure functions: no services. The whole path (a run failing with a 1.2 MB message, its
``run.failed`` event on Kafka) is tests/bridge/test_outbox_relay.py.
"""

from __future__ import annotations

import pytest

from poimenconfig import DEFAULT_ERROR_TEXT_MAX_BYTES, error_text_max_bytes
from workers.actions import bound_error, error_info


def raised(message: str) -> ValueError:
    try:
        raise ValueError(message)
    except ValueError as err:
        return err


def test_a_huge_message_is_cut_to_the_bound_with_its_size_noted():
    message = "invalid input: " + "é" * 600_000  # two bytes a character
    error = error_info(raised(message), step="check")
    size = len(message.encode())
    assert error["error_truncated"] is True and error["error_bytes"] == size
    kept = error["message"].encode()
    assert len(kept) <= DEFAULT_ERROR_TEXT_MAX_BYTES and message.encode().startswith(kept)
    assert len(error["traceback"].encode()) <= DEFAULT_ERROR_TEXT_MAX_BYTES
    # The traceback still shows the frames: the exception's long line is cut, not the frames.
    assert error["traceback"].startswith("Traceback (most recent call last):")
    assert "test_error_text.py" in error["traceback"]
    assert (error["type"], error["step"]) == ("builtins.ValueError", "check")


def test_a_short_error_is_kept_whole_and_unmarked():
    error = error_info(raised("bad field 'x'"))
    assert error["message"] == "bad field 'x'"
    assert "error_truncated" not in error and "error_bytes" not in error
    assert bound_error(error) == error


def test_the_bound_is_a_setting_and_cuts_whole_characters():
    error = bound_error({"type": "t", "message": "ab" + "€" * 300, "traceback": "x" * 500 + "end"},
                        limit=256)
    assert len(error["message"].encode()) <= 256 and error["message"].startswith("ab€")
    assert error["error_bytes"] == 2 + 3 * 300
    assert error["traceback"].endswith("end") and len(error["traceback"].encode()) == 256
    assert error_text_max_bytes({"POIMEN_ERROR_TEXT_MAX_BYTES": "1024"}) == 1024
    assert error_text_max_bytes({}) == DEFAULT_ERROR_TEXT_MAX_BYTES == 8192
    with pytest.raises(SystemExit, match="at least 256"):
        error_text_max_bytes({"POIMEN_ERROR_TEXT_MAX_BYTES": "10"})
