"""Child processes need a script's ``if __name__ == "__main__":`` guard: multiprocessing's ``spawn``
(megatron-core's checkpoint writer queue starts its server that way) runs the main script's
top-level code again in the child, so a script that calls ``moe_rl.train`` at its top level calls it
again there and the parent dies with a long ``EOFError`` traceback. :func:`check_main_guard` tells
before any child starts, in one line naming the file and line. Only the standard library.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys


def _is_main_test(node: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either side)."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)):
        return False
    sides = [node.left, *node.comparators]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def guarded_lines(source: str) -> list[tuple[int, int]]:
    """The line spans of the top-level ``if __name__ == "__main__":`` blocks of a module's source."""
    tree = ast.parse(source)
    return [
        (n.lineno, n.end_lineno or n.lineno)
        for n in tree.body
        if isinstance(n, ast.If) and _is_main_test(n.test)
    ]


def _main_line() -> tuple[str, int] | None:
    """(file, line) of the main module's top-level code now running (the statement that called in
    here), or None: no script (an interactive session, a notebook, ``python -c``), or the call
    does not come from the main module's top level (a thread, an import)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            return path, frame.f_lineno
        frame = frame.f_back
    return None


def check_main_guard(what: str) -> None:
    """Before ``what`` starts child processes: a script calling it from its top-level code, outside
    an ``if __name__ == "__main__":`` block, stops here with one line (``SystemExit``: no traceback)
    saying where and what to write. A notebook, ``python -c``, and a guarded script pass."""
    if multiprocessing.parent_process() is not None:  # a child: its parent checked
        return
    found = _main_line()
    if found is None:
        return
    path, line = found
    try:
        with open(path, encoding="utf-8") as f:
            spans = guarded_lines(f.read())
    except (OSError, SyntaxError, ValueError):
        return
    if any(lo <= line <= hi for lo, hi in spans):
        return
    raise SystemExit(
        f"moe-rl: {path}:{line}: {what} starts child processes, which run this script's top-level code "
        'again: put the call under `if __name__ == "__main__":` (Python\'s multiprocessing rule)'
    )
