"""`JSON()`: the plan of the program being written."""

from . import _context

__all__ = ["JSON"]


def JSON():
    """The execution plan (JSON text) of the innermost `with CollectiveProgram(...)` program."""
    return _context.current().to_json()
