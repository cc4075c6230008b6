#!/usr/bin/env bash
# Checks a wheel of scripts/build-wheel.sh the way a user meets it: installed into a fresh venv
# with no Rust on PATH (and no CUDA toolkit), no GPU needed. CI runs it from python-test.sh.
#   - the tag is manylinux_2_28 (auditwheel show) and neither library needs a glibc symbol newer
#     than 2.28 (objdump -T);
#   - `import mscclpp` and mscclpp.__version__ is the workspace's version;
#   - `python -m mscclpp --nccl-lib` prints an existing file inside the installed package, with
#     libnccl.so.2 beside it;
#   - the shim exports every name of nccl/exports.txt and its `p` alias (nm -D), and answers
#     ncclGetVersion through libnccl.so.2 with the very function libmscclpp_nccl.so holds (one
#     copy loaded, not two);
#   - the README's Python example runs as far as it can without a GPU (readme-example-cpu.py).
# A wheel for another architecture than the machine's (aarch64 on x86_64) is checked the same way
# under qemu's user-mode emulation: pip installs it for that platform into a folder, and that
# architecture's Python (a root of Debian's packages, scripts/emu-python-root.sh) runs the checks.
# Usage: scripts/wheel-check.sh WHEEL [VENV]   (VENV default target/wheel-venv, made afresh;
#          for a foreign wheel the install folder, and MSCCLPP_EMU_ROOT names the root)
set -euo pipefail
cd "$(dirname "$0")/.."
whl=${1:?usage: scripts/wheel-check.sh WHEEL [VENV]}
venv=$(realpath -m "${2:-target/wheel-venv}")
whl=$(realpath "$whl")
# shellcheck source=scripts/python-tools.sh
source scripts/python-tools.sh
arch=$(sed -n 's/.*-manylinux_2_28_\(x86_64\|aarch64\)\.whl$/\1/p' <<<"$whl")
[ -n "$arch" ] || { echo "wheel-check: $whl is not tagged manylinux_2_28" >&2; exit 1; }
tag=$("$py_tools/bin/auditwheel" show "$whl" | tr '\n' ' ')
grep -q "consistent with the following platform tag: \"manylinux_2_28_$arch\"" <<<"$tag" ||
  { echo "wheel-check: auditwheel does not find $whl manylinux_2_28_$arch: $tag" >&2; exit 1; }
echo "wheel-check: auditwheel: manylinux_2_28_$arch"

# No Rust from here on: a user's machine has none.
clean_path=$(tr ':' '\n' <<<"$PATH" | grep -v -e '\.cargo' -e 'rustup' | paste -sd: -)
if env PATH="$clean_path" sh -c 'command -v cargo || command -v rustc' >/dev/null; then
  echo "wheel-check: cargo or rustc is still on PATH without ~/.cargo: the check cannot say 'no Rust'" >&2
fi
rm -rf "$venv"
if [ "$arch" = "$(uname -m)" ]; then
  python3 -m venv "$venv"
  py() { env PATH="$clean_path" CARGO_HOME=/nonexistent RUSTUP_HOME=/nonexistent "$venv/bin/python" "$@"; }
  py -m pip install -q --disable-pip-version-check --no-index --no-deps "$whl"
else
  root=${MSCCLPP_EMU_ROOT:-}
  emu_python=$(ls "$root"/usr/bin/python3.* 2>/dev/null | grep -E 'python3\.[0-9]+$' | head -n 1 || true)
  if ! command -v "qemu-$arch-static" >/dev/null || [ -z "$emu_python" ]; then
    echo "wheel-check: an $arch wheel on $(uname -m) needs qemu-$arch-static (Debian's" \
      "qemu-user-static) and MSCCLPP_EMU_ROOT, an $arch Python root (scripts/emu-python-root.sh)" >&2
    exit 1
  fi
  emu_version=$(basename "$emu_python" | sed 's/python//')
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index \
    --no-deps --target "$venv" \
    --platform "manylinux_2_28_$arch" --python-version "$emu_version" --only-binary=:all: "$whl"
  py() {
    env PATH="$clean_path" CARGO_HOME=/nonexistent RUSTUP_HOME=/nonexistent PYTHONPATH="$venv" \
      "qemu-$arch-static" -L "$root" "$emu_python" "$@"
  }
  echo "wheel-check: installed for $arch (Python $emu_version) under qemu-$arch-static"
fi
# Outside the source tree, so the installed package is the one imported.
cd target
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' ../Cargo.toml)
got=$(py -c 'import mscclpp; print(mscclpp.__version__)')
[ "$got" = "$version" ] || { echo "wheel-check: mscclpp.__version__ is $got, the workspace is $version" >&2; exit 1; }
echo "wheel-check: import mscclpp, version $got"
shim=$(py -m mscclpp --nccl-lib)
site=$(py -c 'import mscclpp, os; print(os.path.dirname(mscclpp.__file__))')
case "$shim" in
  "$site"/lib/libmscclpp_nccl.so) ;;
  *) echo "wheel-check: --nccl-lib printed $shim, not $site/lib/libmscclpp_nccl.so" >&2; exit 1 ;;
esac
[ -f "$shim" ] && [ -f "$(dirname "$shim")/libnccl.so.2" ] ||
  { echo "wheel-check: $shim or libnccl.so.2 beside it is missing" >&2; exit 1; }
echo "wheel-check: --nccl-lib: $shim"
for so in "$site/_mscclpp.abi3.so" "$shim"; do
  newest=$(objdump -T "$so" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
  if [ "$(printf '%s\n' "$newest" GLIBC_2.28 | sort -V | tail -n 1)" != GLIBC_2.28 ]; then
    echo "wheel-check: $so needs $newest, newer than GLIBC_2.28" >&2
    exit 1
  fi
  echo "wheel-check: $(basename "$so") needs at most $newest"
done
exports=$(nm -D --defined-only "$shim" | awk '{ print $NF }' | sort -u)
missing=()
while read -r name; do
  for n in "$name" "p$name"; do grep -qx "$n" <<<"$exports" || missing+=("$n"); done
done < <(grep -v -e '^#' -e '^$' ../nccl/exports.txt)
[ ${#missing[@]} -eq 0 ] || { echo "wheel-check: the shim lacks ${missing[*]}" >&2; exit 1; }
echo "wheel-check: the shim exports the $(grep -cv -e '^#' -e '^$' ../nccl/exports.txt) names of nccl/exports.txt and their p aliases"
py - "$shim" <<'EOF'
import ctypes, os, sys
shim = sys.argv[1]
stub = ctypes.CDLL(os.path.join(os.path.dirname(shim), "libnccl.so.2"))
real = ctypes.CDLL(shim)
version = ctypes.c_int(0)
assert stub.ncclGetVersion(ctypes.byref(version)) == 0, "ncclGetVersion failed"
addr = lambda lib: ctypes.cast(lib.ncclAllReduce, ctypes.c_void_p).value
assert addr(stub) == addr(real), "libnccl.so.2 and libmscclpp_nccl.so are two copies"
print(f"wheel-check: through libnccl.so.2: ncclGetVersion = {version.value}, one copy of the shim")
EOF
py ../scripts/readme-example-cpu.py ../README.md
echo "wheel-check: $whl passed"
