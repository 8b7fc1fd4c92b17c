"""Planted bugs against the tests that should catch them: the kill ratio and the survivors.

Each mutant is one small change to the library, named by what a user would see: the kind of bug
issue 34 found passing the whole unit tier (replay wiring, correction weights, the flip
instruments, retention), bugs in the pure math (GSPO's length normalisation, the advantages' std,
the SGLang route codec), and issue 48's classes: padding read on ragged batches, a write that is
not atomic, state a resume loses; with the lab's statistics, serve's limits and the trainer's
switches. For every mutant the tree of a commit (``--rev``, default HEAD; ``git archive``) is
copied to a temp folder, the change applied there, and the mutant's test files run against that
copy, the fast tier first and then, if it survived, the integration tier (``--tier``): it is
*killed* when they fail, a *survivor* when they pass. A mutant whose line the commit does not have
is *not applicable* (an older commit). The unmutated copy runs every tier first: the tests that
fail there are left out of every mutant's run and listed in the result (``baseline_failures``: a
broken test must not pass for a kill); a tier pytest cannot run stops the sweep.

    make mutate                                     # HEAD, both tiers
    python -m tools.mutate --only 30 31 --tier fast # two mutants against the fast tier
    python -m tools.mutate --rev 3821f12            # the same mutants against an older commit's tests

On demand, not in CI (an hour on a loaded 2-core machine). Writes
``benchmarks/results/mutate-<machine>-planted-<rev>.json`` and ``.png`` with a ``headline`` (killed,
survivors, the kill ratio, how many each tier killed).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, machine  # noqa: E402
from moe_rl.lab.results import write_json  # noqa: E402


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "R3 replays pi_old's recorded routes (R2's)",
        "moe_rl/routing/__init__.py",
        "return recorded if self.pi_old_action is RouterAction.RECORD else engine",
        "return recorded if self.replays_in_training else engine",
        (
            "tests/unit/test_wiring.py",
            "tests/integration/test_rl_e2e.py",
            "tests/unit/test_routing_replay.py",
        ),
    ),
    Mutant(
        "correction weights with pi_old and pi_roll swapped (rho inverted)",
        "moe_rl/trainer/rl.py",
        "correction_weights_for(algo, recomputed_BT, rollout_logp_BT, mask_BT)",
        "correction_weights_for(algo, rollout_logp_BT, recomputed_BT, mask_BT)",
        ("tests/unit/test_wiring.py", "tests/integration/test_rl_e2e.py", "tests/unit/test_corrections.py"),
    ),
    Mutant(
        "flip/drift against the replayed routes",
        "moe_rl/trainer/rl.py",
        "drift = route_flips(natural_BSLK, batch.old_routes_BSLK[rows], batch.valid_BS[rows])",
        "drift = route_flips(natural_BSLK, (batch.replay_BSLK if batch.replay_BSLK is not None "
        "else batch.old_routes_BSLK)[rows], batch.valid_BS[rows])",
        ("tests/unit/test_wiring.py", "tests/integration/test_rl_e2e.py"),
    ),
    Mutant(
        "flip/step's reference never advanced (cumulative drift)",
        "moe_rl/trainer/probe.py",
        "        self.before_PSLK = after_PSLK\n",
        "        pass\n",
        ("tests/unit/test_wiring.py", "tests/unit/test_trainer_seams.py", "tests/integration/test_rl_e2e.py"),
    ),
    Mutant(
        "retention prunes the newest older checkpoints",
        "moe_rl/megatron/checkpoint.py",
        "for old in mine[: max(len(mine) - (keep - 1), 0)]:",
        "for old in mine[::-1][: max(len(mine) - (keep - 1), 0)]:",
        (
            "tests/unit/test_policy.py",
            "tests/integration/test_checkpoint_writer.py",
            "tests/integration/test_resume.py",
            "tests/badinput/test_outputs_checkpoints.py",
        ),
    ),
    Mutant(
        "GSPO's ratio without length normalisation",
        "moe_rl/losses/metrics.py",
        "s_B = (log_sum_B / b.len_B.clamp(min=1)).exp()",
        "s_B = log_sum_B.exp()",
        ("tests/unit/test_losses.py", "tests/unit/test_loss_reference.py"),
    ),
    Mutant(
        "advantages with the population std",
        "moe_rl/losses/advantages.py",
        "correction = 1 if unbiased else 0",
        "correction = 0",
        ("tests/unit/test_advantages.py", "tests/unit/test_losses.py"),
    ),
    Mutant(
        "train.freeze_router read but not applied",
        "moe_rl/trainer/context.py",
        "frozen=self.frozen_for(stage), scaled=self.scaled_for(stage)",
        "scaled=self.scaled_for(stage)",
        ("tests/unit/test_freeze_router.py",),
    ),
    Mutant(
        "frozen routers keep their lr and weight decay (gradient zeroed only)",
        "moe_rl/megatron/optim.py",
        "config_overrides=_group_overrides(mcfg, self.frozen, self.scaled)",
        "config_overrides=None",
        ("tests/unit/test_freeze_router.py",),
    ),
    Mutant(
        "train.router_lr_mult read but not applied",
        "moe_rl/trainer/context.py",
        "frozen=self.frozen_for(stage), scaled=self.scaled_for(stage)",
        "frozen=self.frozen_for(stage)",
        ("tests/unit/test_freeze_router.py",),
    ),
    Mutant(
        "frozen routers' gradients left in the global norm",
        "moe_rl/megatron/optim.py",
        "            p.main_grad.zero_()\n",
        "            pass\n",
        ("tests/unit/test_freeze_router.py",),
    ),
    Mutant(
        "replayed gate weights passed but not used",
        "moe_rl/megatron/routing.py",
        "return probs + (fixed - probs).detach(), routing_map",
        "return output",
        ("tests/unit/test_replay_gates.py",),
    ),
    Mutant(
        "replayed gate weights as constants (the router gets no policy gradient)",
        "moe_rl/megatron/routing.py",
        "return probs + (fixed - probs).detach(), routing_map",
        "return fixed + probs * 0, routing_map",
        ("tests/unit/test_replay_gates.py",),
    ),
    Mutant(
        "the training forward drops the engine's gates",
        "moe_rl/trainer/rl.py",
        "        gates_BSLK=gates_BSLK,\n        pack=pack,\n        entropy=True,\n",
        "        gates_BSLK=None,\n        pack=pack,\n        entropy=True,\n",
        ("tests/unit/test_replay_gates.py",),
    ),
    Mutant(
        "the pi_old recompute drops the engine's gates",
        "moe_rl/trainer/rl.py",
        "routes_BSLK=routes, gates_BSLK=gates, pack=pack, noise=run.route_noise",
        "routes_BSLK=routes, gates_BSLK=None, pack=pack, noise=run.route_noise",
        ("tests/unit/test_replay_gates.py",),
    ),
    Mutant(
        "the lean decoder's gates left batch-major",
        "moe_rl/megatron/decode.py",
        "gates_out.append(probs.float().view(b, n, -1).transpose(0, 1).reshape(n * b, -1))",
        "gates_out.append(probs.float().reshape(n * b, -1))",
        ("tests/unit/test_replay_gates.py",),
    ),
    Mutant(
        "megatron's engine gates taken at the clean top-k, not the router's choice",
        "moe_rl/megatron/routing.py",
        "gates.append(output[0].detach().gather(1, own[-1]).float())",
        "gates.append(output[0].detach().topk(self.topk, dim=1).values.float())",
        ("tests/unit/test_replay_gates.py",),
    ),
    Mutant(
        "SGLang routes decoded layer-major",
        "moe_rl/routing/codec.py",
        ".reshape(-1, num_layers, topk)",
        ".reshape(-1, topk, num_layers).swapaxes(1, 2)",
        (
            "tests/unit/test_sglang_contract.py",
            "tests/unit/test_flip.py",
            "tests/unit/test_route_validation.py",
        ),
    ),
    Mutant(
        "packed rows' one-pass RoPE never installed (megatron-core's per-sequence loop)",
        "moe_rl/megatron/model.py",
        "    rope.install()  # packed rows' RoPE in one pass",
        "    pass  # packed rows' RoPE in one pass",
        ("tests/unit/test_packed_rope.py",),
    ),
    Mutant(
        "packed RoPE positions not restarted per sequence",
        "moe_rl/megatron/rope.py",
        "    return idx - cu[seg]",
        "    return idx",
        ("tests/unit/test_packed_rope.py", "tests/unit/test_packing.py"),
    ),
    Mutant(
        "the optimizer's foreach multi-tensor stand-ins never installed",
        "moe_rl/megatron/optim.py",
        "        use_foreach_multi_tensor()\n",
        "        pass\n",
        ("tests/unit/test_optim.py",),
    ),
    Mutant(
        "the foreach scale copies without scaling",
        "moe_rl/megatron/optim.py",
        "src if scale == 1.0 else torch._foreach_mul(src, scale)",
        "src",
        ("tests/unit/test_optim.py",),
    ),
    Mutant(
        "design (b)'s deciding stage runs without its gate",
        "studies/noise/noise.py",
        'if verdict["passed"] is not True:',
        "if False:",
        ("studies/noise/test_design.py",),
    ),
    Mutant(
        "a run's routing share the mean of its per-step shares (one flat step swings it)",
        "studies/noise/design.py",
        'gauges["ratio/routing_share"] = routing_share(arm["rl"])',
        'gauges["ratio/routing_share"] = gauges["ratio/routing_share_step_mean"]',
        ("studies/noise/test_design.py",),
    ),
    Mutant(
        "the stacked experts' SwiGLU takes the gate and up halves swapped: the policy is not the model it "
        "loads (its HF export, megatron-core's own experts)",
        "moe_rl/megatron/local_layers.py",
        "gate, lin = torch.chunk(h, 2, dim=-1)",
        "lin, gate = torch.chunk(h, 2, dim=-1)",
        ("tests/unit/test_local_layers.py",),
    ),
    Mutant(
        "the outlier-step share counts a step whose every token ratio is inside [0.5, 2]",
        "moe_rl/lab/stats.py",
        "is None else f > 0 for r in rows)",
        "is None else f >= 0 for r in rows)",
        ("tests/integration/test_compare.py", "studies/noise/test_design.py"),
    ),
    Mutant(
        "the demo's mechanism claim lets R2 sit inside the chaos null's own difference",
        "studies/noise/demo_kernels.py",
        "return all(d < -floor for d in arm)",
        "return all(d < 0 for d in arm)",
        ("studies/noise/test_demo_kernels.py",),
    ),
    # -- issue 48: ragged batches (tests/unit/test_ragged_e2e.py) ------------------------------
    Mutant(
        "every row of a ragged batch taken as long as its longest: packed forwards compute padding, "
        "metrics count it",
        "moe_rl/trainer/rl.py",
        "valid_BS = (positions_S[None, :] < (rollouts.total_lens_B[:, None] - 1)).float()",
        "valid_BS = torch.ones(tokens_BT.shape[0], s, device=tokens_BT.device)",
        ("tests/unit/test_ragged_e2e.py", "tests/integration/test_rl_e2e.py", "tests/unit/test_wiring.py"),
    ),
    Mutant(
        "flip/rollout_vs_trainer counts the engine's padding rows (zeros) against the trainer's routes",
        "moe_rl/trainer/rl.py",
        "flips = [route_flips(rollout_routes_BSLK, old_routes_BSLK, valid_BS)]",
        "flips = [route_flips(rollout_routes_BSLK, old_routes_BSLK, torch.ones_like(valid_BS))]",
        ("tests/unit/test_ragged_e2e.py", "tests/integration/test_rl_e2e.py", "tests/unit/test_wiring.py"),
    ),
    Mutant(
        "entropy/mean averaged over prompt and padding positions too",
        "moe_rl/trainer/rl.py",
        "entropy.append(torch.stack([(out.entropy_BT.detach() * mask_BT).sum(), mask_BT.sum()]))",
        "entropy.append(torch.stack([out.entropy_BT.detach().sum(), mask_BT.sum()]))",
        ("tests/unit/test_ragged_e2e.py", "tests/integration/test_rl_e2e.py"),
    ),
    Mutant(
        "mismatch/* read the engine's log-probs off the response (its padding)",
        "moe_rl/trainer/rl.py",
        "local = mismatch_metrics(old_logp_BT, rollout_logp_BT, mask_BT, num_tokens=max(num_tokens, 1.0))",
        "local = mismatch_metrics(old_logp_BT, rollout_logp_BT, torch.ones_like(mask_BT), "
        "num_tokens=max(num_tokens, 1.0))",
        ("tests/unit/test_ragged_e2e.py", "tests/integration/test_rl_e2e.py", "tests/unit/test_wiring.py"),
    ),
    Mutant(
        "the loss mask runs from the prompt's end to the padded width (rows that stopped early train on padding)",
        "moe_rl/trainer/rl.py",
        "tokens_BT, mask_BT = rollouts.tokens_BT, rollouts.response_mask_BT",
        "tokens_BT, mask_BT = rollouts.tokens_BT, (torch.arange(rollouts.tokens_BT.shape[1], "
        "device=rollouts.tokens_BT.device)[None, :] >= rollouts.prompt_lens_B[:, None]).float()",
        ("tests/unit/test_ragged_e2e.py", "tests/integration/test_rl_e2e.py", "tests/unit/test_wiring.py"),
    ),
    # -- issue 48: a fault at a write (tests/unit/test_crash_writes.py, tests/integration/test_crash_kill.py)
    Mutant(
        "a result JSON, recipe.yaml, meta.json or latest written in place: a full disk leaves it empty",
        "moe_rl/files.py",
        'tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")',
        "tmp = path",
        ("tests/unit/test_crash_writes.py", "tests/unit/test_lab_results.py"),
    ),
    Mutant(
        "a checkpoint's latest written in place: a full disk or a kill leaves it empty",
        "moe_rl/megatron/checkpoint.py",
        'write_text(root / "latest", name)',
        '(root / "latest").write_text(name)',
        (
            "tests/unit/test_crash_writes.py",
            "tests/unit/test_policy.py",
            "tests/integration/test_crash_kill.py",
        ),
    ),
    Mutant(
        "a run's recipe.yaml rewritten in place at a resume: a full disk empties it and the next compare "
        "starts the arm over, removing its checkpoints",
        "moe_rl/trainer/context.py",
        'write_text(self.out / "recipe.yaml", yaml.safe_dump(to_dict(self.recipe), sort_keys=False))',
        '(self.out / "recipe.yaml").write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))',
        ("tests/unit/test_crash_writes.py",),
    ),
    Mutant(
        "a finished arm's status.json written in place: a torn one reads as another run",
        "moe_rl/lab/runner.py",
        'write_json(done, {**st, "ended_at": time.time()}, indent=None)',
        'done.write_text(json.dumps({**st, "ended_at": time.time()}))',
        ("tests/unit/test_crash_writes.py", "tests/integration/test_lab_runner.py"),
    ),
    Mutant(
        "the readers choke on a metrics row a full disk tore: moe-rl report fails on a killed run",
        "moe_rl/trainer/metrics.py",
        "        lines.pop()\n",
        "        pass\n",
        ("tests/unit/test_crash_writes.py",),
    ),
    Mutant(
        "a torn metrics row left in place: the next attempt's first row is glued to it",
        "moe_rl/trainer/metrics.py",
        'end_torn_row(self.out_dir / "metrics.jsonl")',
        "pass",
        ("tests/unit/test_crash_writes.py",),
    ),
    Mutant(
        "an export written into its destination directly: interrupted over an earlier one, a mix of both",
        "moe_rl/megatron/hf.py",
        "with atomic_dir(out) as tmp:",
        'with (out.mkdir(parents=True, exist_ok=True) or __import__("contextlib").nullcontext(out)) as tmp:',
        ("tests/unit/test_crash_writes.py", "tests/integration/test_crash_kill.py"),
    ),
    Mutant(
        "an export killed between its two renames leaves its target set aside for good (the next export "
        "does not put it back)",
        "moe_rl/hf_io.py",
        "if aside and not out.exists() and not out.is_symlink() and not _owner_alive(aside[-1]):",
        "if False:",
        ("tests/integration/test_crash_kill.py",),
    ),
    # -- issue 48: resume equals uninterrupted (tests/unit/test_resume_knobs.py) ----------------
    Mutant(
        "a session's routing noise outlives it (SFT and the push check route with the last RL step's)",
        "moe_rl/megatron/routing.py",
        "        policy.route_choice_noise = outer\n",
        "        pass\n",
        ("tests/unit/test_resume_knobs.py", "tests/unit/test_route_noise.py"),
    ),
    Mutant(
        "the trainer's routing noise seeded once per run: a resumed run draws other noise",
        "moe_rl/trainer/rl.py",
        "run.route_noise = RouteNoise(cfg.route_noise, seed=seed)",
        "run.route_noise.sigma = cfg.route_noise",
        ("tests/unit/test_resume_knobs.py", "tests/unit/test_route_noise.py"),
    ),
    Mutant(
        "the engine's routing noise seeded by its call count: a resumed run's engine draws other noise",
        "moe_rl/rollout/embedded.py",
        "self.route_noise.reseed(noise_seed(sampling.seed, self._calls))",
        "self.route_noise.reseed(noise_seed(None, self._calls))",
        ("tests/unit/test_resume_knobs.py", "tests/unit/test_route_noise.py"),
    ),
    Mutant(
        "a resume forgets the sentinel's lowered learning rate",
        "moe_rl/trainer/loop.py",
        "run.optimizer.lr_scale = run.state.lr_scale",
        "run.optimizer.lr_scale = 1.0",
        ("tests/unit/test_resume_knobs.py", "tests/integration/test_rl_e2e.py"),
    ),
    Mutant(
        "a resume jitters the loaded weights again (train.start_jitter)",
        "moe_rl/trainer/run.py",
        "if not resumed and recipe.train.start_jitter:",
        "if recipe.train.start_jitter:",
        ("tests/unit/test_resume_knobs.py", "tests/unit/test_chaos_null.py"),
    ),
    Mutant(
        "a resumed RL run trains with SFT's optimizer (routers unfrozen, their lr multiplier gone)",
        "moe_rl/trainer/state.py",
        'self.make_optimizer(saved.stage or "sft")',
        'self.make_optimizer("sft")',
        ("tests/unit/test_resume_knobs.py", "tests/unit/test_freeze_router.py"),
    ),
    # -- the lab, the statistics, serve, the trainer's switches ----------------------------------
    Mutant(
        "compare's paired 95% interval from t with n degrees of freedom (too narrow)",
        "moe_rl/lab/stats.py",
        "half = t975(n - 1) * sd / math.sqrt(n)",
        "half = t975(n) * sd / math.sqrt(n)",
        ("tests/integration/test_compare.py", "studies/noise/test_design.py"),
    ),
    Mutant(
        "compare's sign-flip p one-sided (half the two-sided p)",
        "moe_rl/lab/stats.py",
        "hits += abs(s) >= observed",
        "hits += s >= observed",
        ("tests/integration/test_compare.py", "studies/noise/test_design.py"),
    ),
    Mutant(
        "compare pairs an arm's runs with the first arm's by position, not by seed",
        "moe_rl/lab/compare.py",
        'row["diff"] = {m: paired([per[s][m] - ref[s][m] for s in common]) for m in METRICS}',
        'row["diff"] = {m: paired([a[m] - b[m] for a, b in zip(per.values(), ref.values())]) for m in METRICS}',
        ("tests/integration/test_compare.py",),
    ),
    Mutant(
        "ratio/routing_share with the natural and replayed variances swapped",
        "moe_rl/trainer/probe.py",
        'out["ratio/routing_share"] = 1.0 - replayed / natural',
        'out["ratio/routing_share"] = 1.0 - natural / replayed',
        ("tests/unit/test_routing_share.py",),
    ),
    Mutant(
        "IcePop weights a kept token by 1 (the mask alone), not by rho",
        "moe_rl/losses/corrections.py",
        "return torch.where(keep, lr_BT.exp(), zero)",
        "return torch.where(keep, torch.ones_like(lr_BT), zero)",
        ("tests/unit/test_corrections.py", "tests/unit/test_wiring.py"),
    ),
    Mutant(
        "train.shuffle_minibatches read but not applied",
        "moe_rl/trainer/rl.py",
        "    if cfg.shuffle_minibatches:",
        "    if False:",
        ("tests/unit/test_shuffle_minibatches.py", "tests/unit/test_resume_knobs.py"),
    ),
    Mutant(
        "routing noise applied to replayed routes (R2/R3 no longer exact)",
        "moe_rl/megatron/routing.py",
        "if noise.active and action not in replayed:",
        "if noise.active:",
        ("tests/unit/test_route_noise.py",),
    ),
    Mutant(
        "the last step's weights evaluated twice (an extra held-out pass, a duplicate evaluation)",
        "moe_rl/trainer/loop.py",
        'if every and stage.steps % every == 0 and "eval/accuracy" in metrics:',
        "if False:",
        ("tests/unit/test_eval_rows.py",),
    ),
    Mutant(
        "the collapse rule reversed: a run whose reward holds counts as collapsed, the sentinel fires on it",
        "moe_rl/trainer/sentinel.py",
        "reward < drop_frac * best else 0",
        "reward > drop_frac * best else 0",
        ("tests/unit/test_collapse_criterion.py", "tests/unit/test_trainer_parts.py"),
    ),
    Mutant(
        "export --overwrite replaces a folder holding the checkpoint it reads",
        "moe_rl/outputs.py",
        "        if target == src or src.is_relative_to(target) or target.is_relative_to(src):",
        "        if target == src:",
        ("tests/badinput/test_outputs_checkpoints.py", "tests/badinput/test_nothing_lost.py"),
    ),
    Mutant(
        "serve answers a /generate over --max-total-tokens (one request can take the server's memory)",
        "moe_rl/serve/app.py",
        "        if total > lim.max_total_tokens:",
        "        if False:",
        ("tests/badinput/test_server.py",),
    ),
    Mutant(
        "serve answers a /generate of more prompts than --max-running-requests",
        "moe_rl/serve/app.py",
        "            if len(count) > self.limits.max_running_requests:",
        "            if False:",
        ("tests/badinput/test_server.py",),
    ),
)


def tree(rev: str, dest: Path) -> None:
    """The files of commit ``rev`` under ``dest`` (``git archive``)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


