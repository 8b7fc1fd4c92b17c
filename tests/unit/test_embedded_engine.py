"""The embedded rollout engine against the trainer's own forward (unit tier, one process).

Reference tests: rollout log-probs equal ``policy.logprobs`` of the returned tokens, routes
equal the trainer's natural top-k of the same tokens, greedy output equals a naive
full-recompute argmax loop, and every row of a mixed batch equals that prompt generated
alone. Tiny model: hidden 64, 2 layers, 4 experts top-2, vocab 64.
"""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from moe_rl.rollout import ROLLOUT_ENGINES, get_engine_class
from moe_rl.rollout.types import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def policy():
    from tests.tiny import tiny_policy

    return tiny_policy(seed=7)


@pytest.fixture(scope="module", params=["lean", "megatron"])
def engine(policy, request):
    """Every engine test runs on both forwards (the lean decoder and megatron-core's path)."""
    from moe_rl.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(policy, pad_id=0, decoder=request.param)


def recompute(policy, ro, temperature):
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction

    b, t = ro.tokens_BT.shape
    with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL) as rs:
        logp = policy.logprobs(ro.tokens_BT, temperature=temperature).logp_BT
    return logp, rs.natural_BSLK(b, t - 1)


def response(ro, b):
    return ro.tokens_BT[b, int(ro.prompt_lens_B[b]) : int(ro.total_lens_B[b])].tolist()


def naive_greedy(policy, prompts, max_new, stop=()):
    """Full causal recompute of the right-padded batch every step, no cache; argmax at each
    row's own last position."""
    seqs, done = [list(p) for p in prompts], [False] * len(prompts)
    with torch.no_grad():
        for _ in range(max_new):
            width = max(map(len, seqs))
            batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
            logits = policy.logits(batch)
            for i, s in enumerate(seqs):
                if not done[i]:
                    s.append(int(logits[i, len(s) - 1].argmax()))
                    done[i] = s[-1] in stop
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def check_layout(ro, n_prompts, n):
    b = n_prompts * n
    assert ro.tokens_BT.shape[0] == b and ro.tokens_BT.shape[1] == int(ro.total_lens_B.max())
    assert ro.prompt_index_B.tolist() == [i for i in range(n_prompts) for _ in range(n)]
    t = torch.arange(ro.tokens_BT.shape[1])[None]
    pad = t >= ro.total_lens_B[:, None]
    assert (ro.tokens_BT[pad] == ro.pad_id).all()
    resp = (t >= ro.prompt_lens_B[:, None]) & ~pad
    assert torch.equal(ro.response_mask_BT, resp.float())
    assert (ro.logprobs_BT[~resp] == 0).all()
    assert (ro.logprobs_BT[resp] < 0).all()


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=20,
            max_new_tokens=10,
            seed=11,
            stop_token_ids=(1, 2, 3, 4, 5),
            return_routes=True,
        ),
        SamplingParams(temperature=0.0, max_new_tokens=10, return_routes=True),
    ],
    ids=["sampled", "greedy"],
)
def test_logprobs_and_routes_equal_trainer_recompute(policy, engine, sp):
    ro = engine.generate(PROMPTS, 3, sp)
    check_layout(ro, len(PROMPTS), 3)
    logp, natural = recompute(policy, ro, sp.temperature or 1.0)
    mask = ro.response_mask_BT.bool()
    err = (logp - ro.logprobs_BT)[mask].abs().max().item()
    assert err <= 1e-5, err
    # routes: every input position t < total_len - 1, zeros elsewhere
    b, t = ro.tokens_BT.shape
    assert ro.routes_BTLK.shape == (b, t, policy.num_moe_layers, 2)
    assert ro.routes_BTLK.dtype == torch.uint8
    valid = torch.arange(t)[None] < (ro.total_lens_B - 1)[:, None]
    routes = ro.routes_BTLK.long()
    assert torch.equal(routes[:, : t - 1][valid[:, : t - 1]], natural[valid[:, : t - 1]])
    assert (routes[~valid] == 0).all()
    if sp.stop_token_ids:  # some rows stopped early and the cache was compacted
        assert "stop" in ro.finish_reasons and ro.extras["compactions"] >= 1


def test_greedy_equals_naive_recompute_loop(policy, engine):
    ro = engine.generate(PROMPTS, 2, SamplingParams(temperature=0.0, max_new_tokens=12))
    for i, naive in enumerate(naive_greedy(policy, PROMPTS, 12)):
        assert response(ro, 2 * i) == naive and response(ro, 2 * i + 1) == naive, i
    assert ro.finish_reasons == ["length"] * ro.batch_size


