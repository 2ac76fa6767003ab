# zoo-gym coordinator (CPU): gRPC for contributors, REST for operators, the round loop.
# Build from the repository root:
#   docker build -f deploy/coordinator.Dockerfile -t zoo-gym-coordinator:0.1.0 .
# The home (config, keys, TLS files, models, SQLite ledger when no PostgreSQL) is the volume
# /var/lib/zoo-gym; create it once with `docker run ... zoo-gym-coordinator:0.1.0 init ...`.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# a C compiler builds the C extensions: BitDelta packing (zoo_gym/compression/_bitpack.c) and
# the median / trimmed mean kernel (zoo_gym/aggregation/_orderstat.c)
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/zoo-gym
ENV PATH=/opt/zoo-gym/bin:$PATH
# the CPU wheel: no CUDA libraries in a coordinator image
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY zoo_gym ./zoo_gym
RUN pip install ".[postgres]" && find /opt/zoo-gym -name '__pycache__' -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="zoo-gym coordinator" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 zoo \
 && useradd --system --uid 10001 --gid zoo --home-dir /var/lib/zoo-gym --create-home --shell /usr/sbin/nologin zoo \
 && chmod 0700 /var/lib/zoo-gym
COPY --from=build /opt/zoo-gym /opt/zoo-gym
COPY deploy/healthcheck.py /opt/zoo-gym/healthcheck.py
ENV PATH=/opt/zoo-gym/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=4 \
    ZOO_GYM_HEALTH_URL=http://127.0.0.1:8080/health
USER zoo:zoo
WORKDIR /var/lib/zoo-gym
VOLUME ["/var/lib/zoo-gym"]
# 7443: gRPC (contributors), 8080: REST (operators, /metrics, contributors' reward reports)
EXPOSE 7443 8080
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
  CMD ["python", "/opt/zoo-gym/healthcheck.py"]
ENTRYPOINT ["gym-coordinator"]
CMD ["serve", "--config", "/var/lib/zoo-gym/coordinator/coordinator.toml"]
