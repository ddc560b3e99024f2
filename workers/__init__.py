"""Celery workers: ``celery -A workers worker``.

The Celery app is created lazily, on first access of ``workers.app``, so that
importing ``workers.registry`` or ``workers.claims`` (the web process does)
reads no settings and builds no app.
"""

from __future__ import annotations

_celery = None


def __getattr__(name: str):
    global _celery
    if name in ("app", "celery"):
        if _celery is None:
            from app import create_app

            _celery = create_app().extensions["celery"]
        return _celery
    raise AttributeError(name)
