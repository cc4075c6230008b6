# Sourced by python-test.sh and gpu-stage.sh: maturin and pytest from PyPI in target/py-tools
# (made once, kept with cargo's target dir). Sets $py_tools.
py_tools=target/py-tools
if [ ! -x "$py_tools/bin/maturin" ] || [ ! -x "$py_tools/bin/pytest" ]; then
  python3 -m venv "$py_tools"
  "$py_tools/bin/pip" install -q "maturin>=1.5,<2" pytest
fi
