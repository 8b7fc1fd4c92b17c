"""Micro-batching for ``moe-rl serve``: concurrent ``/generate`` requests share engine calls.

SGLang batches requests continuously; clients (and ``sglang-router``) send one request per sample.
The batcher thread waits ``window_s`` after the first pending request, takes up to ``max_rows``
rows and ``max_tokens`` prompt + new tokens (``--max-running-requests``, ``--max-total-tokens``;
one request alone always runs, the app refuses larger ones), orders them so equal sampling params
with consecutive seeds are adjacent, and runs them in as few engine calls as
:meth:`SGLangProtocolApp._run` can make. When a shared call fails, each request is run alone, so
a request the engine refuses fails by itself, not the requests batched with it.
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
    tokens: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Batcher:
    """``submit`` blocks until the rows ran; ``run(rows, parsed, want_routes) -> (version, outs)``."""

    def __init__(
        self,
        run: Callable[..., tuple[str, list[dict]]],
        *,
        window_s: float = 0.005,
        max_rows: int = 256,
        max_tokens: int | None = None,
    ):
        self.run, self.window_s, self.max_rows, self.max_tokens = run, window_s, max_rows, max_tokens
        self.cond = threading.Condition()
        self.queue: list[_Pending] = []
        self.thread = threading.Thread(target=self._loop, name="moe-rl-serve-batcher", daemon=True)
        self.thread.start()

    def submit(self, rows: list[list[int]], parsed: list, want_routes: bool) -> tuple[str, list[dict]]:
        tokens = sum(len(r) + int(getattr(p[0], "max_new_tokens", 0)) for r, p in zip(rows, parsed))
        item = _Pending(rows, parsed, want_routes, tokens)
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
            taken, rows, tokens = [], 0, 0
            while self.queue and (not taken or self._fits(rows, tokens, self.queue[0])):
                rows += len(self.queue[0].rows)
                tokens += self.queue[0].tokens
                taken.append(self.queue.pop(0))
            return taken

    def _fits(self, rows: int, tokens: int, nxt: _Pending) -> bool:
        if rows + len(nxt.rows) > self.max_rows:
            return False
        return self.max_tokens is None or tokens + nxt.tokens <= self.max_tokens

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
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request(s)
            if len(group) > 1 and isinstance(e, Exception):
                for p in group:  # one bad request must not fail the others: each alone
                    self._run_group([p], want_routes)
                return
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
