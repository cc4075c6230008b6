"""`python -m mscclpp --install`: writes the default plans (mscclpp.default_algos) into
MSCCLPP_CACHE_DIR/default, where the runtime, this package and the NCCL shim look for plans.
`python -m mscclpp --nccl-lib`: prints the path of the NCCL shim this wheel holds, for
`LD_PRELOAD=$(python -m mscclpp --nccl-lib)`; its folder also holds it as libnccl.so.2, for
LD_LIBRARY_PATH."""

import argparse
import json
import sys

from ._compiler import cache_dir, write_atomically
from ._shim import nccl_lib
from .default_algos import DEFAULT_PLANS


def install(directory=None):
    """Writes every default plan into `directory` (default: the cache's `default/`); returns
    the paths written."""
    target = directory or cache_dir() / "default"
    written = []
    for filename, program, spec, kwargs in DEFAULT_PLANS:
        path = target / filename
        write_atomically(path, json.dumps(program(spec, **kwargs).to_dict(), separators=(",", ":")))
        written.append(path)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mscclpp", description=__doc__)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--install", action="store_true", help="write the default plans")
    what.add_argument(
        "--nccl-lib", action="store_true", help="print the NCCL shim's path (for LD_PRELOAD)"
    )
    args = parser.parse_args(argv)
    if args.nccl_lib:
        try:
            print(nccl_lib())
        except FileNotFoundError as e:
            print(f"python -m mscclpp: {e}", file=sys.stderr)
            return 1
        return 0
    if not args.install:
        parser.print_help()
        return 2
    for path in install():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
