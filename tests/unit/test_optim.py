"""megatron-core's DDP and optimizer behind moe_rl.megatron.optim.Optimizer, in one process."""

import pytest
import torch

from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig


@pytest.fixture
def policy(tiny_policy):
    return tiny_policy


def tokens(b=4, t=17, v=64, seed=0):
    return torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(seed))


def test_forward_backward_step_changes_weights_and_lowers_loss(policy, parallel_info):
    from moe_rl.megatron.optim import Optimizer

    opt = Optimizer(policy.model, OptimConfig(lr=3e-3), parallel_info)
    tok = tokens(8, 33)
    before = [p.detach().clone() for p in policy.parameters()]
    losses = []
    for _ in range(4):
        loss = -policy.logprobs(tok).logp_BT[:, 1:].mean()
        loss.backward()
        # DDP's hooks move each gradient into the parameter's slice of the grad buffer
        assert all(p.main_grad.abs().sum() > 0 for p in policy.parameters()), (
            "every parameter gets a gradient"
        )
        stats = opt.step()
        losses.append(float(loss))
        assert stats["skipped"] == 0 and stats["grad_norm"] > 0
    assert losses[-1] < losses[0]
    assert all(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_step_equals_torch_adamw_with_clipping(policy, parallel_info):
    """Reference: megatron's step is torch AdamW (decoupled decay off for norms) after a global-norm clip."""
    from moe_rl.megatron.optim import Optimizer

    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5)
    ref_params = [p.detach().clone().requires_grad_(True) for p in policy.parameters()]
    ref = torch.optim.AdamW(
        [
            {"params": [q for q in ref_params if q.dim() >= 2], "weight_decay": 0.1},
            {"params": [q for q in ref_params if q.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    opt = Optimizer(policy.model, cfg, parallel_info)
    for seed in range(2):
        (-policy.logprobs(tokens(seed=seed)).logp_BT.mean()).backward()
        grads = [p.main_grad.clone() for p in policy.parameters()]
        norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        for q, g in zip(ref_params, grads):
            q.grad = g * min(1.0, 0.5 / (float(norm) + 1e-6))
        ref.step()
        stats = opt.step()
        assert stats["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    for p, q in zip(policy.parameters(), ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)


def test_micro_batches_accumulate_to_the_whole_batch(parallel_info, tiny_model_cfg):
    """Two micro-batch backwards (the second after ``no_sync``) give the one-batch gradient and step."""
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    tok = tokens(8, 17)
    results = []
    for split in (1, 2):
        pol = build_policy(tiny_model_cfg, ParallelConfig(), parallel_info)
        opt = Optimizer(pol.model, OptimConfig(lr=1e-3), parallel_info)
        for rows in opt.micro_batches(torch.chunk(tok, split)):
            (-pol.logprobs(rows).logp_BT.sum() / tok.numel()).backward()
        grads = [p.main_grad.clone() for p in pol.parameters()]
        opt.step()
        results.append((grads, [p.detach().clone() for p in pol.parameters()]))
    for a, b in zip(*(r[0] for r in results)):  # fp32 sums in another order
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for a, b in zip(*(r[1] for r in results)):  # Adam's m / sqrt(v) magnifies it where g ~ 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_second_optimizer_reuses_the_ddp_wrapper(policy, parallel_info):
    """One DDP per module (its hooks would otherwise run twice); other DDP settings are refused."""
    from moe_rl.megatron.optim import Optimizer

    first = Optimizer(policy.model, OptimConfig(lr=1e-3), parallel_info)
    second = Optimizer(policy.model, OptimConfig(lr=1e-3), parallel_info)
    assert second.ddp is first.ddp
    (-policy.logprobs(tokens()).logp_BT.mean()).backward()
    once = [p.main_grad.clone() for p in policy.parameters()]
    second.zero_grad()
    (-policy.logprobs(tokens()).logp_BT.mean()).backward()
    for a, p in zip(once, policy.parameters()):
        torch.testing.assert_close(p.main_grad, a, atol=0, rtol=0)
    with pytest.raises(ValueError, match="already wrapped in DDP"):
        Optimizer(policy.model, OptimConfig(lr=1e-3, distributed=True), parallel_info)


def test_non_finite_gradient_skips_the_step(policy, parallel_info):
    from moe_rl.megatron.optim import Optimizer

    opt = Optimizer(policy.model, OptimConfig(lr=1e-3), parallel_info)
    before = [p.detach().clone() for p in policy.parameters()]
    (policy.logprobs(tokens()).logp_BT.sum() * float("nan")).backward()
    assert opt.step()["skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert opt.step_count == 0
    assert all(not p.main_grad.any() for p in policy.parameters()), "the skipped gradients are cleared"


def test_lr_schedule():
    from moe_rl.megatron.optim import lr_at

    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=10, decay_style="cosine")
    assert lr_at(cfg, 0) == 0.25 and lr_at(cfg, 3) == 1.0
    assert abs(lr_at(cfg, 14) - 0.1) < 1e-9 and 0.1 < lr_at(cfg, 9) < 1.0
    lin = OptimConfig(lr=1.0, decay_steps=4, decay_style="linear")
    assert [lr_at(lin, s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


@pytest.mark.parametrize("distributed", [False, True])
def test_checkpoint_round_trip_is_exact(policy, parallel_info, tiny_model_cfg, tmp_path, distributed):
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    cfg = OptimConfig(lr=1e-3, distributed=distributed)
    opt = Optimizer(policy.model, cfg, parallel_info)
    tok = tokens()
    for _ in range(2):
        (-policy.logprobs(tok).logp_BT.mean()).backward()
        opt.step()
    save_checkpoint(tmp_path, 2, policy.model, opt, extra={"stage": "sft", "step": 2})
    rng_after_save = torch.rand(3)
    (-policy.logprobs(tok).logp_BT.mean()).backward()
    opt.step()
    with torch.no_grad():
        want = policy.logprobs(tok).logp_BT

    other = build_policy(
        tiny_model_cfg.__class__(**{**tiny_model_cfg.__dict__, "seed": 99}), ParallelConfig(), parallel_info
    )
    opt2 = Optimizer(other.model, cfg, parallel_info)
    meta = load_checkpoint(tmp_path, other.model, opt2)
    assert meta["extra"] == {"stage": "sft", "step": 2} and opt2.step_count == 2
    torch.testing.assert_close(torch.rand(3), rng_after_save)  # RNG restored
    (-other.logprobs(tok).logp_BT.mean()).backward()
    opt2.step()
    with torch.no_grad():
        torch.testing.assert_close(other.logprobs(tok).logp_BT, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_snapshot_restored_continues_bit_for_bit_as_the_state_it_copied(
    parallel_info, tiny_model_cfg, dtype
):
    """One state, several continuations (studies/one_update): weights by the policy's state_dict,
    the optimizer by snapshot / restore. Each continuation from the restored state steps exactly as
    the first did, however far the one before it went; the snapshot is not changed by those steps.
    Restoring the weights alone (Adam's moments and step, bf16's fp32 main weights, the step count
    left where the last continuation ended) fails this."""
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    cfg = ModelConfig(**{**tiny_model_cfg.__dict__, "dtype": dtype, "num_layers": 1})
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    opt = Optimizer(policy.model, OptimConfig(lr=1e-3, warmup_steps=4), parallel_info)

    def step(seed):
        (-policy.logprobs(tokens(seed=seed)).logp_BT.float().mean()).backward()
        return opt.step()

    for s in range(2):
        step(s)
    weights = {k: v.clone() for k, v in policy.model.state_dict().items() if torch.is_tensor(v)}
    snap = opt.snapshot()
    frozen = [t.clone() for t in _tensors(snap)]

    def continuation(steps):
        lrs = [step(10 + i)["lr"] for i in range(steps)]
        with torch.no_grad():
            return lrs, policy.logprobs(tokens(seed=99)).logp_BT.float()

    want = continuation(2)
    continuation(3)  # another continuation runs further
    for _ in range(2):
        policy.model.load_state_dict(weights, strict=False)
        opt.restore(snap)
        assert opt.step_count == 2
        lrs, logp = continuation(2)
        assert lrs == want[0]
        torch.testing.assert_close(logp, want[1], atol=0, rtol=0)
    assert len(frozen) > 4 and all(torch.equal(a, b) for a, b in zip(frozen, _tensors(snap), strict=True))


def _tensors(tree) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples, in order."""
    if torch.is_tensor(tree):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list | tuple) else []
    return [t for x in items for t in _tensors(x)]


def test_the_distributed_optimizer_refuses_an_in_memory_snapshot(parallel_info, tiny_model_cfg):
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    policy = build_policy(tiny_model_cfg, ParallelConfig(), parallel_info)
    with pytest.raises(NotImplementedError, match="save a checkpoint instead"):
        Optimizer(policy.model, OptimConfig(lr=1e-3, distributed=True), parallel_info).snapshot()


def test_bf16_parameters_get_fp32_master_weights(parallel_info, tiny_model_cfg):
    """Updates below bf16's resolution accumulate in the fp32 main weights instead of rounding away
    (megatron's mixed-precision optimizer; on CPU through the cuda_as_cpu shim)."""
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    cfg = ModelConfig(**{**tiny_model_cfg.__dict__, "dtype": "bfloat16", "num_layers": 1})
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    opt = Optimizer(policy.model, OptimConfig(lr=1e-4, grad_clip=0.0), parallel_info)
    w = policy.model.decoder.final_layernorm.weight  # initialised to ones
    assert w.dtype == torch.bfloat16 and torch.equal(w, torch.ones_like(w))
    for _ in range(50):
        for p in policy.parameters():
            p.main_grad.fill_(1.0)
        opt.step()
    # Adam moves each weight by ~lr per step: 50 x 1e-4 = 5e-3, below bf16's spacing at 1.0 (7.8e-3)
    # per step but visible in total; plain bf16 AdamW would leave w at exactly 1.0
    assert torch.allclose(w.main_param, torch.full(w.shape, 1 - 5e-3), atol=2e-4)
    assert w.dtype == torch.bfloat16 and float(w[0]) < 1.0


def test_a_checkpoint_saved_before_the_first_step_resets_the_optimizer(policy, parallel_info, tmp_path):
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.megatron.optim import Optimizer

    opt = Optimizer(policy.model, OptimConfig(lr=1e-3), parallel_info)
    save_checkpoint(tmp_path, 1, policy.model, opt)  # no Adam state yet: none is saved
    saved = [p.detach().clone() for p in policy.parameters()]
    (-policy.logprobs(tokens()).logp_BT.mean()).backward()
    opt.step()
    load_checkpoint(tmp_path, policy.model, opt)
    assert opt.step_count == 0 and all(not o.optimizer.state for o in opt.inner)
    assert all(torch.equal(a, p) for a, p in zip(saved, policy.parameters()))


def test_cpu_fp32_steps_with_fused_adamw(parallel_info):
    """megatron-core falls back to torch's AdamW without TE/apex; on CPU in fp32 its fused kernel
    is used (about 2x faster per step on 20M parameters; the update tests above hold with it)."""
    from moe_rl.config import OptimConfig
    from moe_rl.megatron.optim import Optimizer
    from tests.tiny import tiny_policy

    opt = Optimizer(tiny_policy().model, OptimConfig(lr=1e-3), parallel_info)
    groups = [g for o in opt.inner for g in o.optimizer.param_groups]
    assert groups and all(g["fused"] and not g["foreach"] for g in groups)


def test_foreach_multi_tensor_ops_equal_megatrons_local_ones(parallel_info):
    """The foreach stand-ins for megatron-core's local multi-tensor fallbacks: the same values."""
    from megatron.core import utils

    from moe_rl.megatron.optim import foreach_l2_norm, foreach_scale
    from moe_rl.megatron.shims import cuda_as_cpu

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(*s, generator=g) for s in ((3, 5), (7,), (2, 2, 4), (1,))]
    with cuda_as_cpu():
        want, _ = utils.local_multi_tensor_l2_norm(0, None, [ts], False)
    got, _ = foreach_l2_norm(0, None, [ts], False)
    assert got.shape == (1,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want.to(got.device), rtol=1e-6, atol=0)
    assert float(foreach_l2_norm(0, None, [[]], False)[0]) == 0.0
    for scale in (0.25, 1.0):
        for dtype in (torch.float32, torch.bfloat16):  # main weights to model weights: fp32 -> bf16
            want = [torch.zeros(t.shape, dtype=dtype) for t in ts]
            got = [torch.zeros(t.shape, dtype=dtype) for t in ts]
            utils.local_multi_tensor_scale(0, None, [ts, want], scale)
            foreach_scale(0, None, [ts, got], scale)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    same = [t.clone() for t in ts]
    foreach_scale(0, None, [same, same], 0.5)  # in place: clipping scales the gradients themselves
    assert all(torch.equal(a, b * 0.5) for a, b in zip(same, ts))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_clipped_step_norms_and_scales_in_a_fixed_number_of_ops(parallel_info, tiny_model_cfg, dtype):
    """Without transformer-engine or apex megatron-core's local multi-tensor fallbacks ran a norm
    per gradient (then read each back to the host: a sync per gradient on a GPU) and two kernels
    per tensor to scale or copy. A clipped step's ops, counted on its second step (the first also
    makes Adam's state), are now as many for 3 layers as for 1, but for views and, in bf16,
    megatron-core's copy of each gradient to its fp32 main gradient."""
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy
    from tests.ops import CountOps

    per_param = {"aten.detach", "aten.copy_"} if dtype == "bfloat16" else {"aten.detach"}
    counts = {}
    for layers in (1, 3):
        cfg = ModelConfig(**{**tiny_model_cfg.__dict__, "dtype": dtype, "num_layers": layers})
        policy = build_policy(cfg, ParallelConfig(), parallel_info)
        opt = Optimizer(policy.model, OptimConfig(lr=1e-3, grad_clip=1e-3), parallel_info)
        for step in range(2):
            (-policy.logprobs(tokens(seed=step)).logp_BT.float().mean()).backward()
            with CountOps() as ops:
                stats = opt.step()
            assert stats["skipped"] == 0 and stats["grad_norm"] > 1e-3  # clipped
        counts[layers] = {k: v for k, v in ops.count.items() if k not in per_param}
    grew = {k: (counts[1].get(k), v) for k, v in counts[3].items() if counts[1].get(k) != v}
    assert not grew, f"ops that grow with the parameter count (1 layer, 3 layers): {grew}"
