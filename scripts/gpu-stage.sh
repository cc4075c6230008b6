#!/usr/bin/env bash
# Builds the release binaries the GPU machine runs and copies them into .gpu/ (ignored by git; the
# device tool carries it). The GPU machine has no Rust: everything it runs is built here.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every binary embeds the kernels compiled ahead of time (scripts/aot-blob.sh), for sm_90 only:
# the GPU machine is an H200, and each binary carries its own copy (the device tool carries at
# most 64 MiB). MSCCLPP_AOT_BLOB=none stages binaries that compile every kernel at run time.
wheel_aot=()
if [ "${MSCCLPP_AOT_BLOB:-}" = none ]; then
  unset MSCCLPP_AOT_BLOB
  wheel_aot=(--aot none)
elif [ -z "${MSCCLPP_AOT_BLOB:-}" ]; then
  MSCCLPP_AOT_BLOB=$(bash scripts/aot-blob.sh sm_90 none | tail -n 1)
  export MSCCLPP_AOT_BLOB
fi
cargo build --release -p mscclpp-bench -p mscclpp-tests --bins
cargo build --release -p mscclpp-nccl -p mscclpp-embed
cargo build --release -p mscclpp-examples --examples
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
for b in mscclpp-bench mscclpp-gpu-suite; do
  if [ -x "target/release/$b" ]; then cp "target/release/$b" .gpu/bin/; fi
done
# The NCCL shim, its checks (`bash .gpu/gpu-run.sh nccl [torch|initall|inplace|kill|abort|watchdog|fallback]`) and
# its timings against PyTorch's NCCL (`bash .gpu/gpu-run.sh nccl bench`).
cp target/release/libmscclpp_nccl.so .gpu/lib/
cp nccl/scripts/torch_check.py nccl/scripts/torch_bench.py nccl/scripts/host_cost.py nccl/scripts/torch_divergent.py .gpu/
# The embedded library (libmscclpp_embed.a without debug info, its headers) and the C host stack
# that links it (`bash .gpu/embed/gpu-run.sh`, built there with gcc). The archive travels
# gzipped (20 MiB, 4.4 MiB gzipped) and the shared library stays here (the stack links the
# static one): the device tool carries 64 MiB.
bash embed/package.sh target/release/libmscclpp_embed.a .gpu/embed
rm .gpu/embed/lib/libmscclpp_embed.so
gzip -f .gpu/embed/lib/libmscclpp_embed.a
cp embed/tests/c/stack.c embed/tests/c/gpu-run.sh .gpu/embed/
# The device tool carries at most 64 MiB; debug info is most of each binary (symbols stay, so
# backtraces still name functions).
if command -v strip >/dev/null; then strip --strip-debug .gpu/bin/* .gpu/lib/*; fi
# examples/ (examples/README.md): the Rust programs built above, the C, Python and plan sources.
mkdir -p .gpu/examples
cp target/release/examples/allreduce target/release/examples/execution_plan .gpu/examples/
cp -r examples/c examples/python examples/plans .gpu/examples/
cp nccl/include/nccl.h .gpu/examples/c/
if command -v strip >/dev/null; then strip .gpu/examples/allreduce .gpu/examples/execution_plan; fi
# The execution-plan fixtures, for the suite's `plans` section (it finds them beside bin/), and
# the builder's all-reduce plans for 2, 4 and 8 ranks (the fixtures have plans for 2 and 4 only)
# in .gpu/builder-plans, both for the Python DSL example.
mkdir -p .gpu/plans .gpu/builder-plans
if [ -d ../shared/fixtures/plans ]; then
  cp ../shared/fixtures/plans/*.json .gpu/plans/
else
  echo "gpu-stage: ../shared/fixtures/plans missing: the suite's plans section will check builder plans only" >&2
fi
cargo run -q --release -p mscclpp-executor --example builder_plans -- .gpu/builder-plans 2 4 8
# plan-bench.py times the fixture plans against the native algorithms (`python3 .gpu/plan-bench.py`).
cp scripts/gpu-run.sh scripts/gpu-steps.sh scripts/mps.sh scripts/simulate-hosts.sh scripts/fault-inject.py \
  scripts/plan-bench.py scripts/mps-fault-probe.py .gpu/
# A kernel cache brought back from an earlier machine (gpu-steps.sh saves it as OUT/kcache.tgz).
if [ -f .gpu-kcache.tgz ]; then cp .gpu-kcache.tgz .gpu/kcache.tgz; fi
# The Python package: the release wheel users get (abi3, any Python >= 3.9, manylinux_2_28, the
# shim inside as mscclpp/lib/libmscclpp_nccl.so; scripts/build-wheel.sh, its own target dir
# target/wheel since zig links it), its GPU check and the examples. On the GPU machine:
#   pip install --no-deps --target /tmp/site .gpu/*.whl && bash .gpu/python-run.sh
# The lent machines are NVIDIA ones: no AMD code objects (they would only take carry room).
bash scripts/build-wheel.sh --profile release "${wheel_aot[@]}" --aot-hip none -o .gpu >/dev/null
mkdir -p .gpu/python && cp -r python/examples python/tests .gpu/python/
find .gpu/python -name __pycache__ -prune -exec rm -rf {} +
cp scripts/python-run.sh scripts/cold-start.py scripts/stall-stacks.sh .gpu/
ls -la .gpu/bin
