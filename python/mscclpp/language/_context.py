"""The program being written: DSL calls add to the innermost `with CollectiveProgram(...)`."""

from .types import fail

_programs = []


def enter(program):
    _programs.append(program)


def leave(program):
    if _programs and _programs[-1] is program:
        _programs.pop()


def current():
    if not _programs:
        fail("no program is being written: make DSL calls inside `with CollectiveProgram(...):`")
    return _programs[-1]
