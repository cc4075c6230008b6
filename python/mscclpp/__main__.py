"""`python -m mscclpp --install`: writes the default plans (mscclpp.default_algos) into
MSCCLPP_CACHE_DIR/default, where the runtime, this package and the NCCL shim look for plans."""

import argparse
import json
import sys

from ._compiler import cache_dir, write_atomically
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
    parser.add_argument("--install", action="store_true", help="write the default plans")
    args = parser.parse_args(argv)
    if not args.install:
        parser.print_help()
        return 2
    for path in install():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
