"""Colocated engines: the trainer's memory waits on the host while they work (issue 28).

An engine on the trainer's own GPUs reserves ``rollout.sglang.mem_fraction`` of each; verl and
slime free the trainer's weights, gradients and optimizer state for it and take them back before
training. These tests check the effect, not the setting: while the engine generates, every model
weight, gradient buffer and Adam moment of the trainer has no device storage; while it takes a
push, the weights are there and the rest is not; and the run trains exactly as one that never
offloaded (same weights, same metrics, bit for bit).
"""

from __future__ import annotations

import dataclasses

import torch

from moe_rl.megatron.offload import HostOffload
from tests.tiny import tiny_rl_recipe


def test_host_offload_keeps_every_view_and_value():
    p = torch.nn.Parameter(torch.randn(6, 4))
    view, other = p.data[2:], torch.randn(5)
    before = (p.detach().clone(), other.clone())
    off = HostOffload()
    assert off.release([p, view, other]) == (24 + 5) * 4  # a storage once, however many views
    assert p.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    grads = torch.ones(8)
    assert off.release([grads], keep_values=False) == 32
    assert off.resume() == (24 + 5 + 8) * 4 and off.released_bytes == 0
    assert torch.equal(p.detach(), before[0]) and torch.equal(view, before[0][2:])
    assert torch.equal(other, before[1]) and torch.equal(grads, torch.zeros(8))


def _colocated_run(tmp_path, offload: bool):
    """A Run whose engine (embedded, bf16, its own weights) stands for a colocated SGLang engine:
    the recipe says colocated, and the engine records what the trainer holds when it is called."""
    from moe_rl.trainer.run import Run

    # a bf16 rollout: the embedded engine keeps its own copy of the weights
    run = Run(tiny_rl_recipe(tmp_path / f"run-{offload}", rollout={"dtype": "bf16"}, train={"rl_steps": 2}))
    run.make_optimizer("rl")
    run.ensure_engine()
    rollout = run.recipe.rollout
    sglang = dataclasses.replace(rollout.sglang, colocate=True, offload_trainer=offload)
    run.recipe = dataclasses.replace(
        run.recipe, rollout=dataclasses.replace(rollout, engine="sglang", sglang=sglang, weight_sync="tensor")
    )
    run.weights_for_engine = lambda: None  # in process, as the embedded engine takes them
    seen: list[tuple[str, bool, int]] = []
    params = list(run.policy.model.parameters())
    engine = run.engine
    generate, update = engine.generate, engine.update_weights

    def weights_present() -> bool:
        return all(p.untyped_storage().nbytes() > 0 for p in params)

    def recording_generate(*a, **k):
        seen.append(("generate", weights_present(), run.optimizer.released_bytes))
        return generate(*a, **k)

    def recording_update(*a, **k):
        seen.append(("push", weights_present(), run.optimizer.released_bytes))
        return update(*a, **k)

    engine.generate, engine.update_weights = recording_generate, recording_update
    return run, seen


def _train(run):
    from moe_rl.trainer.loop import evaluate
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.timer import StepTimer

    metrics = []
    for step in range(2):
        m = rl_step(run, step, StepTimer()).metrics
        metrics.append({k: v for k, v in m.items() if not k.startswith("time/") and k != "tokens_per_s"})
    metrics.append(evaluate(run, 2))
    state = [p.detach().clone() for p in run.policy.model.parameters()]
    moments = [
        v.clone() for o in run.optimizer.inner for st in o.optimizer.state.values() for v in st.values()
    ]
    return metrics, state, moments