TIERS = {"fast": "not integration", "integration": "integration and not nightly"}
"The test tiers (conftest.py) as pytest marker expressions, in the order a mutant meets them."


def run_tests(
    copy: Path,
    tests: tuple[str, ...],
    timeout_s: float,
    tier: str | None = None,
    *,
    skip: tuple[str, ...] = (),
    first: bool = True,
) -> tuple[int, float, list[str]]:
    """pytest on ``tests`` of ``copy`` (its own ``moe_rl`` first on the path), only the tests of
    ``tier`` (:data:`TIERS`) when given, without the test ids ``skip``, stopping at the ``first``
    failure: (exit code, seconds, the failed tests' ids). Exit 5: no test of the tier in those
    files; -1: timed out."""
    present = [t for t in tests if (copy / t).exists()]
    if not present:
        return 5, 0.0, []  # no tests: nothing could kill it
    t0 = time.perf_counter()
    env = {"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": "/root"}
    args = ["-m", TIERS[tier]] if tier else []
    args += [a for test_id in skip for a in ("--deselect", test_id)]
    args += ["-x"] if first else []
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args, *present],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        code = res.returncode
        failed = [
            ln.split(" ", 1)[1].split(" - ")[0]
            for ln in res.stdout.splitlines()
            if ln.startswith(("FAILED ", "ERROR "))
        ]
    except subprocess.TimeoutExpired:
        code, failed = -1, []
    return code, time.perf_counter() - t0, failed


