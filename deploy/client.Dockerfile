# zoo-gym contributor (CUDA): `gym-client join` with flash-attn and bitsandbytes.
# Build from the repository root:
#   docker build -f deploy/client.Dockerfile -t zoo-gym-client:0.1.0 .
# Run (NVIDIA Container Toolkit):
#   docker run --gpus all -v zoo-contributor:/var/lib/zoo-gym zoo-gym-client:0.1.0 init --home /var/lib/zoo-gym/contributor --name alice
#   docker run --gpus all -v zoo-contributor:/var/lib/zoo-gym zoo-gym-client:0.1.0 \
#       join coordinator.example.org:7443 --home /var/lib/zoo-gym/contributor \
#       --data /var/lib/zoo-gym/data.jsonl --ca-cert /var/lib/zoo-gym/ca.pem --device cuda

ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# flash-attn compiles against torch and nvcc, so the build stage is the devel image
FROM ${CUDA_DEVEL_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MAX_JOBS=${MAX_JOBS}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ninja-build \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/zoo-gym
ENV PATH=/opt/zoo-gym/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
 && pip install packaging psutil wheel setuptools
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY zoo_gym ./zoo_gym
# the gpu extra: triton, bitsandbytes and flash-attn (built against the torch above)
RUN pip install --no-build-isolation ".[gpu]" \
 && find /opt/zoo-gym -name '__pycache__' -prune -exec rm -rf {} +

FROM ${CUDA_RUNTIME_IMAGE}
LABEL org.opencontainers.image.title="zoo-gym contributor" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small launcher at run time: it needs a C compiler and Python's headers
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 zoo \
 && useradd --system --uid 10001 --gid zoo --home-dir /var/lib/zoo-gym --create-home --shell /usr/sbin/nologin zoo \
 && chmod 0700 /var/lib/zoo-gym
COPY --from=build /opt/zoo-gym /opt/zoo-gym
ENV PATH=/opt/zoo-gym/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/var/lib/zoo-gym/hf \
    TRITON_CACHE_DIR=/var/lib/zoo-gym/triton
USER zoo:zoo
WORKDIR /var/lib/zoo-gym
VOLUME ["/var/lib/zoo-gym"]
ENTRYPOINT ["gym-client"]
CMD ["--help"]
