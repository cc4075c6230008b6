#!/usr/bin/env bash
# Makes a folder holding another architecture's Python 3.11 and the libraries it and our wheel
# load (Debian 12's packages, unpacked, not installed), for scripts/wheel-check.sh to run a
# foreign wheel under qemu's user-mode emulation (qemu-ARCH-static -L ROOT ROOT/usr/bin/python3.11).
# apt fetches the packages (signed indexes) with the architecture added for the download only.
# A root already complete is left as it is; an interrupted one is never taken for complete (it is
# unpacked beside ROOT and renamed into place). Needs root (apt-get).
# Usage: scripts/emu-python-root.sh ARCH ROOT   (ARCH: aarch64)
set -euo pipefail
arch=${1:?usage: scripts/emu-python-root.sh ARCH ROOT}
root=${2:?usage: scripts/emu-python-root.sh ARCH ROOT}
case "$arch" in
  aarch64) deb_arch=arm64 ;;
  *) echo "emu-python-root: $arch is not supported (aarch64)" >&2; exit 2 ;;
esac
if [ -x "$root/usr/bin/python3.11" ]; then
  exit 0
fi
pkgs="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 libstdc++6
  zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libuuid1 libcrypt1 libnsl2 libtirpc3
  libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libdb5.3"
mkdir -p "$(dirname "$root")"
tmp=$(mktemp -d "$(dirname "$root")/.emu-root.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
added=0
if ! dpkg --print-foreign-architectures | grep -qx "$deb_arch"; then
  dpkg --add-architecture "$deb_arch"
  added=1
fi
fetch() {
  apt-get update -qq &&
    (cd "$tmp" && chmod 777 . && apt-get download -qq $(printf "%s:$deb_arch " $pkgs))
}
status=0
fetch || status=$?
if [ "$added" = 1 ]; then
  dpkg --remove-architecture "$deb_arch"
  apt-get update -qq || true
fi
if [ "$status" != 0 ]; then
  echo "emu-python-root: apt could not fetch the $deb_arch packages" >&2
  exit 1
fi
mkdir "$tmp/root"
for deb in "$tmp"/*.deb; do
  dpkg-deb -x "$deb" "$tmp/root"
done
rm -rf "$root"
mv "$tmp/root" "$root"
echo "emu-python-root: $arch Python in $root ($(du -sm "$root" | cut -f1) MiB)"
