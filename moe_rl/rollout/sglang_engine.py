"""The ``sglang`` rollout engine: per-sample requests to one SGLang server or a router over many.

Shape legend: B = sequences (prompts x samples), T = padded prompt+response length,
L = MoE layers, K = experts per token, N = routed rows of one sequence (total_len - 1).

One ``/generate`` per sample, sent concurrently (httpx.AsyncClient) to ``client`` (an SGLang server
or an ``sglang-router`` in front of several), as slime and verl do. sglang-router (every release up
to 0.3.2) rebuilds the /generate body from its own struct and drops ``return_routed_experts``, so
rows that need routes (R3) go straight to the engines, least in-flight first (what slime's own
Python router does); tests/dist/test_sglang_router.py pins the router's behaviour. each request has its own timeout
and bounded retries, so one slow or failed row never re-runs the batch. At the step deadline the
stragglers are aborted (``/abort_request`` on every engine) and come back with the tokens they had
(finish_reason 'abort', as slime's partial rollouts). Every response's ``weight_version`` must be
the version last pushed to every engine.

Colocated mode (one GPU set for training and rollouts, SGLang launched with
``--enable-memory-saver`` and ``--enable-weights-cpu-backup``): the engines hold GPU memory only
for a phase that needs it, :data:`PHASE_TAGS`: a push resumes the weights alone, a rollout the
weights, KV cache and CUDA graphs (weights first, as slime), and after either every tag is
released again. SGLang frees released weights unless launched with the CPU backup; with it a
rollout that follows another without a push between (an evaluation, then the next step) serves
the weights last pushed. :meth:`SGLangEngine.resume_memory` / :meth:`SGLangEngine.release_memory`
make the calls; the trainer orders them with its own memory across ranks
(:mod:`moe_rl.trainer.colocate`); generating or pushing while what the phase needs is released
raises, naming the call that was missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import httpx
import torch

from moe_rl.rollout.sglang_client import SGLangClient, raise_for_status
from moe_rl.rollout.sglang_protocol import (
    GenerateOutput,
    SGLangError,
    SGLangHTTPError,
    SGLangTimeout,
    SGLangUnavailable,
    StaleWeightsError,
    generate_body,
    parse_generate_response,
    to_sglang_sampling_params,
)
from moe_rl.rollout.types import HFStateSource, Rollouts, SamplingParams
from moe_rl.rollout.weight_sync.verify import PushVerifier
from moe_rl.routing.codec import decode_sglang_routes, encode_routes

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"SGLang's GPU memory tags (``srt/constants.py``: GPU_MEMORY_ALL_TYPES)."
PHASE_TAGS = {"rollout": MEMORY_TAGS, "push": ("weights",), "launch": ()}
"""Colocated mode: what the engines hold in each phase of theirs. A push needs the weights only;
the KV cache and CUDA graphs come back at the next rollout, after the trainer's state has left the
GPU; ``launch`` (the engines starting) resumes nothing: they start holding everything."""
RESUME_ORDER = (("weights",), ("kv_cache", "cuda_graph"))
"The order tags come back in: the weights, then the KV cache and CUDA graphs (slime's onload order)."


def request_id(tag: str, row: int, attempt: int = 0) -> str:
    """The SGLang request id of ``row`` of one generate call (``tag``: its hex uuid) at its
    ``attempt``-th try: ``moe-rl-<tag>-<row>-<attempt>.``.

    SGLang's ``/abort_request`` aborts every request whose id *starts with* the given one (its
    scheduler matches ``req.rid.startswith(recv_req.rid)``, 0.5.x), so no id may be a prefix of
    another: each ends at its only ``.``, after digits (``moe-rl-t-1`` would also abort rows 10-19)."""
    return f"moe-rl-{tag}-{row}-{attempt}."


class SGLangEngine:
    """RolloutEngine over SGLang: builds ``Rollouts`` and checks weight versions on every engine.

    ``client`` serves generation (a server, or the router); ``engines`` are the servers behind it
    (default ``[client]``) for versions, aborts and memory. ``num_layers``/``topk``/``num_experts``
    describe the MoE (needed to decode routes). ``weight_sync`` is a pusher from
    :mod:`moe_rl.rollout.weight_sync`; ``launcher`` (optional, anything with ``stop()``) is stopped
    by ``close()``.
    """

    def __init__(
        self,
        client: SGLangClient,
        *,
        engines: list[SGLangClient] | None = None,
        num_layers: int | None = None,
        topk: int | None = None,
        num_experts: int | None = None,
        pad_id: int = 0,
        weight_sync: Any = None,
        launcher: Any = None,
        weight_version: str | None = None,
        request_timeout_s: float | None = None,
        retries: int | None = None,
        step_deadline_s: float | None = None,
        max_concurrency: int = 256,
        colocated: bool = False,
        verify_every: int = 0,
        vocab_size: int | None = None,
        context: int | None = None,
    ):
        self.client, self.engines, self.pad_id = client, list(engines or [client]), pad_id
        self.num_layers, self.topk, self.num_experts = num_layers, topk, num_experts
        self.weight_sync, self.launcher, self.colocated = weight_sync, launcher, colocated
        self.request_timeout_s = request_timeout_s or client.timeout_s
        self.retries = client.retries if retries is None else retries
        self.step_deadline_s, self.max_concurrency = step_deadline_s, max_concurrency
        self.weight_version = weight_version if weight_version is not None else self.served_version()
        self._weights_uncertain: str | None = None
        self._seed_checked = False
        self.resident: set[str] = set(MEMORY_TAGS)
        "Colocated: the memory tags the engines hold now (an engine starts holding every one)."
        self.calls_memory = True
        "Whether this process makes the memory calls (False: another trainer rank does; this one follows)."
        self.auto_memory = colocated
        "Resume before each rollout or push and release after it here (False: the caller orders them)."
        self._warned_direct = False
        self.last_push = None
        self.verifier = PushVerifier(verify_every, num_layers, num_experts, vocab_size, context or 128)
        """Checks the first push and every ``verify_every``-th (0: never): read-back by name, and (with
        ``vocab_size``) the engines' scores of a probe at the next rollout (:meth:`take_push_probes`)."""

    def served_version(self) -> str:
        """The weight_version every engine serves; SGLangError if they disagree."""
        versions = {e.base_url: e.get_weight_version() for e in self.engines}
        if len(set(versions.values())) != 1:
            raise StaleWeightsError(f"the engines serve different weight versions: {versions}")
        return next(iter(versions.values()))

    # ----------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        """Sample ``n`` responses per prompt (rows of a prompt adjacent; row b uses seed + b)."""
        if self._weights_uncertain:
            raise StaleWeightsError(self._weights_uncertain)
        if n < 1 or not prompts:
            raise ValueError(f"generate needs prompts and n >= 1, got {len(prompts)} prompts, n={n}")
        if sampling.return_routes and None in (self.num_layers, self.topk, self.num_experts):
            raise ValueError("return_routes needs SGLangEngine(num_layers=, topk=, num_experts=)")
        if sampling.return_gates:
            raise ValueError(
                "return_gates: SGLang returns the routed experts' ids, not their gate weights "
                "(Rollouts.gates_BTLK): use the embedded engine for algo.replay_gate_weights"
            )
        if sampling.seed is not None and not self._seed_checked:
            self._check_seeds_honoured()
        with self._phase("rollout"):
            return self._generate(prompts, n, sampling)

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        if self.calls_memory:  # the rank that calls the engines probes them for a due push check
            self.verifier.probe(self.engines)
        rows = [list(p) for p in prompts for _ in range(n)]
        params = [
            to_sglang_sampling_params(sampling, None if sampling.seed is None else sampling.seed + b)
            for b in range(len(rows))
        ]
        t0 = time.perf_counter()
        outs, aborted = asyncio.run(self._generate_rows(rows, params, sampling.return_routes))
        gen_s = time.perf_counter() - t0
        for b, o in enumerate(outs):
            if o.weight_version != self.weight_version:
                raise StaleWeightsError(
                    f"row {b} was generated with weight_version {o.weight_version!r} but the trainer "
                    f"last pushed {self.weight_version!r}: another process changed the server's "
                    f"weights, or a push did not take effect"
                )
        batch = self._build(rows, outs, sampling, n)
        ntok = batch.num_response_tokens
        batch.extras.update(
            generate_s=gen_s, tokens_per_s=ntok / max(gen_s, 1e-9), requests=len(rows), aborted=len(aborted)
        )
        return batch

    def _targets(self, want_routes: bool) -> list[SGLangClient]:
        """Where the rows go: the router, or (R3 behind sglang-router, which drops the
        ``return_routed_experts`` field from /generate) straight to the engines, least in-flight first."""
        if want_routes and self.client not in self.engines:
            if not self._warned_direct:
                logger.warning(
                    "sglang-router drops return_routed_experts from /generate: requests that need routes go "
                    "straight to the %d engines (least in-flight first)",
                    len(self.engines),
                )
                self._warned_direct = True
            return self.engines
        return [self.client]

    async def _generate_rows(
        self, rows: list[list[int]], params: list[dict], want_routes: bool
    ) -> tuple[list[GenerateOutput], list[int]]:
        """One request per row; at the step deadline abort the stragglers and keep what they made."""
        tag = uuid.uuid4().hex[:12]
        rids = [request_id(tag, b) for b in range(len(rows))]
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=64)
        async with contextlib.AsyncExitStack() as stack:
            targets = [
                (
                    c.base_url,
                    await stack.enter_async_context(
                        httpx.AsyncClient(
                            base_url=c.base_url, headers=c.headers, limits=limits, transport=c.transport
                        )
                    ),
                )
                for c in self._targets(want_routes)
            ]
            inflight = [0] * len(targets)
            tasks = [
                asyncio.create_task(
                    self._one_row(targets, inflight, rows[b], params[b], (tag, rids), b, want_routes)
                )
                for b in range(len(rows))
            ]
            _, pending = await asyncio.wait(
                tasks, timeout=self.step_deadline_s, return_when=asyncio.FIRST_EXCEPTION
            )
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:  # one row failed for good: stop the others, report that row's error
                for t in pending:
                    t.cancel()
                await asyncio.to_thread(self._abort, [rids[b] for b, t in enumerate(tasks) if t in pending])
                raise failed[0].exception()
            aborted = [b for b, t in enumerate(tasks) if t in pending]
            if aborted:
                logger.warning(
                    "step deadline %.1f s: aborting %d straggler rows", self.step_deadline_s, len(aborted)
                )
                await asyncio.to_thread(self._abort, [rids[b] for b in aborted])
                _, still = await asyncio.wait(pending, timeout=self.request_timeout_s)
                for t in still:
                    t.cancel()
                if still:
                    raise SGLangTimeout(f"{len(still)} rows did not return after /abort_request")
            outs = [t.result() for t in tasks]
        for b, o in enumerate(outs):
            if o.finish_reason == "abort" and b not in aborted:
                raise SGLangError(f"row {b} was aborted by the server: {o.meta_info.get('finish_reason')}")
            if b in aborted and not o.output_ids:
                raise SGLangTimeout(
                    f"row {b} produced no token before the step deadline of {self.step_deadline_s} s"
                )
        return outs, aborted

    async def _one_row(
        self,
        targets: list[tuple[str, httpx.AsyncClient]],
        inflight: list[int],
        ids: list[int],
        sp: dict,
        ids_of: tuple[str, list[str]],
        b: int,
        want_routes: bool,
    ) -> GenerateOutput:
        """POST /generate for row ``b`` to the least busy target; connection errors, timeouts and
        5xx are retried ``retries`` times (under a new rid, kept in ``rids[b]`` for aborts;
        ``ids_of``: the call's tag and ``rids``)."""
        tag, rids = ids_of
        last: Exception | None = None
        for attempt in range(1 + self.retries):
            if attempt:
                await asyncio.sleep(self.client.backoff_s * 2 ** (attempt - 1))
                rids[b] = request_id(tag, b, attempt)
            i = min(range(len(targets)), key=inflight.__getitem__)
            base, http = targets[i]
            url, body = base + "/generate", generate_body(ids, sp, True, want_routes, rid=rids[b])
            inflight[i] += 1
            try:
                resp = await http.post("/generate", json=body, timeout=self.request_timeout_s)
            except httpx.TimeoutException as e:
                last = SGLangTimeout(
                    f"{url} did not answer request {rids[b]} within {self.request_timeout_s} s: {e}"
                )
                continue
            except httpx.TransportError as e:
                last = SGLangUnavailable(f"{url} failed for request {rids[b]}: {type(e).__name__}: {e}")
                continue
            finally:
                inflight[i] -= 1
            try:
                item = raise_for_status(url, resp.status_code, resp.content)
            except SGLangHTTPError as e:
                if e.status < 500:
                    raise
                last = e
                continue
            return parse_generate_response(
                item, want_logprobs=True, want_routes=want_routes, allow_abort=True
            )
        raise last if last is not None else SGLangError("no attempt made")

    def _abort(self, rids: list[str]) -> None:
        """``/abort_request`` for each straggler on every engine (the router does not say which has it)."""
        for e in self.engines:
            for rid in rids:
                try:
                    e.abort_request(rid)
                except SGLangError as err:
                    logger.warning("abort of %s on %s failed: %s", rid, e.base_url, err)

    def _build(
        self, rows: list[list[int]], outs: list[GenerateOutput], sampling: SamplingParams, n: int
    ) -> Rollouts:
        B = len(rows)
        T = max(len(p) + len(o.output_ids) for p, o in zip(rows, outs))
        tokens_BT = torch.full((B, T), self.pad_id, dtype=torch.int64)
        mask_BT = torch.zeros(B, T, dtype=torch.float32)
        logp_BT = torch.zeros(B, T, dtype=torch.float32)
        routes_BTLK = None
        if sampling.return_routes:
            routes_BTLK = torch.zeros(B, T, self.num_layers, self.topk, dtype=torch.int64)
        plen, tlen = [], []
        for b, (p, o) in enumerate(zip(rows, outs)):
            P, R = len(p), len(o.output_ids)
            tokens_BT[b, :P] = torch.tensor(p)
            tokens_BT[b, P : P + R] = torch.tensor(o.output_ids, dtype=torch.int64)
            mask_BT[b, P : P + R] = 1.0
            logp_BT[b, P : P + R] = torch.tensor(o.logprobs, dtype=torch.float32)
            plen.append(P)
            tlen.append(P + R)
            if routes_BTLK is not None:
                routes_NLK = decode_sglang_routes(o.routed_experts, self.num_layers, self.topk)
                if routes_NLK.shape[0] != P + R - 1:
                    raise SGLangError(
                        f"row {b}: routed_experts has {routes_NLK.shape[0]} rows, expected "
                        f"prompt {P} + completion {R} - 1 = {P + R - 1}"
                    )
                routes_BTLK[b, : P + R - 1] = routes_NLK
        if routes_BTLK is not None:
            routes_BTLK = encode_routes(routes_BTLK, self.num_experts)
        return Rollouts(
            tokens_BT=tokens_BT,
            prompt_lens_B=torch.tensor(plen),
            total_lens_B=torch.tensor(tlen),
            response_mask_BT=mask_BT,
            logprobs_BT=logp_BT,
            finish_reasons=[o.finish_reason for o in outs],
            weight_version=self.weight_version,
            prompt_index_B=torch.arange(B) // n,
            routes_BTLK=routes_BTLK,
            pad_id=self.pad_id,
        )

    def _check_seeds_honoured(self) -> None:
        """SGLang ignores sampling_seed unless launched with --enable-deterministic-inference."""
        self._seed_checked = True
        try:
            deterministic = self.engines[0].server_info().get("enable_deterministic_inference")
        except SGLangError:
            deterministic = None
        if deterministic is False:
            logger.warning(
                "%s ignores sampling seeds: launch SGLang with --enable-deterministic-inference "
                "for reproducible rollouts",
                self.engines[0].base_url,
            )

    # ----------------------------------------------------------------- colocated memory
    @contextlib.contextmanager
    def _phase(self, phase: str):
        """Around a rollout or a push: with ``auto_memory`` resume what ``phase`` needs and release
        everything after it; else check that the caller resumed it."""
        if not self.colocated:
            yield
            return
        if not self.auto_memory:
            missing = [t for t in PHASE_TAGS[phase] if t not in self.resident]
            if missing:
                raise SGLangError(
                    f"a {phase} on colocated engines needs {missing} resident, which are released: call "
                    f"resume_memory({phase!r}) first (moe_rl.trainer.colocate orders it with the trainer's memory)"
                )
            yield
            return
        self.resume_memory(phase)
        try:
            yield
        finally:
            self.release_memory()

    def resume_memory(self, phase: str = "rollout") -> None:
        """Colocated mode: every engine takes back the memory ``phase`` needs (:data:`PHASE_TAGS`),
        the weights first; a no-op elsewhere, and for what is resident already (SGLang fails a
        resume of a tag it holds)."""
        if not self.colocated:
            return
        for group in RESUME_ORDER:
            tags = [t for t in group if t in PHASE_TAGS[phase] and t not in self.resident]
            if tags and self.calls_memory:
                for e in self.engines:
                    e.resume_memory_occupation(tags)
            self.resident.update(tags)

    def release_memory(self) -> None:
        """Colocated mode: every engine gives back all the GPU memory it holds (no-op otherwise)."""
        if not self.colocated or not self.resident:
            return
        tags = [t for t in MEMORY_TAGS if t in self.resident]
        if self.calls_memory:
            for e in self.engines:
                e.release_memory_occupation(tags)
        self.resident.clear()

    # ----------------------------------------------------------------- weights
    def update_weights(self, source: HFStateSource, version: str) -> str:
        """Push ``source`` to every engine; they then serve ``version`` (checked per engine)."""
        if self.weight_sync is None:
            raise ValueError("SGLangEngine(weight_sync=...) is needed to push weights")
        source, tee = self.verifier.tee(source, version)
        try:
            with self._phase("push"):
                self.last_push = self.weight_sync.push(source, version)
                if tee is not None:
                    self.verifier.verify(self.engines, tee, version)
        except Exception as e:
            if getattr(e, "server_may_be_mixed", False):
                self._weights_uncertain = (
                    f"the push of {version!r} failed midway on a server without "
                    f"atomic weight-update sessions; push again before generating"
                )
            raise
        self._weights_uncertain = None
        self.weight_version = version
        return version

    def take_push_probes(self) -> list | None:
        """The engines' side of the push check due at this rollout (:mod:`~moe_rl.rollout.weight_sync.verify`:
        each engine's continuation of a fixed prompt with its log-probs), for the trainer to score
        (:func:`~moe_rl.rollout.weight_sync.verify.check_scores`); None when none is due."""
        return self.verifier.take()

    def close(self) -> None:
        """Destroy the weight-update group and stop launched servers (and the router)."""
        if self.weight_sync is not None and hasattr(self.weight_sync, "close"):
            self.weight_sync.close()
        if self.launcher is not None:
            self.launcher.stop()
