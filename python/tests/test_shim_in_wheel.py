"""The NCCL shim the wheel holds (scripts/build-wheel.sh): `python -m mscclpp --nccl-lib`, and the
registrations AlgorithmCollectionBuilder shares with the shim when it is loaded in the process
(preloaded, or opened under NCCL's name): the plans land in the shim's registry, which its
communicators take them from (a GPU check: python/examples/dsl_with_nccl_api.py), and the selector
answers the shim as a communicator asks it (through mscclppNcclAskSelector)."""

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

PLAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "dsl", "allgather_put_2.json")

# Registers a plan and a selector, then asks the shim what it holds and what the selector answers.
SHARE = f"""
import ctypes, mscclpp
from mscclpp import _shim
plan = mscclpp.ExecutionPlan({PLAN!r})
builder = mscclpp.AlgorithmCollectionBuilder()
builder.add_algorithm_builder(mscclpp.Algorithm(execution_plan=plan))
seen = []
def selector(algorithms, request):
    seen.append(request)
    if request.message_size == 1:
        raise RuntimeError("a bug in the selector")
    return algorithms[request.collective][plan.name] if request.message_size < 4096 else None
builder.set_algorithm_selector(selector)
lib = _shim._loaded()
lib.mscclppNcclDescribeRegistry.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
text, length = ctypes.create_string_buffer(512), ctypes.c_size_t()
assert lib.mscclppNcclDescribeRegistry(text, 512, ctypes.byref(length)) == 0
print("registry:", text.value.decode())
lib.mscclppNcclAskSelector.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
def ask(size):
    request = _shim.SelectionRequest(b"allgather", size, b"f32", 2, 2, 1, None, 1, 0)
    name, answered = ctypes.create_string_buffer(256), ctypes.c_int()
    code = lib.mscclppNcclAskSelector(ctypes.byref(request), name, 256, ctypes.byref(answered))
    return code, answered.value, name.value.decode()
print("ask 1024:", ask(1024))
print("ask 8192:", ask(8192))
print("ask 1:", ask(1))
lib.ncclGetLastError.restype = ctypes.c_char_p
print("last error:", lib.ncclGetLastError(None).decode())
print("request:", seen[0])
print("plan:", plan.name)
"""


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


def _shared(result):
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    name = lines["plan"]
    assert lines["registry"] == f"plans: {name}; selector: set"
    assert lines["ask 1024"] == f"(0, 1, '{name}')"  # the plan, by its name
    assert lines["ask 8192"] == "(0, 0, '')"  # no answer: the shim's own choice
    assert lines["ask 1"].startswith("(4, ")  # the selector raised: ncclInvalidArgument
    assert "a bug in the selector" in result.stderr  # and its traceback is printed
    assert "the registered selector failed for allgather of 1 bytes" in lines["last error"]
    want = ("CollectiveRequest(collective='allgather', message_size=1024, "
            "dtype=<DataType.float32: 'f32'>, world_size=2, rank=1, stream=0, "
            "symmetric_memory=False, in_place=True, nranks_per_node=2)")
    assert lines["request"] == want


@needs_shim
def test_registrations_reach_the_preloaded_shim():
    _shared(_python(SHARE, LD_PRELOAD=str(_shim.SHIM)))


@needs_shim
def test_registrations_reach_the_shim_opened_under_nccls_name():
    code = "import ctypes\nfrom mscclpp import _shim\nctypes.CDLL(str(_shim.NCCL_NAME))\n" + SHARE
    _shared(_python(code))


@needs_shim
def test_a_plan_the_shim_refuses_is_an_error_naming_why(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "half a plan"')
    code = ("from types import SimpleNamespace\nfrom mscclpp import _shim\n"
            f"_shim.share_plan(SimpleNamespace(path={str(bad)!r}))\n")
    result = _python(code, LD_PRELOAD=str(_shim.SHIM))
    assert result.returncode != 0
    assert "ValueError" in result.stderr and "the plan is refused" in result.stderr, result.stderr


@needs_shim
def test_last_error_reads_the_shims_reason(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "half a plan"')
    code = ("from types import SimpleNamespace\nfrom mscclpp import _shim\n"
            "try:\n"
            f"    _shim.share_plan(SimpleNamespace(path={str(bad)!r}))\n"
            "except ValueError:\n"
            "    pass\n"
            "print('last error:', _shim.last_error())\n")
    result = _python(code, LD_PRELOAD=str(_shim.SHIM))
    assert result.returncode == 0, result.stderr
    assert "last error:" in result.stdout and "the plan is refused" in result.stdout, result.stdout
    without = _python("from mscclpp import _shim\nprint(_shim.last_error())\n")
    assert without.returncode == 0 and without.stdout.strip() == "None", without.stderr
