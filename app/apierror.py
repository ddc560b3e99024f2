"""The API's error value and its one rendering, ``{"error": {"code", "message", "details"}}``.

No Flask here: the admission handler (``app/admission_handler.py``) renders a refusal
itself, for the Flask view and the fast path alike; ``app/errors.py`` registers the
Flask handler that renders any other ``ApiError`` with the same bytes.
"""

from __future__ import annotations

import json
from typing import Any


class ApiError(Exception):
    """An error the API answers with ``status`` and a JSON body."""

    def __init__(self, status: int, code: str, message: str, details: Any = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details if details is not None else {}
        self.headers = headers or {}


def error_body(code: str, message: str, details: Any = None) -> bytes:
    """The JSON body of an error, byte for byte what Flask's ``jsonify`` writes for it
    (compact, keys sorted, ASCII, a final newline)."""
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    return (json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=True)
            + "\n").encode()
