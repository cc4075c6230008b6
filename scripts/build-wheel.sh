#!/usr/bin/env bash
# Builds the one wheel a user needs (distribution mscclpp-rs, abi3, Python >= 3.9), tagged
# manylinux_2_28 like PyTorch's own wheels:
#   mscclpp/_mscclpp.abi3.so         the Python extension
#   mscclpp/lib/libmscclpp_nccl.so   the NCCL shim (`python -m mscclpp --nccl-lib` prints its path)
#   mscclpp/lib/libnccl.so.2         a 2 KB stub standing for the shim under NCCL's name
# A wheel is a zip and cannot hold symlinks, so libnccl.so.2 is not a second copy of the shim but
# an ELF with no code, SONAME libnccl.so.2, NEEDED libmscclpp_nccl.so and RUNPATH $ORIGIN: a
# program linked against -lnccl (LD_LIBRARY_PATH=that folder) or a dlopen("…/libnccl.so.2") loads
# the shim through it, and the loader reuses the shim when it is already loaded (LD_PRELOAD), so
# one process never holds two copies of it.
#
# Both libraries are linked by zig against glibc 2.28 (scripts/zig-cc.sh; zig from PyPI's
# ziglang, no container or sysroot), in a target dir of their own (target/wheel): the linker is
# part of cargo's fingerprint, so sharing target/ with the ordinary builds would rebuild
# everything on each switch. Debug info is left out there (symbols stay, for backtraces).
#
# Both embed the kernels compiled ahead of time (scripts/aot-blob.sh; backend-cuda/src/aot.rs), so
# a fresh machine runs without compiling them: with --aot ARCHS the CUBIN targets (PTX for GPUs
# newer than sm_120 comes with them), --aot none embeds nothing. The default is every target
# (sm_80,sm_90,sm_100,sm_120) for release and none for dev (CI's Python check, which runs no
# kernel); a blob already named by MSCCLPP_AOT_BLOB is embedded as it is (scripts/gpu-stage.sh).
# The same for AMD GPUs: --aot-hip TARGETS embeds code objects (scripts/aot-blob.sh --hip;
# backend-rocm/src/aot.rs), by default gfx90a,gfx942 for release and none for dev, or the blob
# MSCCLPP_AOT_HIP_BLOB names.
#
# Usage: scripts/build-wheel.sh [--profile dev|release] [--arch x86_64|aarch64] [--aot ARCHS|none]
#          [--aot-hip TARGETS|none] [-o DIR]
#   aarch64 cross-builds (zig links it; needs `rustup target add aarch64-unknown-linux-gnu`).
# Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
profile=release arch=$(uname -m) out=target/wheels aot= aot_hip=
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --arch) arch=$2; shift 2 ;;
    --aot) aot=$2; shift 2 ;;
    --aot-hip) aot_hip=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    *) echo "build-wheel: unknown argument $1 (--profile dev|release, --arch x86_64|aarch64, --aot ARCHS|none, --aot-hip TARGETS|none, -o DIR)" >&2; exit 2 ;;
  esac
done
case "$arch" in
  x86_64 | aarch64) ;;
  *) echo "build-wheel: --arch must be x86_64 or aarch64, not $arch" >&2; exit 2 ;;
esac
case "$profile" in
  dev) profile_dir=debug ;;
  release) profile_dir=release ;;
  *) echo "build-wheel: --profile must be dev or release, not $profile" >&2; exit 2 ;;
esac
if [ -z "$aot" ]; then
  if [ -n "${MSCCLPP_AOT_BLOB:-}" ]; then aot=given; elif [ "$profile" = release ]; then aot=sm_80,sm_90,sm_100,sm_120; else aot=none; fi
fi
case "$aot" in
  given) ;;
  none) unset MSCCLPP_AOT_BLOB ;;
  *)
    # Built for this machine in the ordinary target dir, before the wheel's settings below.
    MSCCLPP_AOT_BLOB=$(bash scripts/aot-blob.sh "$aot" | tail -n 1)
    export MSCCLPP_AOT_BLOB
    ;;
