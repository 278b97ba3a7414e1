# syntax=docker/dockerfile:1
# fairlimit container image.
#
#   docker build -t fairlimit .
#   docker run --rm -p 8081:8081 -p 8080:8080 fairlimit
#
# Without a Docker daemon, podman builds it (as root) on a Debian base made from Debian's
# packages; CI does this (tests/deploy/test_image.py), and docs/deployment.md says how to run
# the result as Envoy Gateway does without `podman run`:
#   mmdebstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
#     bookworm /tmp/debian-bookworm.tar
#   podman import /tmp/debian-bookworm.tar localhost/fairlimit-base:bookworm
#   podman build --isolation=chroot --format docker \
#     -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
#     --build-arg PYTHON_IMAGE=localhost/fairlimit-base:bookworm -t fairlimit .
# (--format docker keeps the HEALTHCHECK, which the OCI format has no field for; the -v
# lends pip the host's certificate bundle, needed where HTTPS goes through a re-signing
# proxy and harmless elsewhere.)
#
# The runtime stage runs as uid 10001, writes nothing outside /tmp and works with a
# read-only root filesystem (the Helm chart mounts an emptyDir at /tmp), as another uid too
# (Envoy Gateway runs it as 65534).
#
# The base is pinned by digest (the multi-arch index of python:3.11-slim), so a rebuild
# gets the same OS and Python until the pin is moved on purpose. To move it:
#   docker buildx imagetools inspect python:3.11-slim   # the "Digest:" line
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/fairlimit
WORKDIR /src
# The dependencies first, from pyproject alone: this layer is rebuilt only when they change,
# not on every edit of the source.
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > requirements.txt \
 && /opt/fairlimit/bin/pip install -r requirements.txt
COPY README.md LICENSE ./
COPY server ./server
# pyproject installs these as data files (share/fairlimit/descriptors, the bundled default).
COPY descriptors ./descriptors
# pip compiles the .pyc files here, so the read-only runtime never needs to write them.
RUN /opt/fairlimit/bin/pip install --no-deps .

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="fairlimit" \
      org.opencontainers.image.description="Envoy-compatible gRPC rate-limit server with fair, hierarchical caps" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 fairlimit \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin fairlimit
COPY --from=builder /opt/fairlimit /opt/fairlimit
# The bundled descriptors again, at a fixed path for `docker run -v` and the chart's
# ConfigMap mount to replace; FAIRLIMIT_CONFIG points there.
COPY descriptors /etc/fairlimit/descriptors
ENV PATH=/opt/fairlimit/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    FAIRLIMIT_CONFIG=/etc/fairlimit/descriptors
# envoyproxy/ratelimit's command, for manifests that name /bin/ratelimit (/bin is /usr/bin;
# the file is executable in git, and COPY keeps its mode).
COPY docker/ratelimit /usr/bin/ratelimit
USER 10001:10001
WORKDIR /tmp
# 8081: gRPC (RateLimitService, grpc.health.v1, reflection); 8080: HTTP admin.
EXPOSE 8081 8080
# Asks the admin port's GET /healthz (plain HTTP), so it works whether gRPC is served in
# plaintext or over TLS/mTLS. It expects the admin port of CMD below (8080).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["fairlimit"]
# The admin port binds all interfaces in a container so that probes and scrapers reach it.
CMD ["serve", "--admin-addr", "0.0.0.0:8080"]
