"""Colocated phases in order (issue 45): the trainer's state and the engines' memory take turns.

A ``moe-rl serve`` engine stands in for SGLang, its two memory endpoints run through SGLang's own
``release_memory_occupation`` / ``resume_memory_occupation`` over a stand-in memory saver
(:mod:`tests.sglang_memory`: which tags are resident; released weights zeroed, kept by the CPU
backup). A colocated run trains three RL steps, evaluating after each (a rollout after a rollout
with no push between), and every change of either side's memory is checked:

- while the engines hold any tag, no trainer state (gradients, Adam) is on the device;
- while they hold the KV cache or CUDA graphs, no trainer weight is either;
- a push resumes the weights alone; the KV cache comes back at the next rollout;
- each rollout after a push is sampled from the pushed weights (trainer recompute), evaluations
  between included.

Before the fix the engines resumed their KV cache and CUDA graphs at the end of each push and the
trainer then took its state back beside them: the check fails at the first push.
"""

from __future__ import annotations

import pytest
import torch

from tests.sglang_memory import VERSIONS, SGLangMemory, attach
from tests.tiny import tiny_policy, tiny_rl_recipe


class Timeline:
    """Both sides' memory at every change, and the changes that broke a rule."""

    def __init__(self):
        self.run, self.engine, self.events, self.broken = None, set(), [], []

    def trainer(self) -> tuple[bool, bool]:
        """(trainer state on the device, trainer weights on the device)."""
        opt, params = self.run.optimizer, list(self.run.policy.model.parameters())
        grads = [b.grad_data for b in opt.ddp.buffers + opt.ddp.expert_parallel_buffers]
        state = any(g.untyped_storage().nbytes() > 0 for g in grads)
        return state, all(p.untyped_storage().nbytes() > 0 for p in params)

    def changed(self, who: str, engine: set | None = None) -> None:
        if engine is not None:
            self.engine = engine
        state, weights = self.trainer()
        event = (who, "state" if state else "-", "weights" if weights else "-", sorted(self.engine))
        self.events.append(event)
        if self.engine and state:
            self.broken.append(("engine memory beside the trainer's state", len(self.events), event))
        if self.engine & {"kv_cache", "cuda_graph"} and weights:
            self.broken.append(
                ("KV cache / CUDA graphs beside the trainer's weights", len(self.events), event)
            )


@pytest.mark.parametrize("version", VERSIONS[1:])
def test_trainer_state_and_engine_memory_take_turns(tmp_path, parallel_info, version):
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.serve.http import ServerThread
    from moe_rl.trainer.loop import evaluate
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.run import Run
    from moe_rl.trainer.timer import StepTimer

    served = tiny_policy(vocab_size=104)
    server = ServerThread(EmbeddedEngine(served, pad_id=0), weight_version="0", enable_memory_saver=True)
    line = Timeline()
    memory = SGLangMemory(
        version,
        served.model,
        cpu_backup=True,  # what the launcher asks for (--enable-weights-cpu-backup)
        is_idle=lambda: server.app.active == 0,
        on_change=lambda tags: line.changed("engine", tags),
    )
    attach(server, memory)
    recipe = tiny_rl_recipe(
        tmp_path / "run",
        rollout={
            "engine": "sglang",
            "weight_sync": "tensor",
            "verify_every": 0,
            "sglang": {"url": server.url, "colocate": True},
        },
        train={"rl_steps": 3},
    )
    run = Run(recipe)
    try:
        run.make_optimizer("rl")
        line.run, line.engine = run, set(memory.saver.resident)
        opt = run.optimizer
        release, resume = opt.release_memory, opt.resume_memory

        def traced_release(**kw):
            out = release(**kw)
            line.changed("trainer out")
            return out

        def traced_resume():
            out = resume()
            line.changed("trainer in")
            return out

        opt.release_memory, opt.resume_memory = traced_release, traced_resume
        run.ensure_engine()
        metrics = []
        for step in range(3):
            calls = len(memory.saver.calls)
            metrics.append(rl_step(run, step, StepTimer()).metrics)
            pushed = memory.saver.calls[calls:]
            evaluate(run, step + 1)
            assert ("resume", "weights") in pushed, pushed
        assert not line.broken, (line.broken[:3], line.events[:40])
        # a push resumes the weights alone: each one's resume of the weights is followed by a
        # release before any KV cache comes back
        calls = memory.saver.calls
        for i, call in enumerate(calls):
            if call == ("resume", "weights") and i + 1 < len(calls) and calls[i + 1] == ("pause", "weights"):
                break
        else:
            raise AssertionError(f"no push resumed the weights alone: {calls}")
        for step, m in enumerate(metrics[1:], 1):  # sampled from the weights pushed after the last step
            assert m["mismatch/abs_log_ratio"] < 1e-5, (step, m["mismatch/abs_log_ratio"])
        assert memory.saver.resident == set() and opt.released_bytes == 0
    finally:
        run.close()
        server.stop()


