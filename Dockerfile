# The weightsync service image: `pip install .[server]` on python:3.11-slim, without torch
# (the service never needs it). docs/DEPLOY.md describes how to run it.
#
#   docker build -t weightsync .
#   docker run -e WEIGHTSYNC_TOKENS='[...]' -p 8400:8400 -v wsdata:/data weightsync
#
# Without tokens the service refuses to listen on 0.0.0.0 (anonymous mode is loopback-only).

FROM python:3.11-slim AS build
WORKDIR /src
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY src ./src
# The catalog's Alembic scripts: pyproject.toml maps them into the wheel (weightsync.catalog.migrations).
COPY migrations ./migrations
# Wheels of the package and of every server dependency; the runtime stage installs offline.
RUN pip wheel --wheel-dir /wheels ".[server]"

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    WEIGHTSYNC_DATA=/data \
    WEIGHTSYNC_HOST=0.0.0.0 \
    WEIGHTSYNC_PORT=8400
RUN useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin weightsync \
    && mkdir -p /app /data && chown weightsync:weightsync /data
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links /wheels "weightsync[server]" \
    && rm -rf /wheels \
    && python -c "import weightsync.service.app; from weightsync.catalog.migrate import head_revision; head_revision()" \
    && ! python -c "import torch" 2>/dev/null
USER weightsync
WORKDIR /app
VOLUME ["/data"]
EXPOSE 8400
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('WEIGHTSYNC_PORT', '8400'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["python", "-m", "weightsync.service"]
CMD ["serve"]
