#!/bin/sh
# The linker of the wheel's shared libraries (scripts/build-wheel.sh): zig's cc through maturin,
# against zig's glibc 2.28 stubs, so both .so files need nothing newer than GLIBC_2.28 and the
# wheel is tagged manylinux_2_28 (PyTorch's own floor). MSCCLPP_ZIG_TARGET picks the arch
# (x86_64-linux-gnu.2.28 or aarch64-linux-gnu.2.28); MSCCLPP_PY_TOOLS is the venv holding maturin and
# ziglang (scripts/python-tools.sh).
tools="${MSCCLPP_PY_TOOLS:?MSCCLPP_PY_TOOLS must name the venv with maturin and ziglang}"
export CARGO_ZIGBUILD_ZIG_COMMAND="$tools/bin/python3"
export CARGO_ZIGBUILD_ZIG_COMMAND_ARGS='-m ziglang'
exec "$tools/bin/maturin" zig cc -- -g -fno-sanitize=all -target "${MSCCLPP_ZIG_TARGET:-x86_64-linux-gnu.2.28}" "$@"