def test_mixed_lengths_equal_each_prompt_alone(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=40, return_routes=True)
    ro = engine.generate(PROMPTS, 2, sp)
    for i, p in enumerate(PROMPTS):
        for j in range(2):
            row = 2 * i + j
            alone = engine.generate(
                [p], 1, SamplingParams(temperature=1.0, max_new_tokens=8, seed=40 + row, return_routes=True)
            )
            assert response(alone, 0) == response(ro, row)
            n = int(alone.total_lens_B[0])
            torch.testing.assert_close(alone.logprobs_BT[0, :n], ro.logprobs_BT[row, :n], atol=1e-5, rtol=0)
            assert torch.equal(alone.routes_BTLK[0, :n], ro.routes_BTLK[row, :n])


def test_seeds_reproducible_and_distinct(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=123)
    a = engine.generate(PROMPTS[:2], 4, sp)
    b = engine.generate(PROMPTS[:2], 4, sp)
    c = engine.generate(PROMPTS[:2], 4, SamplingParams(temperature=1.0, max_new_tokens=10, seed=999))
    assert torch.equal(a.tokens_BT, b.tokens_BT) and torch.equal(a.logprobs_BT, b.logprobs_BT)
    assert not torch.equal(a.tokens_BT, c.tokens_BT)
    rows = {tuple(response(a, r)) for r in range(4)}  # samples of one prompt differ (seed + j)
    assert len(rows) > 1
    # chunking the batch (max_batch) does not change any row
    from moe_rl.rollout.embedded import EmbeddedEngine

    chunked = EmbeddedEngine(engine.policy, pad_id=0, max_batch=3).generate(PROMPTS[:2], 4, sp)
    assert chunked.extras["chunks"] == 3
    assert torch.equal(chunked.tokens_BT, a.tokens_BT)


def test_stop_tokens_end_rows_and_are_kept(policy, engine):
    free = engine.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=12))
    stop = response(free, 1)[3]  # a token row 1 emits as its 4th response token
    ro = engine.generate(
        PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))
    )
    for b in range(len(PROMPTS)):
        full = response(free, b)
        if stop in full:
            cut = full[: full.index(stop) + 1]
            assert response(ro, b) == cut and ro.finish_reasons[b] == "stop"
        else:
            assert response(ro, b) == full and ro.finish_reasons[b] == "length"
    assert ro.finish_reasons[1] == "stop" and response(ro, 1)[-1] == stop
    assert [response(ro, b) for b in range(len(PROMPTS))] == naive_greedy(policy, PROMPTS, 12, (stop,))
    from moe_rl.rollout.embedded import EmbeddedEngine  # eos_id stops like a stop token

    eos = EmbeddedEngine(policy, pad_id=0, eos_id=stop).generate(
        PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=12)
    )
    assert torch.equal(eos.tokens_BT, ro.tokens_BT) and eos.finish_reasons == ro.finish_reasons


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p=tiny"])
def test_degenerate_filters_equal_greedy(engine, kw):
    greedy = engine.generate(PROMPTS, 2, SamplingParams(temperature=0.0, max_new_tokens=10))
    ro = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, seed=5, max_new_tokens=10, **kw))
    assert torch.equal(ro.tokens_BT, greedy.tokens_BT)
    # log-probs stay those of the unfiltered temperature-1 distribution (SGLang convention)
    torch.testing.assert_close(ro.logprobs_BT, greedy.logprobs_BT, atol=1e-6, rtol=0)


def test_sample_tokens_inverse_cdf_and_filters():
    from moe_rl.rollout.embedded import sample_tokens

    logits = torch.log(torch.tensor([[0.1, 0.5, 0.2, 0.2]])).expand(5, 4)
    u = torch.tensor([0.0, 0.09, 0.11, 0.61, 0.999])
    full = sample_tokens(logits, SamplingParams(temperature=1.0), u)
    assert full.tolist() == [0, 0, 1, 2, 3]
    # top-p 0.6 keeps {1, 2} (0.5 then 0.2 reaches 0.6); ties broken by sort order
    p = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.6), u)
    assert p.tolist()[:4] == [1] * 4 and p.tolist()[4] in (2, 3)
    k = sample_tokens(logits, SamplingParams(temperature=1.0, top_k=1), u)
    assert k.tolist() == [1] * 5


def test_weight_version_and_update(policy):
    from moe_rl.rollout.embedded import EmbeddedEngine

    eng = EmbeddedEngine(policy, pad_id=0, weight_version="v0")
    assert eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2, seed=0)).weight_version == "v0"
    assert eng.update_weights(policy, "v1") == "v1"
    ro = eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2, seed=0))
    assert ro.weight_version == "v1" and ro.extras["generated_tokens"] == 2
    assert ro.extras["tokens_per_s"] > 0 and ro.extras["prefill_s"] > 0 and ro.extras["decode_s"] > 0


