"""`ThreadBlockGroup`: several threadblocks of one rank sharing one op's elements."""

from .types import fail

__all__ = ["ThreadBlockGroup"]


class ThreadBlockGroup:
    """Threadblocks that split each op given `tb_group=`: every block runs the op on its share
    (block i of n takes the i-th n-th of the chunks' elements)."""

    def __init__(self, tb_list):
        tb_list = list(tb_list)
        if not tb_list:
            fail("a ThreadBlockGroup needs at least one threadblock")
        for tb in tb_list:
            if isinstance(tb, bool) or not isinstance(tb, int) or tb < 0:
                fail(f"threadblock {tb!r} in {tb_list} is not a non-negative integer")
        duplicates = sorted({tb for tb in tb_list if tb_list.count(tb) > 1})
        if duplicates:
            fail(f"threadblock(s) {duplicates} appear more than once in ThreadBlockGroup({tb_list})")
        self.tb_list = tb_list
        self._index = {tb: i for i, tb in enumerate(tb_list)}

    def get_internal_id(self, tb):
        """The position of `tb` in the group."""
        if tb not in self._index:
            fail(f"threadblock {tb} is not in ThreadBlockGroup({self.tb_list})")
        return self._index[tb]

    def numtb(self):
        return len(self.tb_list)

    def __repr__(self):
        return f"ThreadBlockGroup({self.tb_list})"


def where(tb, tb_group):
    """Which threadblock(s) a call names, for error messages."""
    if tb is not None:
        return f"threadblock {tb}"
    if isinstance(tb_group, ThreadBlockGroup):
        return f"threadblocks {tb_group.tb_list}"
    return "no threadblock"


def threadblocks(tb, tb_group, what):
    """(tb, tbg_info) for each threadblock an op given `tb=` or `tb_group=` runs on."""
    if tb is not None and tb_group is not None:
        fail(f"{what}: give either tb= or tb_group=, not both")
    if tb is not None:
        if isinstance(tb, bool) or not isinstance(tb, int) or tb < 0:
            fail(f"{what}: threadblock {tb!r} is not a non-negative integer")
        return [(tb, None)]
    if tb_group is None:
        fail(f"{what}: give the threadblock (tb=) or a ThreadBlockGroup (tb_group=) that runs it")
    if not isinstance(tb_group, ThreadBlockGroup):
        fail(f"{what}: tb_group must be a ThreadBlockGroup, not {tb_group!r}")
    n = tb_group.numtb()
    return [(t, (i, n)) for i, t in enumerate(tb_group.tb_list)]