esac
if [ -z "$aot_hip" ]; then
  if [ -n "${MSCCLPP_AOT_HIP_BLOB:-}" ]; then aot_hip=given; elif [ "$profile" = release ]; then aot_hip=gfx90a,gfx942; else aot_hip=none; fi
fi
case "$aot_hip" in
  given) ;;
  none) unset MSCCLPP_AOT_HIP_BLOB ;;
  *)
    MSCCLPP_AOT_HIP_BLOB=$(bash scripts/aot-blob.sh --hip "$aot_hip" | tail -n 1)
    export MSCCLPP_AOT_HIP_BLOB
    ;;
esac
for blob in "${MSCCLPP_AOT_BLOB:-}" "${MSCCLPP_AOT_HIP_BLOB:-}"; do
  if [ -n "$blob" ]; then
    echo "build-wheel: embedding $blob ($(du -k "$blob" | cut -f1) KiB)" >&2
  fi
done
triple="$arch-unknown-linux-gnu"
# shellcheck source=scripts/python-tools.sh
source scripts/python-tools.sh
export MSCCLPP_PY_TOOLS="$root/$py_tools" MSCCLPP_ZIG_TARGET="$arch-linux-gnu.2.28"
export CARGO_TARGET_DIR="$root/${CARGO_TARGET_DIR_WHEEL:-target/wheel}"
upper=$(tr 'a-z-' 'A-Z_' <<<"$triple")
export "CARGO_TARGET_${upper}_LINKER=$root/scripts/zig-cc.sh"
prof=$(tr 'a-z' 'A-Z' <<<"$profile")
export "CARGO_PROFILE_${prof}_DEBUG=0" "CARGO_PROFILE_${prof}_STRIP=debuginfo"
# --target even for the host's own triple, so x86_64 and aarch64 builds lie side by side
# (target/wheel/<triple>/) and take the same path.
target_args=(--target "$triple")
if ! rustup target list --installed 2>/dev/null | grep -qx "$triple"; then
  echo "build-wheel: the Rust standard library for $triple is not installed" \
    "(rustup target add $triple)" >&2
  exit 1
fi
start=$(date +%s)
cargo build -q -p mscclpp-nccl --profile "$profile" "${target_args[@]}"
lib=python/mscclpp/lib
rm -rf "$lib" && mkdir -p "$lib"
cp "$CARGO_TARGET_DIR/$triple/$profile_dir/libmscclpp_nccl.so" "$lib/"
# The stub: linked against an empty library named libmscclpp_nccl.so so that NEEDED records that
# name (linking against the shim itself would record its SONAME, libnccl.so.2: itself).
# python/mscclpp/lib exists only while maturin packs it, so a later `pip install ./python`
# cannot pick up a stale shim.
stub_src=$(mktemp -d)
trap 'rm -rf "$stub_src" "$root/$lib"' EXIT
: >"$stub_src/empty.c"
zigcc=("$root/$py_tools/bin/python3" -m ziglang cc -target "$MSCCLPP_ZIG_TARGET" -shared -nostdlib)
"${zigcc[@]}" -o "$stub_src/libmscclpp_nccl.so" "$stub_src/empty.c" -Wl,-soname,libmscclpp_nccl.so
"${zigcc[@]}" -o "$lib/libnccl.so.2" "$stub_src/empty.c" -Wl,-soname,libnccl.so.2 \
  -Wl,--no-as-needed -Wl,-rpath,'$ORIGIN' -L"$stub_src" -lmscclpp_nccl
mkdir -p "$out"
rm -f "$out"/mscclpp_rs-*-manylinux_2_28_"$arch".whl
# The extension, linked the same way; --compatibility makes maturin refuse a symbol newer than
# glibc 2.28 (its own auditwheel check) instead of tagging the wheel higher.
"$py_tools/bin/maturin" build -q -m python/Cargo.toml --profile "$profile" "${target_args[@]}" \
  --compatibility manylinux_2_28 -o "$out"
whl=$(ls "$out"/mscclpp_rs-*-manylinux_2_28_"$arch".whl)
echo "build-wheel: $whl ($(du -k "$whl" | cut -f1) KiB, $(( $(date +%s) - start )) s)" >&2
echo "$whl"
