#!/usr/bin/env bash
# Makes the released libmscclpp_embed.a and libmscclpp_embed.so from the crate's staticlib:
#   bash embed/package.sh target/release/libmscclpp_embed.a OUTDIR
# OUTDIR gets lib/libmscclpp_embed.{a,so}, include/{nccl.h,mscclpp_nccl.h,mscclpp.h} and
# link-flags (what a program linking the static library adds after it).
#
# A Rust staticlib exports every Rust symbol of every crate in it (and the plain shim's ncclX),
# which would clash with the host stack's own symbols and other Rust code. So: one partial link
# (`ld -r`) from the exports of exports.txt pulls in what they need and resolves every reference
# among the library's own objects; objcopy then makes every symbol but those exports local, so
# nothing else can be seen, bound or interposed from outside. The embedded LLVM bitcode goes
# (concatenated by the partial link it is no longer valid bitcode, and binutils' LLVM plugin
# aborts on it). The shared library is linked from the same object with a version script.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
staticlib="$1" out="$2"
[ -f "$staticlib" ] || { echo "package.sh: no staticlib at $staticlib (cargo build -p mscclpp-embed first)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
grep -v '^#' "$here/exports.txt" | grep . > "$work/exports"
# Rust's std links against these (rustc --print native-static-libs for x86_64-unknown-linux-gnu).
link_flags="-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"
# -S: without debug info (symbols stay, so backtraces still name functions); debug info of a
# dev build is most of its 200+ MB.
# shellcheck disable=SC2046
ld -r -S -o "$work/whole.o" $(sed 's/^/-u /' "$work/exports") "$staticlib"
objcopy --keep-global-symbols="$work/exports" --remove-section=.llvmbc --remove-section=.llvmcmd \
  "$work/whole.o" "$work/mscclpp_embed.o"
mkdir -p "$out/lib" "$out/include"
rm -f "$out/lib/libmscclpp_embed.a"
ar rcs "$out/lib/libmscclpp_embed.a" "$work/mscclpp_embed.o"
{ echo "{ global:"; sed 's/$/;/' "$work/exports"; echo "local: *; };"; } > "$work/version-script"
# shellcheck disable=SC2086
cc -shared -o "$out/lib/libmscclpp_embed.so" "$work/mscclpp_embed.o" -Wl,--gc-sections \
  -Wl,--version-script="$work/version-script" -Wl,-soname,libmscclpp_embed.so $link_flags
cp "$here/include/mscclpp.h" "$here/../nccl/include/mscclpp_nccl.h" "$here/../nccl/include/nccl.h" "$out/include/"
echo "$link_flags" > "$out/link-flags"
