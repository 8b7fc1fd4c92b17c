"""Planted bugs against the tests that should catch them: the kill ratio and the survivors.

Each mutant is one small change to the library, the kind of bug issue 34 found passing the whole
unit tier (replay wiring, correction weights, the flip instruments, retention) plus bugs in the pure
math (GSPO's length normalisation, the advantages' std, the SGLang route codec). For every mutant
the tree of a commit (``--rev``, default HEAD; ``git archive``) is copied to a temp folder, the
change applied there, and the mutant's tests run against that copy: it is *killed* when they fail,
a *survivor* when they pass. A mutant whose line the commit does not have is *not applicable*
(an older commit). The unmutated copy runs every test first: a baseline that fails stops the run.

    make mutate                                     # HEAD
    python -m tools.mutate --rev 3821f12       # the same mutants against an older commit's tests

On demand, not in CI (a few minutes). Writes ``benchmarks/results/mutate-<machine>-planted-<rev>.json`` and
``.png`` with a ``headline`` (killed, survivors, kill ratio).
"""

from __future__ import annotations

import argparse
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
        "moe_rl/trainer/rl.py",
        'replay_BSLK = recorded_BSLK if algo.routing == "r2" else rollout_routes_BSLK',
        'replay_BSLK = recorded_BSLK if algo.routing in ("r2", "r3") else rollout_routes_BSLK',
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
        "routes_BSLK=replay_BSLK, gates_BSLK=gates_BSLK, pack=pack, entropy=True",
        "routes_BSLK=replay_BSLK, gates_BSLK=None, pack=pack, entropy=True",
        ("tests/unit/test_replay_gates.py",),
    ),
    Mutant(
        "the pi_old recompute drops the engine's gates",
        "moe_rl/trainer/rl.py",
        "routes_BSLK=routes, gates_BSLK=gates, pack=pack)",
        "routes_BSLK=routes, gates_BSLK=None, pack=pack)",
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
        "the stacked experts' fused gradient add leaves DDP's hook adding each expert's gradient too",
        "moe_rl/megatron/local_layers.py",
        "w.grad_added_to_main_grad = True",
        "w.grad_added_to_main_grad = False",
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
)


def tree(rev: str, dest: Path) -> None:
    """The files of commit ``rev`` under ``dest`` (``git archive``)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def run_tests(copy: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int, float]:
    """pytest on ``tests`` of ``copy`` (its own ``moe_rl`` first on the path): (exit code, seconds)."""
    present = [t for t in tests if (copy / t).exists()]
    if not present:
        return 5, 0.0  # no tests: nothing could kill it
    t0 = time.perf_counter()
    env = {"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": "/root"}
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *present],
            cwd=copy,
            env=env,
            capture_output=True,
            timeout=timeout_s,
        )
        code = res.returncode
    except subprocess.TimeoutExpired:
        code = -1
    return code, time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the commit whose code and tests are mutated")
    ap.add_argument("--only", nargs="*", default=None, help="mutant numbers (1-based) to run")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/...)")
    args = ap.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, capture_output=True, text=True)
    rev = rev.stdout.strip() or args.rev
    chosen = [m for i, m in enumerate(MUTANTS, 1) if args.only is None or str(i) in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        tree(args.rev, base)
        every = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, secs = run_tests(base, every, args.timeout * 2)
        if code not in (0, 5):
            raise SystemExit(f"baseline: the unmutated tests fail at {rev} (exit {code}): fix them first")
        print(f"baseline at {rev}: tests pass ({secs:.0f} s)", flush=True)
        for i, m in enumerate(chosen, 1):
            copy = Path(tmp) / f"m{i}"
            copy.mkdir()
            tree(args.rev, copy)
            src = copy / m.path
            text = src.read_text() if src.exists() else ""
            if m.old not in text:
                row = {**asdict(m), "status": "not applicable", "seconds": 0.0}
            else:
                src.write_text(text.replace(m.old, m.new, 1))
                code, secs = run_tests(copy, m.tests, args.timeout)
                status = "killed" if code not in (0, 5) else "survived"
                row = {**asdict(m), "status": status, "exit_code": code, "seconds": secs}
            rows.append(row)
            print(f"{row['status']:>14}  {m.name}  ({row['seconds']:.0f} s)", flush=True)
    applicable = [r for r in rows if r["status"] != "not applicable"]
    killed = [r for r in applicable if r["status"] == "killed"]
    doc = {
        "bench": "mutate",
        "machine": machine(),
        "rev": rev,
        "headline": {
            "mutants": len(applicable),
            "killed": len(killed),
            "kill_ratio": len(killed) / len(applicable) if applicable else None,
            "survivors": [r["name"] for r in applicable if r["status"] == "survived"],
            "not_applicable": [r["name"] for r in rows if r["status"] == "not applicable"],
        },
        "mutants": rows,
    }
    path = Path(args.out) if args.out else RESULTS / f"mutate-{machine()}-planted-{rev}.json"
    write_json(path, doc)
    plot(rows, path.with_suffix(".png"), rev)
    print(
        f"kill ratio {doc['headline']['kill_ratio']}; survivors {doc['headline']['survivors']}; wrote {path}"
    )
    return doc


def plot(rows: list[dict], png: Path, rev: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colour = {"killed": "tab:green", "survived": "tab:red", "not applicable": "tab:gray"}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [1] * len(rows), color=[colour[r["status"]] for r in rows])
    ax.set_yticks(range(len(rows)), [f"{r['name']} ({r['status']})" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xticks([])
    ax.set_title(f"planted bugs against the tests at {rev}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
