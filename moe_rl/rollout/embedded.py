"""The embedded rollout engine: generation on the megatron-core policy itself, with a KV cache.

Shape legend: B = sequences of one generate() call (prompts x samples), b = rows of one
chunk, T = padded prompt+response length, V = vocabulary, L = MoE layers, K = top-k,
N = rows sampled in one step.

Two forwards compute the same model (``decoder=``, recipe ``rollout.embedded_decoder``;
:mod:`moe_rl.rollout.embedded_forward`):
``lean`` (:mod:`moe_rl.megatron.decode`: a cache of rotated keys, folded GQA, grouped
experts, all experts gathered on every rank under EP; TP = 1, local spec; the default where
it runs) and ``megatron``
(megatron-core's ``StaticInferenceContext`` passed as ``inference_context=`` to
``policy.model``: the piece of its legacy static engine that 0.16.1 and 0.19 share; any
layout, expert parallelism included). Both place every row of a batch at the *same*
position. So prompts of different lengths are right-padded and handled the way megatron's
own static controller does: one prefill forward over the shortest prompt length, then one
token per step for every row, where a row still inside its prompt is fed its own next prompt
token (its logits are ignored). Every row therefore sees exactly tokens[:t] of its own
sequence at position t, causally, with no padding in any attention window: the cached
computation is the same computation as the trainer's right-padded, causal, mask-free
recompute (measured equal to 1e-6 in the tests). Rows that finish stay in the batch (fed
``pad_id``) until at most half of it is live; then the cache is compacted to the live rows.

Sampling follows SGLang: temperature, then top-k, then top-p over the renormalised top-k
mass, from one uniform draw per sampled token out of the row's own ``torch.Generator``
(row j of a call uses ``seed + j``), so a row's tokens do not depend on its neighbours.
Log-probs are log_softmax(logits / temperature) in fp32 before any top-k/top-p filtering
(temperature 1 for greedy), computed by the trainer's own function. Routes (``return_routes``)
are each MoE layer's chosen experts of every fed token; with ``return_gates`` also their gate
weights, the router outputs the forward mixed the experts with (``Rollouts.gates_BTLK``, for
``algo.replay_gate_weights``): the lean forward returns both, megatron's are captured by a
natural-routing :class:`~moe_rl.megatron.routing.RoutingSession`.

Multi-rank: the lean forward runs no collectives while decoding (its expert all-gather, once
per call, needs every rank to call generate). Under expert parallelism the megatron forward
is an all-to-all, so all ranks run the same number of forwards: before each step the ranks all-reduce (over the world group) whether
any of them still has live rows; a rank without work runs a one-token forward without the
cache. Tensor parallelism with sequence parallelism cannot feed one token per step, so
TP > 1 is refused.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable

import torch

from moe_rl import dist
from moe_rl.kernels.logprob_reference import logprobs_entropy
from moe_rl.megatron.routing import RoutingSession, routed_with
from moe_rl.rollout.embedded_forward import pick_forward, rollout_policy
from moe_rl.rollout.types import HFStateSource, Rollouts, SamplingParams
from moe_rl.routing import RouterAction
from moe_rl.routing.noise import RouteNoise

log = logging.getLogger(__name__)


# -- sampling (pure tensor functions) ----------------------------------------------------------
def sample_tokens(
    logits_NV: torch.Tensor, sampling: SamplingParams, uniforms_N: torch.Tensor | None
) -> torch.Tensor:
    """Next token per row: argmax when ``sampling.temperature == 0``, else an inverse-CDF draw.

    The distribution is softmax(logits / T) restricted to the ``top_k`` most likely tokens,
    then to the smallest prefix (by probability) holding ``top_p`` of that mass; the most
    likely token is always kept. ``uniforms_N`` are U[0, 1) draws, one per row.
    """
    if sampling.temperature == 0:
        return logits_NV.argmax(dim=-1)
    probs = torch.softmax(logits_NV.float() / sampling.temperature, dim=-1)
    if sampling.top_k > 0 or sampling.top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        if 0 < sampling.top_k < probs.shape[-1]:
            probs[:, sampling.top_k :] = 0
        if sampling.top_p < 1:
            mass_before = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(mass_before >= sampling.top_p * probs.sum(-1, keepdim=True), 0)
    else:
        order = None
    cdf = probs.cumsum(dim=-1)
    u = uniforms_N.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u, right=True)
    last_kept = (probs > 0).long().cumsum(-1).argmax(-1, keepdim=True)  # guards rounding at u -> 1
    pick = torch.minimum(pick, last_kept)
    return (order.gather(1, pick) if order is not None else pick).squeeze(1)


def noise_seed(sampling_seed: int | None, call: int) -> int:
    """The engine's route-noise seed of one generate call: a function of the sampling seed (so a
    resumed run draws what the uninterrupted run drew), else of the call count."""
    base = call if sampling_seed is None else sampling_seed
    return (base * 1_000_003 + 0x5EED) % 2**63


def row_generators(num_rows: int, seed: int | None) -> list[torch.Generator]:
    """One CPU generator per row, seeded ``seed + j`` (a fresh base seed from torch when None)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    return [torch.Generator().manual_seed(seed + j) for j in range(num_rows)]


