# Sourced by scripts: makes a CPU-only Debian 12 machine able to compile every kernel for AMD GPUs
# (the HIP compile gate, backend-rocm/tests/kernels_compile.rs). No GPU or ROCm install needed:
#   gfx90a: ROCm 5.2's hiprtc (inside libamdhip64.so.5, Debian's libamdhip64-5), through the
#           backend's own hiprtc code path;
#   gfx942: clang-19 (Debian 12) with hiprtc's runtime header (libhiprtc-builtins5).
#   code objects for both (mscclpp-aot --hip, and the gate's link test): clang-19 and lld-19 with
#           ROCm 6.0's device libraries (Debian 13's rocm-device-libs-17, bitcode only: fetched
#           as a .deb from Debian's archive, checked against its SHA-256 and unpacked into the
#           cache, not installed; Debian 12's ROCm 5.2 libraries have no gfx942 build).
# Installs what is missing with apt-get (root), then exports MSCCLPP_HIP_CLANG,
# MSCCLPP_HIP_DEVICE_LIBS, MSCCLPP_REQUIRE_HIP=1 (absence fails the gate instead of skipping it)
# and MSCCLPP_HIP_GATE_CACHE (units already compiled by the same compiler are not compiled again).
hip_pkgs="clang-19 lld-19 libamdhip64-5 libhiprtc-builtins5"
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
hip_devlibs_deb=rocm-device-libs-17_6.0+git20231212.5a852ed-2_amd64.deb
hip_devlibs_sha256=fa10f0f5be5269c715492e4e3d3816f956a4d8b9098443d54052d351cfda9213
hip_devlibs_root="${XDG_CACHE_HOME:-$HOME/.cache}/mscclpp-hip-device-libs/${hip_devlibs_sha256:0:16}"
hip_devlibs="$hip_devlibs_root/usr/lib/llvm-17/lib/clang/17/amdgcn/bitcode"
if [ ! -f "$hip_devlibs/oclc_isa_version_942.bc" ]; then
  echo "HIP gate: fetching ROCm 6.0's device libraries ($hip_devlibs_deb)"
  mkdir -p "$(dirname "$hip_devlibs_root")"
  hip_tmp=$(mktemp -d "$(dirname "$hip_devlibs_root")/.fetch.XXXXXX")
  if ! curl -fsS --retry 3 --max-time 120 -o "$hip_tmp/devlibs.deb" \
      "http://deb.debian.org/debian/pool/main/r/rocm-device-libs/$hip_devlibs_deb"; then
    echo "HIP gate: could not fetch $hip_devlibs_deb from deb.debian.org" >&2
    rm -rf "$hip_tmp"
    return 1
  fi
  if ! echo "$hip_devlibs_sha256  $hip_tmp/devlibs.deb" | sha256sum -c --quiet -; then
    echo "HIP gate: $hip_devlibs_deb does not have the SHA-256 it is pinned to" >&2
    rm -rf "$hip_tmp"
    return 1
  fi
  # Unpacked beside the cache and renamed into place: an interrupted unpack is never taken
  # for a complete one.
  rm -rf "$hip_devlibs_root"
  dpkg-deb -x "$hip_tmp/devlibs.deb" "$hip_tmp/root"
  mv "$hip_tmp/root" "$hip_devlibs_root"
  rm -rf "$hip_tmp"
fi
export MSCCLPP_HIP_DEVICE_LIBS="$hip_devlibs"
export MSCCLPP_HIP_CLANG=clang-19
export MSCCLPP_REQUIRE_HIP=1
export MSCCLPP_HIP_GATE_CACHE="${MSCCLPP_HIP_GATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mscclpp-hip-gate}"
echo "HIP gate: $(clang-19 --version | head -n 1); hiprtc from libamdhip64.so.5 (ROCm 5.2); device libraries of ROCm 6.0 in $hip_devlibs"
