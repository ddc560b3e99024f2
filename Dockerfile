# One image for every process. The command names a Procfile entry, run as the
# Procfile writes it (bin/docker-entrypoint):
#   docker run IMAGE web | worker | beat | flower | inbox | outbox | release
# Settings come from the environment, as on Heroku (docs/configuration.md).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The pinned dependencies first (a layer that survives code changes), then the project.
COPY requirements.txt ./
RUN grep -v -e '^\.' requirements.txt > /tmp/pins.txt \
 && pip install -r /tmp/pins.txt \
 && rm /tmp/pins.txt
COPY . .
# The client, then the server: the image is Poimen's alone, so its wheel is wanted here
# (deploy/build_backend.py refuses it without the setting).
RUN pip install --no-deps ./clients/python \
 && pip install --no-deps --config-settings poimen-environment=dedicated . \
 && useradd --system --uid 10001 --home-dir /app poimen

USER poimen
# web (and flower) listen on $PORT; worker, inbox and outbox serve metrics on $METRICS_PORT.
ENV PORT=8000
EXPOSE 8000
ENTRYPOINT ["/app/bin/docker-entrypoint"]
CMD ["web"]
