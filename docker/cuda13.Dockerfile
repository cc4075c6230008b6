# mscclpp-rs on CUDA13: builds the workspace and the benchmark. The CUDA driver and NVRTC are loaded at
# run time, so the same binaries also run on hosts with a newer driver.
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
        curl ca-certificates build-essential pkg-config python3 python3-venv git \
        libibverbs-dev rdma-core \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component clippy,rustfmt
ENV PATH=/root/.cargo/bin:$PATH \
    CUDA_HOME=/usr/local/cuda \
    MSCCLPP_CACHE_DIR=/var/cache/mscclpp
WORKDIR /opt/mscclpp-rs
COPY . .
RUN cargo build --release --workspace --features ib
# Default: the benchmark over every visible GPU.
CMD ["target/release/mscclpp-bench"]
