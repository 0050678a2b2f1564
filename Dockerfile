# hpcml in a container: `docker build -t hpcml:cpu .` (CPU) or
# `docker build --build-arg VARIANT=cuda -t hpcml:cuda .` (CUDA: torch's CUDA wheels bring their
# own CUDA libraries; the node's driver comes in through the NVIDIA container toolkit).
# The manifests of `hpcml launch k8s` run `python -m hpcml.launch.agent` in it as user 1000.
# tests/unit/test_dockerfile.py checks the properties below (hadolint too where installed).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtualenv with torch and hpcml, compilers only here ----
FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Where torch comes from: the CPU wheels for VARIANT=cpu; PyPI's default (CUDA) wheels for cuda.
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ARG EXTRAS=serve,track,observe,onnx
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential=12.9 \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN case "${VARIANT}" in \
      cpu) pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_CPU}" ;; \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      *) echo "VARIANT must be cpu or cuda, not ${VARIANT}" >&2; exit 2 ;; \
    esac
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# hpcml itself, from this folder: its dependencies' ranges are pyproject.toml's.
# hadolint ignore=DL3013
RUN pip install ".[${EXTRAS}]"

# ---- runtime: the virtualenv on a clean base; no compilers, not root ----
FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="hpcml" \
      org.opencontainers.image.description="hpcml (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 1000 hpcml \
    && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin hpcml
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HPCML_VARIANT=${VARIANT}
WORKDIR /home/hpcml
USER 1000:1000
ENTRYPOINT ["hpcml"]
CMD ["--help"]
