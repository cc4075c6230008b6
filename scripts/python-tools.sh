# Sourced by python-test.sh, build-wheel.sh and gpu-stage.sh: maturin, pytest, ziglang (the wheel's
# linker, scripts/zig-cc.sh) and auditwheel (its tag check) from PyPI in target/py-tools (made
# once, kept with cargo's target dir). Sets $py_tools.
py_tools=target/py-tools
if [ ! -x "$py_tools/bin/maturin" ] || [ ! -x "$py_tools/bin/pytest" ] || [ ! -x "$py_tools/bin/auditwheel" ] ||
  ! "$py_tools/bin/python3" -c 'import ziglang' 2>/dev/null; then
  [ -x "$py_tools/bin/python3" ] || python3 -m venv "$py_tools"
  "$py_tools/bin/pip" install -q --disable-pip-version-check "maturin>=1.5,<2" pytest "ziglang>=0.13,<0.18" auditwheel
fi
