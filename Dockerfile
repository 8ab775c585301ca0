# The k8s-rendezvous operator: kopf and the Kubernetes client at the versions in uv.lock,
# no torch (training images install the pod side with `pip install k8s-rendezvous`).
#   docker build -t k8s-rendezvous-operator:0.1.0 .
# The chart runs it as user 65532 with a read-only root filesystem and /tmp on an emptyDir.

# The base by digest, so that a build is repeatable (the tag moves with every Debian and
# Python patch). Override it to build on another base: --build-arg PYTHON_IMAGE=...
# (devkit/cluster/images.py does, with a base made locally). The digest was taken from
# public pins of python:3.11-slim-bookworm; check it with
# `docker buildx imagetools inspect python:3.11-slim-bookworm@sha256:...` before a release.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b
# k8s_rendezvous.__version__, given by whoever builds (the release workflow, images.py).
ARG VERSION=""

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=never
RUN pip install "uv==0.13.9"
WORKDIR /src
# Only what the distribution is built from (see .dockerignore).
COPY pyproject.toml uv.lock README.md ./
COPY handler/ handler/
COPY operator/ operator/
# The locked dependencies of the "operator" extra and the project itself (not editable);
# none of the dependency groups (tests, torch, linters). Bytecode is compiled here: the
# root filesystem is read-only at run time, and a standby takes over faster.
RUN uv sync --frozen --no-default-groups --extra operator --no-editable

FROM ${PYTHON_IMAGE}
ARG VERSION
LABEL org.opencontainers.image.title="k8s-rendezvous-operator" \
      org.opencontainers.image.description="The k8s-rendezvous operator: seals elastic training rendezvous rounds kept in a Kubernetes custom resource" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
# kopf's liveness endpoint (--liveness, default http://0.0.0.0:8080/healthz).
EXPOSE 8080
ENTRYPOINT ["k8s-rendezvous-operator"]
