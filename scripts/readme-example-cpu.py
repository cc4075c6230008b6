"""The README's Python example, as far as it runs without a GPU (scripts/wheel-check.sh).

Takes the first ```python block under "## Python" in README.md and:
  - checks that every `mscclpp.X`, `mscclpp.utils.X` (also as `mu.X`) and `mscclpp.X.Y` it names
    exists in the installed package;
  - runs it with LOCAL_RANK=0, a world of one and a stand-in `torch` (torch is not installed in CI)
    until its first call that needs a GPU, which must fail with mscclpp's MscclppError saying no
    GPU backend works here. On a machine with a GPU, run the block under torchrun instead.
Usage: python readme-example-cpu.py README.md
"""

import ast
import os
import re
import sys
import types


def readme_block(path):
    text = open(path, encoding="utf-8").read()
    section = text[text.index("\n## Python\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    if match is None:
        sys.exit(f"{path}: no ```python block under '## Python'")
    return match.group(1)


def check_names(tree):
    import mscclpp
    import mscclpp.utils

    aliases = {"mscclpp": mscclpp}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ("mscclpp", "mscclpp.utils"):
                    module = mscclpp.utils if a.name == "mscclpp.utils" else mscclpp
                    # `import mscclpp.utils` binds `mscclpp`; `... as mu` binds the submodule.
                    aliases[a.asname or "mscclpp"] = module if a.asname else mscclpp
    missing, checked = [], set()
    for node in ast.walk(tree):
        # The chain of attributes from a name: mu.torch_dtype_to_mscclpp_dtype, mscclpp.ReduceOp.SUM
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in aliases or not chain:
            continue
        obj, path = aliases[node.id], node.id
        for attr in reversed(chain):
            path += "." + attr
            if not hasattr(obj, attr):
                missing.append(path)
                break
            obj = getattr(obj, attr)
            checked.add(path)
    return missing, checked


class _NeedsGpu(Exception):
    pass


def stand_in_torch():
    def needs_gpu(*_a, **_k):
        raise _NeedsGpu("a torch tensor on the GPU")

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(
        set_device=lambda _d: None,
        is_available=lambda: False,
        is_initialized=lambda: False,
        synchronize=needs_gpu,
        current_stream=needs_gpu,
    )
    torch.bfloat16, torch.float32, torch.float16 = "bfloat16", "float32", "float16"
    torch.ones = torch.full = torch.zeros = torch.empty = needs_gpu
    return torch


def main():
    source = readme_block(sys.argv[1])
    tree = ast.parse(source, "README.md")
    missing, checked = check_names(tree)
    if missing:
        sys.exit(f"README example: the package lacks {', '.join(missing)}")
    print(f"README example: the names it takes from mscclpp exist: {', '.join(sorted(checked))}")
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    sys.modules["torch"] = stand_in_torch()
    import mscclpp

    try:
        exec(compile(tree, "README.md", "exec"), {"__name__": "__main__"})
    except (mscclpp.MscclppError, _NeedsGpu) as e:
        line = next(
            (f.lineno for f in reversed(__import__("traceback").extract_tb(e.__traceback__))
             if f.filename == "README.md"),
            None,
        )
        if isinstance(e, mscclpp.MscclppError) and "no GPU backend works here" not in str(e):
            sys.exit(f"README example: line {line} failed, not for want of a GPU: {e}")
        print(f"README example: ran to line {line} of {len(source.splitlines())}, which needs a GPU")
        return 0
    print("README example: ran to the end (a GPU is here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
