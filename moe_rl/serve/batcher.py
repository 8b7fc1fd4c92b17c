"""Micro-batching for ``moe-rl serve``: concurrent ``/generate`` requests share engine calls.

SGLang batches requests continuously; clients (and ``sglang-router``) send one request per sample.
The batcher thread waits ``window_s`` after the first pending request, takes up to ``max_rows``
rows, orders them so equal sampling params with consecutive seeds are adjacent, and runs them in
as few engine calls as :meth:`SGLangProtocolApp._run` can make.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Pending:
    rows: list[list[int]]
    parsed: list[tuple[Any, int | None]]
    want_routes: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Batcher:
    """``submit`` blocks until the rows ran; ``run(rows, parsed, want_routes) -> (version, outs)``."""

    def __init__(
        self, run: Callable[..., tuple[str, list[dict]]], *, window_s: float = 0.005, max_rows: int = 256
    ):
        self.run, self.window_s, self.max_rows = run, window_s, max_rows
        self.cond = threading.Condition()
        self.queue: list[_Pending] = []
        self.thread = threading.Thread(target=self._loop, name="moe-rl-serve-batcher", daemon=True)
        self.thread.start()

    def submit(self, rows: list[list[int]], parsed: list, want_routes: bool) -> tuple[str, list[dict]]:
        item = _Pending(rows, parsed, want_routes)
        with self.cond:
            self.queue.append(item)
            self.cond.notify_all()
        item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    def _take(self) -> list[_Pending]:
        with self.cond:
            self.cond.wait_for(lambda: bool(self.queue))
        threading.Event().wait(self.window_s)
        with self.cond:
            taken, rows = [], 0
            while self.queue and (not taken or rows + len(self.queue[0].rows) <= self.max_rows):
                rows += len(self.queue[0].rows)
                taken.append(self.queue.pop(0))
            return taken

    def _loop(self) -> None:
        while True:
            taken = self._take()
            for want_routes in (False, True):
                group = [p for p in taken if p.want_routes == want_routes]
                if group:
                    self._run_group(group, want_routes)

    def _run_group(self, group: list[_Pending], want_routes: bool) -> None:
        flat = [(i, j) for i, p in enumerate(group) for j in range(len(p.rows))]
        keys: dict[Any, int] = {}
        for i, j in flat:
            keys.setdefault(group[i].parsed[j][0], len(keys))

        def order(ij: tuple[int, int]) -> tuple[int, int, int]:
            params, seed = group[ij[0]].parsed[ij[1]]
            return keys[params], -1 if seed is None else seed, ij[0]

        flat.sort(key=order)
        try:
            version, outs = self.run(
                [group[i].rows[j] for i, j in flat], [group[i].parsed[j] for i, j in flat], want_routes
            )
        except BaseException as e:  # noqa: BLE001 - handed to every waiting request
            for p in group:
                p.error = e
                p.done.set()
            return
        per: list[list[Any]] = [[None] * len(p.rows) for p in group]
        for (i, j), out in zip(flat, outs):
            per[i][j] = out
        for p, outs_p in zip(group, per):
            p.result = (version, outs_p)
            p.done.set()
