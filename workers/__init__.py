"""Celery workers: ``celery -A workers worker|beat|flower``.

Celery finds the app in ``workers/celery.py`` (its ``find_app`` falls back to
``<package>.celery``); that module builds it with ``app.create_app()``. This
package depends on ``app/``; ``app/`` imports from it only the leaf
``workers.registry``.
"""
