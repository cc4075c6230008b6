# mscclpp-rs on CUDA 12.9 (pinned by the base image's tag): builds the workspace and the benchmark. The
# CUDA driver and NVRTC are loaded at run time, so the same binaries also run on hosts with a newer
# driver. Lint: bash docker/lint.sh. In the container, the README's two commands work as written:
#   cargo run --release -p mscclpp-bench      (the default command, already built)
#   bash scripts/test.sh                      (every CPU test, kernels through NVRTC)
FROM nvidia/cuda:12.9.1-devel-ubuntu22.04
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update && apt-get install -y --no-install-recommends \
        curl ca-certificates build-essential pkg-config python3 python3-venv git \
        libibverbs-dev rdma-core \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain none
ENV PATH=/root/.cargo/bin:$PATH \
    CUDA_HOME=/usr/local/cuda \
    MSCCLPP_CACHE_DIR=/var/cache/mscclpp
WORKDIR /opt/mscclpp-rs
# The toolchain rust-toolchain.toml pins (with clippy and rustfmt), in its own layer.
COPY rust-toolchain.toml .
RUN rustup toolchain install
COPY . .
RUN cargo build --release --workspace --features ib
# The Python package, with the README's command, into a venv first on PATH (the NCCL shim,
# target/release/libmscclpp_nccl.so, is built with the workspace above).
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir ./python
ENV PATH=/opt/venv/bin:$PATH
CMD ["cargo", "run", "--release", "-p", "mscclpp-bench"]
