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
# The client's wheel, then the server's: the image is Poimen's alone, so its wheel is
# wanted here (deploy/build_backend.py refuses it without the setting). Of the checkout
# the image keeps the Procfile and its entrypoint only: every process runs from the
# installed wheel, as tests/deploy/test_wheel.py runs this layout without Docker.
COPY . /tmp/src
RUN cd /tmp/src \
 && pip install --no-deps ./clients/python \
 && pip install --no-deps --config-settings poimen-environment=dedicated . \
 && install -D -m 644 Procfile /app/Procfile \
 && install -D -m 755 bin/docker-entrypoint /app/bin/docker-entrypoint \
 && cd /app && rm -rf /tmp/src \
 && useradd --system --uid 10001 --home-dir /app poimen

USER poimen
# web (and flower) listen on $PORT; worker, inbox and outbox serve metrics on $METRICS_PORT.
ENV PORT=8000
EXPOSE 8000
ENTRYPOINT ["/app/bin/docker-entrypoint"]
CMD ["web"]
