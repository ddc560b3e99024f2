"""The Python client of the Poimen API: ``from poimen_client import Runs``.

A distribution of its own (``poimen-client``, urllib3 only), so a team's project
can depend on it without installing the server's packages (docs/guide/client.md).
"""

from .client import (
    GENERATED_KEY_PREFIX,
    RETRIED_STATUSES,
    TERMINAL,
    Answer,
    ApiError,
    AuthError,
    DispatchKeyConflict,
    InvalidRequest,
    PoimenError,
    Run,
    RunFailed,
    RunNotFound,
    Runs,
    Transport,
    TransportError,
    TransportTimeout,
    Unavailable,
    WaitTimeout,
    retry_after_seconds,
)

__all__ = [
    "GENERATED_KEY_PREFIX", "RETRIED_STATUSES", "TERMINAL", "Answer", "ApiError", "AuthError",
    "DispatchKeyConflict", "InvalidRequest", "PoimenError", "Run", "RunFailed", "RunNotFound", "Runs",
    "Transport", "TransportError", "TransportTimeout", "Unavailable", "WaitTimeout",
    "retry_after_seconds",
]
