"""A workflow for the telemetry tests (tests/e2e/test_telemetry.py): it fails quoting its input."""

from workers.registry import workflow


class LoginRefused(RuntimeError):
    pass


@workflow("leaky-failure", version="1")
def leaky_failure(ctx, input):
    """Raise an exception whose message (and a local variable) quote the run's secret."""
    password = input["password"]  # noqa: F841 - a local variable Sentry must not send
    raise LoginRefused(f"login refused for password {input['password']!r}")
