# mscclpp-rs on ROCm 6.4 (pinned by the base image's tag): HIP and hiprtc are loaded at run time;
# the ROCm backend is selected with MSCCLPP_GPU_BACKEND=rocm or by detection. Lint: bash
# docker/lint.sh. In the container, the README's two commands work as written:
#   cargo run --release -p mscclpp-bench      (the default command, already built)
#   bash scripts/test.sh                      (every CPU test)
FROM rocm/dev-ubuntu-22.04:6.4
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update && apt-get install -y --no-install-recommends \
        curl ca-certificates build-essential pkg-config python3 python3-venv git \
        libibverbs-dev rdma-core \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain none
ENV PATH=/root/.cargo/bin:$PATH \
    ROCM_PATH=/opt/rocm \
    MSCCLPP_GPU_BACKEND=rocm \
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
