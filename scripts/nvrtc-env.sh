# Sourced by scripts: makes a CPU-only machine able to compile every kernel through NVRTC.
# Installs PyPI's NVRTC and CUDA headers (no GPU or driver needed) into .venv-nvrtc/<flavour> and
# exports MSCCLPP_NVRTC_LIB and CUDA_HOME for the tests. Flavour: cu13 (default) or cu12. cu13 is pinned to
# 13.5 because the layout asserts need __builtin_offsetof, which older NVRTC lacks; the GPU machines
# compile the same kernels with their own NVRTC 13.0 at run time.
flavour="${MSCCLPP_NVRTC_FLAVOUR:-cu13}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-nvrtc/$flavour"
case "$flavour" in
  cu13) pkgs="nvidia-cuda-nvrtc==13.5.37 nvidia-cuda-runtime==13.5.37"; major=13 ;;
  cu12) pkgs="nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79"; major=12 ;;
  *) echo "MSCCLPP_NVRTC_FLAVOUR must be cu12 or cu13, not '$flavour'" >&2; return 1 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >/dev/null
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check $pkgs
lib="$(find "$venv" -name "libnvrtc.so.$major*" -not -name '*builtins*' | head -n 1)"
inc="$(dirname "$(find "$venv" -name cuda_fp16.h | head -n 1)")"
if [ -z "$lib" ] || [ -z "$inc" ]; then
  echo "NVRTC ($flavour) did not install as expected under $venv" >&2
  return 1
fi
export MSCCLPP_NVRTC_LIB="$lib"
export CUDA_HOME="$(dirname "$inc")"
export MSCCLPP_REQUIRE_NVRTC=1
echo "NVRTC: $MSCCLPP_NVRTC_LIB (headers: $inc)"
