# syntax=docker/dockerfile:1
# k31 serving image for NVIDIA platforms: a documented starting point for the image the seed measured
# ("Agentic Long-Context Deployment", Container image): SGLang commit 9ab3c28176 plus one unmerged change,
# FlashInfer 0.7.2, sgl-deep-gemm, and a Dynamo 1.6.0 build with Kimi K3.1 Pro and session-affinity patches.
# Neither the unmerged SGLang change nor the Dynamo patches are public, so this file cannot rebuild the
# measured image byte for byte: it builds the same stack from what the build context and build args give.
#
# Build context: an SGLang checkout (the seed's branch: git clone -b kimi-k31-pro
# https://github.com/sgl-project/sglang.git, at 9ab3c28176 with the unmerged change applied):
#   docker build -f docker/k31.Dockerfile -t k31/sglang:kimi-k31-pro /path/to/sglang
# k31_image builds it the same way (k31_image_source=build, k31_image_build_context=/path/to/sglang).
# MI350X / MI355X use a ROCm 10 image with the Kimi K3.1 ROCm port instead (seed: <K31_MI35X_IMAGE>).

# A CUDA release that compiles for Blackwell Ultra (sm_103 needs CUDA 12.9; k31 pre-flight checks the driver).
ARG BASE_IMAGE=nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

# What the seed names; override to match the checkout and the wheels at hand.
ARG SGLANG_COMMIT=9ab3c28176
ARG FLASHINFER_VERSION=0.7.2
ARG DEEP_GEMM_SPEC=sgl-deep-gemm
# Upstream 1.6.0 lacks the seed's Kimi K3.1 Pro and session-affinity patches; point this at the patched wheels
# (e.g. a local index or file paths) where you have them.
ARG DYNAMO_SPEC="ai-dynamo==1.6.0 ai-dynamo-runtime==1.6.0"
ARG ROUTER_SPEC=sglang-router

LABEL org.opencontainers.image.title="k31 SGLang serving image (Kimi-K3.1-Pro)" \
      k31.sglang.commit="${SGLANG_COMMIT}" \
      k31.flashinfer.version="${FLASHINFER_VERSION}" \
      k31.dynamo.spec="${DYNAMO_SPEC}"

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/sglang \
    PATH=/opt/sglang/bin:${PATH}

# RDMA user space for NCCL and Mooncake (field notes §6), git for SGLang's version, numactl for pinning.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git build-essential \
      rdma-core ibverbs-utils libibverbs-dev numactl ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "${VIRTUAL_ENV}" \
 && pip install --upgrade pip setuptools wheel

# The seed's install: pip install -e "python" from the checkout (the build context).
WORKDIR /sgl-workspace/sglang
COPY . /sgl-workspace/sglang
RUN pip install -e "python" \
 && pip install "flashinfer-python==${FLASHINFER_VERSION}" ${DEEP_GEMM_SPEC} \
 && pip install ${DYNAMO_SPEC} ${ROUTER_SPEC}

# Fail the build early if the stack does not import (the engines' and the router's entry points).
RUN python3 -c "import sglang, flashinfer, dynamo, sglang_router; print('k31 image: sglang', sglang.__version__)"

WORKDIR /sgl-workspace