def test_weight_sink_loads_hf_tensors_all_or_nothing(policy, engine):
    from moe_rl.megatron.hf import PolicyHFSource

    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS[:2], 1, sp)
    original = dict(PolicyHFSource(policy).hf_tensors())
    meta = engine.hf_param_meta()
    assert {n: tuple(t.shape) for n, t in original.items()} == {n: s for n, (s, _) in meta.items()}
    try:
        bad = [(n, t * 0) for n, t in original.items()] + [("model.no_such.weight", torch.zeros(1))]
        with pytest.raises(ValueError, match="no_such"):
            engine.load_hf_tensors(bad)
        assert torch.equal(engine.generate(PROMPTS[:2], 1, sp).tokens_BT, before.tokens_BT)  # untouched
        g = torch.Generator().manual_seed(0)
        engine.load_hf_tensors((n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in original.items())
        assert not torch.equal(engine.generate(PROMPTS[:2], 1, sp).tokens_BT, before.tokens_BT)
    finally:
        engine.load_hf_tensors(original.items())
    assert torch.equal(engine.generate(PROMPTS[:2], 1, sp).tokens_BT, before.tokens_BT)


def test_refuses_tensor_parallel_and_bad_requests(engine):
    from moe_rl.rollout.embedded import EmbeddedEngine

    fake = SimpleNamespace(info=SimpleNamespace(tp_size=2, device=torch.device("cpu")))
    with pytest.raises(NotImplementedError, match="tensor_parallel=2"):
        EmbeddedEngine(fake, pad_id=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[1] * 60], 1, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], 1, SamplingParams())
    assert engine.generate([], 2, SamplingParams()).batch_size == 0


@pytest.mark.integration
def test_registry_is_lazy():
    assert set(ROLLOUT_ENGINES) == {"embedded", "sglang"}
    with pytest.raises(ValueError, match="embedded, sglang"):
        get_engine_class("vllm")
    code = (
        "import sys, moe_rl.rollout as r; assert 'megatron' not in sys.modules; "
        "assert r.get_engine_class('embedded').__name__ == 'EmbeddedEngine'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ignore_eos_keeps_generating_but_stop_tokens_still_stop(engine):
    from moe_rl.rollout.types import SamplingParams

    prompt = [[7, 8, 9]]
    first = engine.generate(prompt, 1, SamplingParams(temperature=0.0, max_new_tokens=6))
    eos = int(first.tokens_BT[0, 3])  # the greedy first response token becomes "eos"
    eos_engine = type(engine)(engine.policy, pad_id=0, eos_id=eos)
    stop = eos_engine.generate(prompt, 1, SamplingParams(temperature=0.0, max_new_tokens=6))
    keep = eos_engine.generate(prompt, 1, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    assert stop.finish_reasons == ["stop"] and stop.response_mask_BT.sum().item() == 1
    assert keep.finish_reasons == ["length"] and keep.response_mask_BT.sum().item() == 6
    assert torch.equal(keep.tokens_BT, first.tokens_BT)
    halt = eos_engine.generate(
        prompt, 1, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, stop_token_ids=(eos,))
    )
    assert halt.response_mask_BT.sum().item() == 1  # explicit stop tokens still stop


def test_row_js_kth_token_takes_its_generators_kth_draw(policy, engine):
    """Sampling at a seed: row j's k-th response token is the inverse-CDF pick of the k-th U[0, 1) of
    a generator seeded ``seed + j`` (SGLang's per-request seed rule), checked against a naive loop that
    recomputes the whole batch and draws one uniform at a time."""
    from moe_rl.rollout.embedded import row_generators, sample_tokens

    sp = SamplingParams(temperature=1.0, max_new_tokens=9, seed=321)
    ro = engine.generate(PROMPTS, 2, sp)
    rows = [list(p) for p in PROMPTS for _ in range(2)]
    gens = row_generators(len(rows), sp.seed)
    with torch.no_grad():
        for _ in range(sp.max_new_tokens):
            width = max(map(len, rows))
            logits = policy.logits(torch.tensor([r + [0] * (width - len(r)) for r in rows]))
            last = torch.stack([logits[i, len(r) - 1] for i, r in enumerate(rows)])
            u = torch.stack([torch.rand((), generator=g) for g in gens])
            for r, tok in zip(rows, sample_tokens(last, sp, u).tolist()):
                r.append(tok)
    for i, r in enumerate(rows):
        assert response(ro, i) == r[len(PROMPTS[i // 2]) :], i