@pytest.mark.parametrize("version", VERSIONS)
def test_the_stand_in_runs_sglangs_own_checks(version):
    """SGLang's code, not a restatement: a resume of what was not released fails (its KeyError),
    a release needs an idle server, all tags by default; released weights are lost without the
    CPU backup and kept with it."""
    model = torch.nn.Linear(2, 2)
    idle = [True]
    for backup in (False, True):
        memory = SGLangMemory(version, model, cpu_backup=backup, is_idle=lambda: idle[0])
        with torch.no_grad():
            model.weight.fill_(3.0)
        with pytest.raises(KeyError):
            memory.resume(["kv_cache"])
        memory.scheduler.offload_tags.clear()
        memory.release(None)
        assert memory.saver.resident == set()
        memory.resume(["weights"])
        assert memory.saver.resident == {"weights"}
        assert torch.all(model.weight == (3.0 if backup else 0.0))
        memory.resume(["kv_cache", "cuda_graph"])
        idle[0] = False
        with pytest.raises(AssertionError, match="idle"):
            memory.release(["kv_cache"])
        idle[0] = True


def test_colocated_engines_keep_their_weights_across_a_release(tmp_path, monkeypatch):
    """SGLang frees released weights unless launched with ``--enable-weights-cpu-backup``; with
    engines released after every phase, a rollout after a rollout (an evaluation, then the next
    step) would serve zeros (the stand-in above, ``cpu_backup=False``). Launched colocated engines
    get the flag; an attached one that runs without it is refused, naming it."""
    from moe_rl.config import ConfigError, recipe_from_dict
    from moe_rl.rollout import factory, sglang_launcher

    launched = []

    class Launcher:
        def __init__(self, cfg, **kw):
            launched.append(cfg)
            self.url = "http://127.0.0.1:1"

        def start(self):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(sglang_launcher, "SGLangLauncher", Launcher)
    for colocate in (True, False):
        sync = "tensor" if colocate else "disk"
        over = [f"rollout.sglang.colocate={str(colocate).lower()}", f"rollout.weight_sync={sync}"]
        over += ["rollout.engine=sglang", "rollout.sglang.gpus=[0]"]
        factory.launch_fleet(recipe_from_dict({}, over), tmp_path, "/m", multi_node=False)
        cmd = sglang_launcher.build_command(launched[-1], 1)
        assert ("--enable-weights-cpu-backup" in cmd) is colocate and (
            "--enable-memory-saver" in cmd
        ) is colocate

    class Attached:
        base_url = "http://e:1"

        def __init__(self, info):
            self.info = info

        def server_info(self):
            return self.info

    factory.check_colocated_servers(
        [Attached({"enable_memory_saver": True, "enable_weights_cpu_backup": True})]
    )
    factory.check_colocated_servers([Attached({})])  # moe-rl serve: keeps its weights, says nothing
    with pytest.raises(ConfigError, match="http://e:1 runs without --enable-weights-cpu-backup"):
        factory.check_colocated_servers(
            [Attached({"enable_memory_saver": True, "enable_weights_cpu_backup": False})]
        )
