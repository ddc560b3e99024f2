"""The worker's Celery app: ``celery -A workers`` finds ``workers.celery.app``.

Importing this module creates the Flask app, reading the environment: only
the worker, beat and Flower import it.
"""

from app import create_app

app = create_app().extensions["celery"]
