"""`mscclpp.compile(algo, algo_spec, rank)`: runs a DSL program and gives its plan as an Algorithm.

`algo(algo_spec, **kwargs)` must return the `CollectiveProgram` it wrote. Its plan is written
once into the plan cache, `MSCCLPP_CACHE_DIR` (default `~/.cache/mscclpp`), as `<key>.json`,
where the key is a hash of everything that shapes the plan: the DSL's own source, the program's
source (the whole file the function is in, so helpers there count too), its name, every
AlgoSpec field and the keyword arguments. Every rank computes the same key, so every rank loads
the same file. A file is written to a temporary name and renamed into place, so a reader never
sees half a plan; each cached plan carries the key and a digest of its content, and a file whose
key or digest do not match (a partial copy, a hand edit, another version's file under the same
name) is rebuilt, never trusted.
"""

import dataclasses
import hashlib
import inspect
import json
import marshal
import os
import tempfile
from pathlib import Path

from . import _mscclpp
from .algorithm import Algorithm
from .language import program as _program
from .language.types import DslError
from .language.utils import AlgoSpec

__all__ = ["DslCompiler", "compile"]

# Bump when the cache's own layout changes.
_CACHE_FORMAT = 1
_CACHE_FIELD = "mscclpp_rs_cache"


def _dsl_digest():
    """A hash of the DSL's sources: a fix in the DSL invalidates every cached plan."""
    h = hashlib.sha256()
    root = Path(_program.__file__).parent
    for f in sorted(root.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _source_of(algo):
    """The text that defines `algo`: its whole source file where there is one, else its code."""
    target = getattr(algo, "__wrapped__", algo)
    try:
        path = inspect.getsourcefile(target)
        if path and os.path.isfile(path):
            return Path(path).read_text(errors="replace") + "\n#" + getattr(target, "__qualname__", "")
        return inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None) or getattr(getattr(target, "__call__", None), "__code__", None)
        if code is None:
            raise DslError(f"compile: cannot find the source or code of {algo!r} to key its plan") from None
        return marshal.dumps(code).hex()


def _canonical(value):
    """A JSON-able, order-independent description of an AlgoSpec field or keyword argument."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "describe"):
        return _canonical(value.describe())
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "value") and hasattr(type(value), "__members__"):  # an Enum
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def _digest(plan):
    return hashlib.sha256(json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def plan_key(algo, algo_spec, kwargs):
    """The cache key of the plan `algo(algo_spec, **kwargs)` writes (the same on every rank)."""
    described = {
        "format": _CACHE_FORMAT,
        "dsl": _dsl_digest(),
        "source": hashlib.sha256(_source_of(algo).encode()).hexdigest(),
        "algo": getattr(algo, "__qualname__", repr(algo)),
        "spec": _canonical(algo_spec),
        "kwargs": _canonical(kwargs),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def _read_cached(path, key):
    """The cached plan at `path` if it is whole and is the plan of `key`, else None."""
    try:
        plan = json.loads(path.read_text())
        stamp = plan.pop(_CACHE_FIELD)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(stamp, dict) or stamp.get("key") != key or stamp.get("digest") != _digest(plan):
        return None
    return plan


def write_atomically(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache's plans from other users
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def cache_dir():
    """The plan cache: `MSCCLPP_CACHE_DIR`, else `~/.cache/mscclpp` (as the runtime reads it)."""
    return Path(os.environ.get("MSCCLPP_CACHE_DIR") or Path.home() / ".cache" / "mscclpp")


class DslCompiler:
    """`mscclpp.compile`: see the module's docs."""

    def __call__(self, algo, algo_spec, rank, **kwargs):
        return self.compile(algo, algo_spec, rank, **kwargs)

    def compile(self, algo, algo_spec, rank, **kwargs):
        """Runs `algo(algo_spec, **kwargs)` (a CollectiveProgram) unless its plan is cached, and
        returns the plan as an `mscclpp.Algorithm` for `rank`, tagged with `algo_spec.tags`."""
        if not callable(algo):
            raise TypeError(f"compile: algo must be a callable that returns a CollectiveProgram, not {algo!r}")
        if not isinstance(algo_spec, AlgoSpec):
            raise TypeError(f"compile: algo_spec must be an mscclpp.language.AlgoSpec, not {algo_spec!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < algo_spec.world_size:
            raise ValueError(f"compile: rank {rank!r} is not in 0..{algo_spec.world_size - 1}")
        key = plan_key(algo, algo_spec, kwargs)
        path = cache_dir() / f"{key}.json"
        plan = _read_cached(path, key)
        if plan is None:
            prog = algo(algo_spec, **kwargs)
            if not isinstance(prog, _program.CollectiveProgram):
                raise TypeError(f"compile: {algo!r} returned {prog!r}, not the CollectiveProgram it wrote")
            plan = prog.to_dict()
            stamped = dict(plan, **{_CACHE_FIELD: {"key": key, "digest": _digest(plan)}})
            write_atomically(path, json.dumps(stamped, separators=(",", ":")))
        execution_plan = _mscclpp.ExecutionPlan(str(path), rank)
        return Algorithm(
            id=key,
            execution_plan=execution_plan,
            tags=algo_spec.tags,
            constraint={"world_size": algo_spec.world_size, "n_ranks_per_node": algo_spec.nranks_per_node},
        )


compile = DslCompiler()
