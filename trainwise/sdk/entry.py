"""Runs a registered job's `package.module:function` entry point: `python -m trainwise.sdk.entry
ENTRY [ARGS...]` (the function is called with no arguments; ARGS are its `sys.argv[1:]`).

`--check ENTRY` imports the module and checks the function, then exits: the launcher asks it
before it launches a node, so an entry point that does not import fails with its traceback and
the fix, not after a node was paid for. The check runs in a child process in the project's
folder, as the job will: importing the user's module runs its top-level code, which must never
happen in the Dagster code location's own process.
"""

from __future__ import annotations

import importlib
import sys
import traceback

CHECK_FAILED_EXIT_CODE = 3


def resolve(entry: str):
    module_name, _, function_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's import error, whatever it is: name it and the fix
        raise ImportError(f"entry {entry!r}: module {module_name!r} does not import "
                          f"({type(error).__name__}: {error}); check the module path (relative "
                          "to the project file's folder) and that its dependencies are "
                          "installed") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ImportError(f"entry {entry!r}: {module_name} has no callable {function_name!r}; "
                          "name a function defined at the module's top level")
    return function


def main(argv: list[str]) -> int:
    check = bool(argv) and argv[0] == "--check"
    if check:
        argv = argv[1:]
    if not argv:
        print("usage: python -m trainwise.sdk.entry [--check] package.module:function [args...]",
              file=sys.stderr)
        return 2
    sys.path.insert(0, "")  # the project's folder (the cwd), as `python script.py` would
    try:
        function = resolve(argv[0])
    except ImportError as error:
        traceback.print_exception(error.__cause__ or error, file=sys.stderr)
        print(str(error), file=sys.stderr)
        return CHECK_FAILED_EXIT_CODE
    if check:
        return 0
    sys.argv = [argv[0], *argv[1:]]
    result = function()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