def baseline(copy: Path, tests: tuple[str, ...], tier: str, timeout_s: float) -> list[str]:
    """The tests of ``tier`` in ``tests`` that fail unmutated (every mutant's run leaves them out and
    the result lists them); stops when pytest itself fails (not a test)."""
    code, secs, failed = run_tests(copy, tests, timeout_s, tier, first=False)
    if code not in (0, 1, 5):
        raise SystemExit(
            f"baseline: pytest of the {tier} tier ended with exit {code} ({failed}): fix it first"
        )
    word = f"fails {len(failed)} tests, left out of every mutant's run: {failed}" if failed else "passes"
    print(f"baseline: the {tier} tier {word} ({secs:.0f} s)", flush=True)
    return failed


def try_mutant(copy: Path, m: Mutant, tiers: list[str], timeout_s: float, broken: dict) -> dict:
    """``m`` planted in ``copy``, its tests run tier by tier (less ``broken[tier]``, the baseline's
    failures) until one fails: the result row."""
    src = copy / m.path
    text = src.read_text() if src.exists() else ""
    if m.old not in text:
        return {**asdict(m), "status": "not applicable", "seconds": 0.0}
    src.write_text(text.replace(m.old, m.new, 1))
    row, runs = {**asdict(m), "status": "survived"}, []
    for tier in tiers:
        code, secs, failed = run_tests(copy, m.tests, timeout_s, tier, skip=tuple(broken[tier]))
        runs.append({"tier": tier, "exit_code": code, "seconds": round(secs, 1)})
        if code not in (0, 5):
            row.update(
                status="killed", killed_in=tier, failed=failed[0] if failed else None, timed_out=code == -1
            )
            break
    row.update(runs=runs, seconds=sum(r["seconds"] for r in runs))
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the commit whose code and tests are mutated")
    ap.add_argument("--only", nargs="*", default=None, help="mutant numbers (1-based) to run")
    ap.add_argument(
        "--tier",
        choices=["fast", "integration", "all"],
        default="all",
        help="the tests of each mutant's files to run: the fast tier, the integration tier, or the fast "
        "tier and then, for a mutant it did not kill, the integration tier (default)",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant's tests in one tier")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/...)")
    args = ap.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, capture_output=True, text=True)
    rev = rev.stdout.strip() or args.rev
    tiers = list(TIERS) if args.tier == "all" else [args.tier]
    chosen = [(i, m) for i, m in enumerate(MUTANTS, 1) if args.only is None or str(i) in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        tree(args.rev, base)
        every = tuple(dict.fromkeys(t for _, m in chosen for t in m.tests))
        broken = {tier: baseline(base, every, tier, args.timeout * 4) for tier in tiers}
        shutil.rmtree(base)
        for i, m in chosen:
            copy = Path(tmp) / f"m{i}"
            copy.mkdir()
            tree(args.rev, copy)
            row = {"number": i, **try_mutant(copy, m, tiers, args.timeout, broken)}
            shutil.rmtree(copy)
            rows.append(row)
            where = f" in the {row['killed_in']} tier by {row['failed']}" if row["status"] == "killed" else ""
            print(f"{i:>3} {row['status']:>14}{where}  {m.name}  ({row['seconds']:.0f} s)", flush=True)
    doc = {"bench": "mutate", "machine": machine(), "rev": rev, "tiers": tiers, "headline": headline(rows)}
    doc["headline"]["baseline_failures"] = sum(len(v) for v in broken.values())
    doc["baseline_failures"] = broken
    doc["mutants"] = rows
    path = Path(args.out) if args.out else RESULTS / f"mutate-{machine()}-planted-{rev}.json"
    write_json(path, doc)
    plot(rows, path.with_suffix(".png"), rev)
    print(
        f"kill ratio {doc['headline']['kill_ratio']}; survivors {doc['headline']['survivors']}; wrote {path}"
    )
    return doc


def headline(rows: list[dict]) -> dict:
    """Killed, survivors and the kill ratio of the applicable mutants, and which tier killed each."""
    applicable = [r for r in rows if r["status"] != "not applicable"]
    killed = [r for r in applicable if r["status"] == "killed"]
    return {
        "mutants": len(applicable),
        "killed": len(killed),
        "kill_ratio": len(killed) / len(applicable) if applicable else None,
        **{f"killed_in_{t}": sum(r.get("killed_in") == t for r in killed) for t in TIERS},
        "survivors": [r["name"] for r in applicable if r["status"] == "survived"],
        "not_applicable": [r["name"] for r in rows if r["status"] == "not applicable"],
    }


def plot(rows: list[dict], png: Path, rev: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def status(r: dict) -> str:
        return f"killed ({r['killed_in']} tier)" if r["status"] == "killed" else r["status"]

    colour = {
        "killed (fast tier)": "tab:green",
        "killed (integration tier)": "tab:olive",
        "survived": "tab:red",
        "not applicable": "tab:gray",
    }
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [1] * len(rows), color=[colour[status(r)] for r in rows])
    labels = [f"{r.get('number', i)}. {r['name']} ({status(r)})" for i, r in enumerate(rows, 1)]
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xticks([])
    ax.set_title(f"planted bugs against the tests at {rev}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
