"""Frees native objects in a safe order at interpreter exit.

Module globals are freed in no particular order at exit, possibly after the GPU driver's own exit
handlers ran. The native objects hold what they need (algorithms hold their communicator), so any
order is memory-safe; this hook makes it orderly: algorithm collections and executors first, then
communicators, while the interpreter and the driver are still whole.
"""

import atexit
import weakref

_collections = weakref.WeakSet()
_groups = weakref.WeakSet()


def track(obj):
    from .comm import CommGroup

    (_groups if isinstance(obj, CommGroup) else _collections).add(obj)


@atexit.register
def _close_all():
    for c in list(_collections):
        c._close()
    for g in list(_groups):
        g._close()
