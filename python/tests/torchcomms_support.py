"""What the TorchComms backend's tests share: `torchcomms` (the real package where it imports,
else the stand-in in standin/), and a c10d-style store that works across processes."""

import os
import sys
import time
from datetime import timedelta

STANDIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")


def import_torchcomms():
    """The real torchcomms where it imports (it needs torch), else the stand-in."""
    try:
        import torchcomms
    except ImportError:
        sys.path.insert(0, STANDIN_DIR)
        import torchcomms
    return torchcomms


def is_standin(torchcomms):
    return getattr(torchcomms, "IS_STANDIN", False)


class FileStore:
    """A c10d Store's set/get/wait over files in one folder: every process given the folder sees
    the same keys. Records which keys it set and read (for the tests)."""

    def __init__(self, folder):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def _path(self, key):
        return os.path.join(self.folder, key.encode().hex())

    def set(self, key, value):
        data = value.encode() if isinstance(value, str) else bytes(value)
        tmp = self._path(key) + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(key))
        self._log("set", key)

    def wait(self, keys, timeout=timedelta(seconds=30)):
        deadline = time.monotonic() + timeout.total_seconds()
        while not all(os.path.exists(self._path(k)) for k in keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"FileStore: {keys} not set within {timeout}")
            time.sleep(0.01)

    def get(self, key):
        self.wait([key])
        with open(self._path(key), "rb") as f:
            data = f.read()
        self._log("get", key)
        return data

    def _log(self, what, key):
        with open(os.path.join(self.folder, "log"), "a") as f:
            f.write(f"{os.getpid()} {what} {key}\n")

    def log(self):
        path = os.path.join(self.folder, "log")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [line.split(" ", 2)[1:] for line in f.read().splitlines()]