def test_colocated_rollouts_run_with_the_trainers_memory_on_the_host(tmp_path, parallel_info):
    plain, plain_seen = _colocated_run(tmp_path, offload=False)
    offloaded, seen = _colocated_run(tmp_path, offload=True)
    try:
        ref = _train(plain)
        got = _train(offloaded)
        assert len(plain_seen) == 5 and {s[2] for s in plain_seen} == {0} and all(s[1] for s in plain_seen)
        model_bytes = sum(p.numel() * p.element_size() for p in offloaded.policy.model.parameters())
        gens = [s for s in seen if s[0] == "generate"]
        pushes = [s for s in seen if s[0] == "push"]
        assert len(gens) == 3 and len(pushes) == 2  # two steps' rollouts and the evaluation; two pushes
        # generating: no weight on the device, and weights + gradients + Adam moments on the host
        assert all(not present and released >= 2 * model_bytes for _, present, released in gens[1:])
        assert not gens[0][1] and gens[0][2] >= model_bytes  # before the first step: no Adam state yet
        # a push reads the weights: they are there; gradients and Adam state are not
        assert all(present and released >= model_bytes for _, present, released in pushes)
        assert offloaded.optimizer.released_bytes == 0  # all back after each engine call
        assert got[0] == ref[0]
        for a, b in zip(got[1] + got[2], ref[1] + ref[2]):
            assert torch.equal(a, b)
    finally:
        plain.close()
        offloaded.close()


# ---------------------------------------------------------------- pinned host memory reused (issue 45)
class _HostAllocations:
    """Counts every host buffer ``torch.empty`` makes while installed (pinned on a GPU machine:
    each one a new block of torch's caching host allocator, which keeps it)."""

    def __init__(self, monkeypatch):
        self.count, real = 0, torch.empty

        def counting(*a, **k):
            out = real(*a, **k)
            if out.device.type == "cpu" and out.numel():
                self.count += 1
            return out

        monkeypatch.setattr(torch, "empty", counting)


def test_host_offload_reuses_one_arena_over_five_cycles(monkeypatch):
    """Five release / resume cycles of the same storages: host buffers are made in the first only
    (before: a fresh pinned buffer per storage per cycle, 5 x 3 here, ~0.5 TB a node at 30B)."""
    weights, moments = torch.nn.Parameter(torch.randn(64, 8)), [torch.randn(100), torch.randn(7, 3)]
    grads = torch.ones(33)
    want = [weights.detach().clone(), *(m.clone() for m in moments)]
    allocs = _HostAllocations(monkeypatch)
    off, per_cycle = HostOffload(), []
    for cycle in range(5):
        before = allocs.count
        off.release([grads], keep_values=False)
        freed = off.release([weights, *moments])
        assert freed == (64 * 8 + 100 + 21) * 4 and weights.untyped_storage().nbytes() == 0
        with torch.no_grad():
            back = off.resume()
            assert back == freed + 33 * 4
            weights.add_(cycle)  # the values change between offloads: each cycle keeps its own
            want[0].add_(cycle)
        per_cycle.append(allocs.count - before)
        assert all(torch.equal(a, b) for a, b in zip([weights.detach(), *moments], want))
    assert per_cycle[1:] == [0, 0, 0, 0], per_cycle
    assert off.host_bytes >= (64 * 8 + 100 + 21) * 4


def test_optimizer_offload_allocates_host_memory_once(tmp_path, parallel_info, monkeypatch):
    """The trainer's release / resume over five steps (Adam state made at the first): host buffers
    are made while its state grows, none after."""
    from moe_rl.config import OptimConfig
    from moe_rl.megatron.optim import Optimizer
    from tests.tiny import tiny_policy

    policy = tiny_policy()
    opt = Optimizer(policy.model, OptimConfig(lr=1e-3), policy.info)
    allocs, per_cycle = _HostAllocations(monkeypatch), []
    tokens = torch.randint(0, policy.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        (-policy.logprobs(tokens).logp_BT.sum()).backward()
        opt.step()
        before = allocs.count
        assert opt.release_memory(weights=True) > 0
        opt.resume_memory()
        per_cycle.append(allocs.count - before)
    assert per_cycle[0] > 0 and per_cycle[1:] == [0, 0, 0, 0], per_cycle
