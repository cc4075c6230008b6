"""The NCCL shim the wheel holds (scripts/build-wheel.sh): `python -m mscclpp --nccl-lib`, and the
warning Python registrations give while the shim is loaded in the process (the shim does not see
them yet: issue #55)."""

import os
import subprocess
import sys

import pytest

from mscclpp import _shim

needs_shim = pytest.mark.skipif(
    not _shim.SHIM.is_file(), reason="this mscclpp was built without the shim (pip install ./python)"
)

REGISTER = (
    "import warnings, mscclpp\n"
    "warnings.simplefilter('error')\n"
    "mscclpp.AlgorithmCollectionBuilder().set_algorithm_selector(lambda algorithms, request: None)\n"
)


def _python(code, **env):
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=120,
    )


@needs_shim
def test_nccl_lib_prints_the_shim_inside_the_package():
    out = subprocess.run(
        [sys.executable, "-m", "mscclpp", "--nccl-lib"], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == str(_shim.SHIM) and os.path.isfile(out)
    assert os.path.isfile(os.path.join(os.path.dirname(out), "libnccl.so.2"))


def test_no_shim_in_process_no_warning():
    result = _python(REGISTER + "from mscclpp import _shim\nassert not _shim.in_process()\n")
    assert result.returncode == 0, result.stderr


@needs_shim
def test_registrations_warn_while_the_shim_is_preloaded():
    result = _python(REGISTER, LD_PRELOAD=str(_shim.SHIM))
    assert result.returncode != 0 and "RuntimeWarning" in result.stderr, result.stderr
    assert "does not see algorithms or selectors registered in Python" in result.stderr


@needs_shim
def test_registrations_warn_while_the_shim_is_opened():
    code = "import ctypes\nfrom mscclpp import _shim\nctypes.CDLL(str(_shim.NCCL_NAME))\n" + REGISTER
    result = _python(code)
    assert result.returncode != 0 and "RuntimeWarning" in result.stderr, result.stderr