def _fit_T(x: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or zero-pad dim 1 (T) of ``x`` to ``width``."""
    if x.shape[1] >= width:
        return x[:, :width]
    pad = torch.zeros(x.shape[0], width - x.shape[1], *x.shape[2:], dtype=x.dtype)
    return torch.cat([x, pad], dim=1)


# -- one chunk of rows: prefill, decode, cache ------------------------------------------------
class _Chunk:
    """Rows generated together in one KV cache (see the module docstring for the schedule)."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        prompts: list[list[int]],
        gens: list[torch.Generator],
        sampling: SamplingParams,
    ):
        self.engine, self.sampling = engine, sampling
        # each row's U[0, 1) draws, one per token it may sample, drawn up front: the k-th token a
        # row samples takes its generator's k-th draw, as drawing one at a time would (the same stream)
        self.uniforms_bN = (
            torch.stack([torch.rand(sampling.max_new_tokens, generator=g) for g in gens])
            if sampling.temperature > 0
            else None
        )
        # routes (and gates) from the forward itself (lean); megatron's are captured by a RoutingSession
        self.want_routes = sampling.return_routes and not engine.decoder.routes_from_session
        self.want_gates = sampling.return_gates and not engine.decoder.routes_from_session
        b = len(prompts)
        self.prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        width = int(self.prompt_len.max()) + sampling.max_new_tokens
        self.tokens_bT = torch.full((b, width), engine.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            self.tokens_bT[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        self.logp_bT = torch.zeros(b, width, dtype=torch.float32)
        self.total_len = self.prompt_len.clone()
        self.done = torch.zeros(b, dtype=torch.bool)
        self.finish = ["length"] * b
        self.live = torch.arange(b)  # chunk rows in the cache, in cache order
        self.cur = 0  # tokens fed so far (= the static context's sequence_len_offset)
        self.cache = engine.decoder.new_cache(b, width)
        self.log: list[tuple[torch.Tensor, int, int] | None] = []  # (rows, start, n) per forward
        self.route_steps: list[list[torch.Tensor] | None] = []  # per forward: [n * rows, K] per layer
        self.gate_steps: list[list[torch.Tensor] | None] = []  # their gate weights, float32
        self.prefill_s = self.decode_s = 0.0
        self.forwards = self.compactions = 0

    @property
    def finished(self) -> bool:
        return bool(self.done.all())

    def step(self) -> None:
        """One forward (the prefill, or one token for every live row), then sample."""
        t0 = time.perf_counter()
        start = self.cur
        n = int(self.prompt_len.min()) if start == 0 else 1
        dev = self.engine.device
        inp = self.tokens_bT[self.live, start : start + n].to(dev)
        logits, routes, gates = self.engine.decoder.forward(
            self.cache, inp, start, self.want_routes, self.want_gates
        )
        self.log.append((self.live.clone(), start, n))
        self.route_steps.append(routes)
        self.gate_steps.append(gates)
        self.cur = start + n
        self.forwards += 1
        self._sample(logits)
        if start == 0:
            self.prefill_s += time.perf_counter() - t0
        else:
            self.decode_s += time.perf_counter() - t0
        if not self.finished:
            self._maybe_compact()

    def _sample(self, logits_bV: torch.Tensor) -> None:
        """Choose the token at position ``cur`` for every live row that is past its prompt."""
        sampling, cur = self.sampling, self.cur
        want = ~self.done[self.live] & (self.prompt_len[self.live] <= cur)
        if not bool(want.any()):
            return
        cache_rows_N = want.nonzero().squeeze(1)
        rows_N = self.live[cache_rows_N]
        logits_NV = logits_bV[cache_rows_N.to(logits_bV.device)]
        uniforms_N = None
        if self.uniforms_bN is not None:  # the k-th sample of a row (k = tokens it sampled so far)
            uniforms_N = self.uniforms_bN[rows_N, self.total_len[rows_N] - self.prompt_len[rows_N]]
        tok_N = sample_tokens(logits_NV, sampling, uniforms_N)
        logp_N = self.engine.token_logprobs(logits_NV, tok_N, sampling.temperature or 1.0)
        tok_N, logp_N = tok_N.cpu(), logp_N.float().cpu()
        self.tokens_bT[rows_N, cur] = tok_N
        self.logp_bT[rows_N, cur] = logp_N
        self.total_len[rows_N] = cur + 1
        stopped_N = torch.isin(tok_N, self.engine.stop_ids(sampling))
        ended_N = stopped_N | ((self.total_len[rows_N] - self.prompt_len[rows_N]) >= sampling.max_new_tokens)
        if bool(ended_N.any()):  # a Python loop over the rows that ended at this token only
            self.done[rows_N[ended_N]] = True
            for row in rows_N[stopped_N].tolist():
                self.finish[row] = "stop"

    def _maybe_compact(self) -> None:
        """Drop finished rows from the cache once at most half of it is live."""
        keep = ~self.done[self.live]
        n_live = int(keep.sum())
        if n_live > len(self.live) // 2:
            return
        self.engine.decoder.keep_rows(self.cache, keep.nonzero().squeeze(1).to(self.engine.device))
        self.live = self.live[keep]
        self.compactions += 1

    def routes_bTLK(
        self, steps: list[list[torch.Tensor]], num_layers: int, topk: int, dtype: torch.dtype = torch.long
    ) -> torch.Tensor:
        """Scatter the captured per-forward router rows (row = s * rows + r) into [b, T, L, K]
        (routes, or with ``dtype=torch.float32`` their gates); 0 past each row's last input."""
        b, width = self.tokens_bT.shape
        out = torch.zeros(b, width, num_layers, topk, dtype=dtype)
        for entry, per_layer in zip(self.log, steps):
            if entry is None:
                continue
            rows, start, n = entry
            for layer, r_RK in enumerate(per_layer):
                r_bnK = r_RK.view(n, len(rows), topk).transpose(0, 1).cpu()
                out[rows, start : start + n, layer] = r_bnK
        valid = torch.arange(width)[None, :] < (self.total_len - 1)[:, None]
        return out * valid[:, :, None, None]


# -- the engine -------------------------------------------------------------------------------
class EmbeddedEngine:
    """RolloutEngine on the in-process megatron-core policy.

    ``pad_id`` fills padding; ``eos_id`` (optional) ends a row like a stop token;
    ``max_batch`` caps the rows of one KV cache (None: all rows of a call at once);
    ``decoder`` picks the forward (see :func:`pick_forward`). ``dtype`` / ``router_dtype``
    (``rollout.dtype`` / ``rollout.router_dtype``): at the policy's own precision the engine
    shares its weights (no copy, zero train-inference mismatch); otherwise it samples from its
    own copy in ``dtype`` (:func:`rollout_policy`), refreshed at every ``update_weights``.
    ``self.source`` is the trainer's policy, ``self.policy`` the one the engine runs.
    """

    def __init__(
        self,
        policy,
        *,
        pad_id: int,
        eos_id: int | None = None,
        max_batch: int | None = None,
        weight_version: str = "0",
        decoder: str = "auto",
        dtype: str = "fp32",
        router_dtype: str = "same",
        route_noise: float = 0.0,
    ):

        if policy.info.tp_size > 1:
            raise NotImplementedError(
                f"EmbeddedEngine: tensor_parallel={policy.info.tp_size} is not supported: megatron's "
                "sequence parallelism (always on with TP > 1 for MoE) splits the sequence over TP "
                "ranks and cannot decode one token per step. Use parallel.tensor_parallel=1 "
                "(expert/data parallelism work) or the sglang engine."
            )
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")
        self.source = policy
        self.policy = rollout_policy(policy, dtype, router_dtype)
        self.pad_id, self.eos_id, self.max_batch = int(pad_id), eos_id, max_batch
        self.weight_version = weight_version
        self.device = policy.info.device
        self.decoder = pick_forward(self.policy, decoder)
        self.route_noise = RouteNoise(route_noise)
        "The engine's selection noise (``rollout.route_noise``), reseeded from each call's sampling seed."
        self._calls = 0
        self._hf_sink = None

    @property
    def max_context_length(self) -> int:
        """Longest prompt + response the policy is built for."""
        return int(self.policy.cfg.max_seq_len)

    def stop_ids(self, sampling: SamplingParams) -> torch.Tensor:
        eos = {self.eos_id} if self.eos_id is not None and not sampling.ignore_eos else set()
        ids = set(sampling.stop_token_ids) | eos
        return torch.tensor(sorted(ids), dtype=torch.long)

    def token_logprobs(self, logits_NV: torch.Tensor, tok_N: torch.Tensor, temperature: float):
        """fp32 log_softmax(logits / temperature)[tok], the trainer's function (vocab-parallel)."""
        info = self.policy.info
        logp, _ = logprobs_entropy(
            logits_NV,
            tok_N.to(logits_NV.device),
            temperature=temperature,
            group=info.tp_group,
            vocab_start=self.policy.vocab_start,
        )
        return logp

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        """Sample ``n`` responses per prompt; rows of one prompt are adjacent.

        Returns right-padded ``[B, T]`` tokens with B = len(prompts) * n (see
        moe_rl.rollout.types for the alignment of log-probs and routes).
        """
        self._check(prompts, n, sampling)
        t_start = time.perf_counter()
        rows = [list(p) for p in prompts for _ in range(n)]
        gens = row_generators(len(rows), sampling.seed)
        size = self.max_batch or max(1, len(rows))
        spans = [(i, min(i + size, len(rows))) for i in range(0, len(rows), size)]
        n_chunks = dist.max_over(len(spans)) if self.decoder.lockstep else len(spans)
        model = self.policy.model
        was_training = model.training
        model.eval()
        chunks, routes, gates = [], [], []
        self.decoder.begin()  # collective under EP with the lean decoder: every rank calls generate
        self._calls += 1
        self.route_noise.reseed(noise_seed(sampling.seed, self._calls))
        try:  # the engine's forwards route with its own noise; the trainer's keep theirs
            with torch.no_grad(), routed_with(self.policy, self.route_noise):
                for c in range(n_chunks):
                    i, j = spans[c] if c < len(spans) else (0, 0)
                    chunk = _Chunk(self, rows[i:j], gens[i:j], sampling) if j > i else None
                    chunk_routes, chunk_gates = self._run_chunk(chunk, sampling)
                    if chunk is not None:
                        chunks.append(chunk)
                        routes.append(chunk_routes)
                        gates.append(chunk_gates)
        finally:
            model.train(was_training)
        return self._assemble(chunks, routes, gates, prompts, n, sampling, time.perf_counter() - t_start)

    def _run_chunk(
        self, chunk: _Chunk | None, sampling: SamplingParams
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Step until no rank has live rows; return the chunk's routes [b, T, L, K] and their gates
        (float32), each if asked (else None)."""
        decoder, want_routes = self.decoder, sampling.return_routes
        by_session = want_routes and chunk is not None and decoder.routes_from_session
        session = (
            RoutingSession(
                self.policy, RouterAction.NATURAL, capture_gates=sampling.return_gates, noise=self.route_noise
            )
            if by_session
            else None
        )
        busy = lambda: chunk is not None and not chunk.finished  # noqa: E731
        with session or contextlib.nullcontext():
            try:
                while dist.any_rank(busy()) if decoder.lockstep else busy():
                    if busy():
                        chunk.step()
                    else:
                        decoder.idle()
                        if chunk is not None:
                            chunk.log.append(None)
                            chunk.route_steps.append(None)
                            chunk.gate_steps.append(None)
            finally:
                if chunk is not None:
                    decoder.release(chunk.cache)
        if not want_routes or chunk is None:
            return None, None
        layers, topk = self.policy.num_moe_layers, self.policy.cfg.moe_router_topk
        steps = session.natural_steps() if session is not None else chunk.route_steps
        routes = chunk.routes_bTLK(steps, layers, topk)
        if not sampling.return_gates:
            return routes, None
        steps = session.natural_gate_steps() if session is not None else chunk.gate_steps
        return routes, chunk.routes_bTLK(steps, layers, topk, dtype=torch.float32)

    def _check(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        longest = max((len(p) for p in prompts), default=0)
        if longest + sampling.max_new_tokens > self.max_context_length:
            raise ValueError(
                f"longest prompt ({longest}) + sampling.max_new_tokens ({sampling.max_new_tokens}) "
                f"exceeds model.max_seq_len={self.max_context_length}: shorten the prompts, lower "
                "max_new_tokens or raise model.max_seq_len"
            )
        vocab = self.policy.cfg.vocab_size
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def _assemble(
        self,
        chunks: list[_Chunk],
        routes: list,
        gates: list,
        prompts,
        n: int,
        sampling: SamplingParams,
        wall_s: float,
    ) -> Rollouts:
        from moe_rl.routing.codec import encode_routes

        if not chunks:  # a rank without prompts (it still ran its share of the forwards)
            empty_B, empty_BT = torch.zeros(0, dtype=torch.long), torch.zeros(0, 0)
            return Rollouts(
                tokens_BT=empty_BT.long(),
                prompt_lens_B=empty_B,
                total_lens_B=empty_B,
                response_mask_BT=empty_BT,
                logprobs_BT=empty_BT,
                finish_reasons=[],
                weight_version=self.weight_version,
                prompt_index_B=empty_B,
                pad_id=self.pad_id,
                extras={"generate_s": wall_s, "generated_tokens": 0},
            )
        total = torch.cat([c.total_len for c in chunks])
        prompt_len = torch.cat([c.prompt_len for c in chunks])
        width = int(total.max()) if len(total) else 0
        t_idx = torch.arange(width)[None, :]
        resp = ((t_idx >= prompt_len[:, None]) & (t_idx < total[:, None])).float()
        tokens = torch.cat([_fit_T(c.tokens_bT, width) for c in chunks])
        tokens = torch.where(t_idx < total[:, None], tokens, torch.full_like(tokens, self.pad_id))
        logp = torch.cat([_fit_T(c.logp_bT, width) for c in chunks]) * resp
        routes_BTLK = gates_BTLK = None
        if sampling.return_routes:
            routes_BTLK = encode_routes(
                torch.cat([_fit_T(r, width) for r in routes]), self.policy.cfg.num_experts
            )
        if sampling.return_gates:
            gates_BTLK = torch.cat([_fit_T(g, width) for g in gates])
        generated = int(resp.sum().item())
        extras = {
            "prefill_s": sum(c.prefill_s for c in chunks),
            "decode_s": sum(c.decode_s for c in chunks),
            "generate_s": wall_s,
            "generated_tokens": generated,
            "tokens_per_s": generated / max(wall_s, 1e-9),
            "forwards": sum(c.forwards for c in chunks),
            "chunks": len(chunks),
            "compactions": sum(c.compactions for c in chunks),
            "decoder": self.decoder.name,
        }
        return Rollouts(
            tokens_BT=tokens,
            prompt_lens_B=prompt_len,
            total_lens_B=total,
            response_mask_BT=resp,
            logprobs_BT=logp,
            finish_reasons=[f for c in chunks for f in c.finish],
            weight_version=self.weight_version,
            prompt_index_B=torch.arange(len(prompts)).repeat_interleave(n),
            routes_BTLK=routes_BTLK,
            gates_BTLK=gates_BTLK,
            pad_id=self.pad_id,
            extras=extras,
        )

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, source: HFStateSource, version: str) -> str:
        """Record ``version``; a copy in its own precision is refreshed from the policy (in process,
        ``source`` is not read), a shared policy needs nothing."""
        self._refresh()
        self.weight_version = str(version)
        return self.weight_version

    def _refresh(self) -> None:
        if self.policy is not self.source:
            self.policy.copy_weights_from(self.source)

    def _sink(self):
        if self._hf_sink is None:
            from moe_rl.megatron.hf import PolicyHFSource

            self._hf_sink = PolicyHFSource(self.source)
        return self._hf_sink

    def hf_param_meta(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """WeightSink: HF Qwen3-MoE name -> (full shape, dtype) of every policy weight."""
        return self._sink().hf_param_meta()

    def load_hf_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """WeightSink: copy full HF tensors into the policy (this rank's slices), all-or-nothing.

        This changes the policy's own weights (and refreshes the engine's copy in its own
        precision, if any); used by ``moe-rl serve``.
        """
        self._sink().load_hf_tensors(named)
        self._refresh()

    def served_tensor(self, name: str) -> torch.Tensor | None:
        """The weight ``name`` (HF name) as the engine serves it (its own copy, in its precision), or
        None for a name it does not hold; ``moe-rl serve``'s ``/get_weights_by_name``."""
        from moe_rl.megatron.hf import PolicyHFSource

        return dict(PolicyHFSource(self.policy).hf_tensors()).get(name)

    def flush_cache(self) -> None:
        """No cache outlives a generate() call."""

    def close(self) -> None:
        """Nothing to release: the policy belongs to the caller."""
