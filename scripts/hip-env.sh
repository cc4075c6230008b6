# Sourced by scripts: makes a CPU-only Debian 12 machine able to compile every kernel for AMD GPUs
# (the HIP compile gate, backend-rocm/tests/kernels_compile.rs). No GPU or ROCm install needed:
#   gfx90a: ROCm 5.2's hiprtc (inside libamdhip64.so.5, Debian's libamdhip64-5), through the
#           backend's own hiprtc code path;
#   gfx942: clang-19 (Debian 12) with hiprtc's runtime header (libhiprtc-builtins5).
# Installs what is missing with apt-get (root), then exports MSCCLPP_HIP_CLANG,
# MSCCLPP_REQUIRE_HIP=1 (absence fails the gate instead of skipping it) and
# MSCCLPP_HIP_GATE_CACHE (units already compiled by the same compiler are not compiled again).
hip_pkgs="clang-19 libamdhip64-5 libhiprtc-builtins5"
hip_missing=""
for p in $hip_pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || hip_missing="$hip_missing $p"
done
if [ -n "$hip_missing" ]; then
  echo "HIP gate: installing$hip_missing"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $hip_missing >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $hip_missing >/dev/null || {
      echo "HIP gate: apt-get could not install$hip_missing" >&2
      return 1
    }
  fi
fi
export MSCCLPP_HIP_CLANG=clang-19
export MSCCLPP_REQUIRE_HIP=1
export MSCCLPP_HIP_GATE_CACHE="${MSCCLPP_HIP_GATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mscclpp-hip-gate}"
echo "HIP gate: $(clang-19 --version | head -n 1); hiprtc from libamdhip64.so.5 (ROCm 5.2)"
