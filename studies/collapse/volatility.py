"""Expert volatility: how much routing moves per optimizer step under real RL updates.

For each configuration (learning rate x depth x experts x top-k x algorithm) the policy starts
from a warm SFT checkpoint of its architecture (trained once, cached by ``moe_rl.lab.starts``),
then runs ``rl_steps`` real RL steps of the trainer (rollouts, rewards, group advantages, pi_old
recompute, M minibatch updates: ``moe_rl.trainer.rl.rl_step`` on a run derived for the
configuration, ``Run.derive``). A hook after each optimizer step (``Run.add_hook``) computes,
after every one of the M updates, the natural top-k routes of ``probe`` rollout sequences of that
batch (docs/algorithms.md#expert-flip-rate), giving:

- the **per-step flip rate** (routes just before vs just after each update), overall, per
  minibatch index j, per layer, and the token any-flip rate;
- the **drift vs pi_old** after update j = 1..M (the routes the batch was sampled with).

Adam's first updates (bias correction makes them about +-lr on every parameter) move the
routes about twice as much as the later ones, so the headline numbers (``flip_step``,
``flip_step_by_j``, ``drift_*``) leave the first rollout batch out; ``flip_step_all`` and
``flip_step_by_rl_step`` keep it.

Sweeps: GRPO over depth x LR (the headline figure: flip rate vs depth, one line per LR),
GRPO + R2 and GSPO over LR at the reference shape, and experts / top-k over LR. A log-log fit
of the depth trend says where the ~10% per step of the GSPO paper's 48-layer Qwen3-30B-A3B
falls on these curves (``where_10pct`` in the JSON).

    python -m studies.collapse.volatility --preset smoke|cpu|gpu [--out FILE.json] [--cache DIR]

Writes studies/collapse/results/volatility-<machine>-<preset>-<commit>.json and .png.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.files import read_json
from moe_rl.lab.arms import ARMS, DEMO, flatten
from moe_rl.lab.results import commit, machine, result_path, write_json
from moe_rl.lab.runner import cpu_seconds
from moe_rl.lab.starts import CACHE, SMOKE_BASE, warm_start
from moe_rl.lab.stats import lstsq, mean
from moe_rl.trainer.hooks import OptimizerStep, StepHook
from studies.collapse import RESULTS

if TYPE_CHECKING:
    from moe_rl.config import Recipe
    from moe_rl.trainer.context import Run
    from moe_rl.trainer.rl import RLBatch

log = logging.getLogger("studies.collapse.volatility")
PAPER = {"layers": 48, "experts": 128, "topk": 8, "flip_per_step": 0.10}
"Qwen3-30B-A3B as the GSPO paper reports it: about 10% of activated experts change per step."

PRESETS = {
    "smoke": {
        "base": SMOKE_BASE,
        "ref": (2, 4, 2),
        "depths": [1, 2],
        "experts": [4, 8],
        "topks": [2, 3],
        "lrs": [1e-4, 1e-3],
        "algos": ["GRPO", "GRPO+R2", "GSPO"],
        "rl_steps": 2,
        "probe": 4,
    },
    # the demo policy (hidden 128, 8 experts top-2): its 4-layer SFT start is runs/demo/sft
    "cpu": {
        "base": {"train": {"prompts_per_step": 8, "group_size": 8, "minibatches": 4, "max_new_tokens": 48}},
        "ref": (4, 8, 2),
        "depths": [2, 4, 8, 16],
        "experts": [4, 8, 16, 32],
        "topks": [2, 4],
        "lrs": [3e-5, 1e-4, 3e-4, 1e-3],
        "algos": ["GRPO", "GRPO+R2", "GSPO"],
        "rl_steps": 5,
        "probe": 32,
    },
    # one H100: twice the width, depth to 32, up to 128 experts (untested on this machine)
    "gpu": {
        "base": {
            "model": {"hidden_size": 256, "head_dim": 64, "moe_ffn_hidden_size": 256},
            "train": {
                "sft_steps": 400,
                "sft_batch_size": 64,
                "prompts_per_step": 16,
                "group_size": 8,
                "minibatches": 4,
                "max_new_tokens": 48,
            },
        },
        "ref": (8, 32, 4),
        "depths": [2, 4, 8, 16, 32],
        "experts": [8, 32, 128],
        "topks": [2, 4, 8],
        "lrs": [1e-5, 3e-5, 1e-4, 3e-4, 1e-3],
        "algos": ["GRPO", "GRPO+R2", "GSPO"],
        "rl_steps": 4,
        "probe": 64,
    },
}


@dataclass(frozen=True)
class Config:
    """One measured point of a sweep."""

    group: str  # depth | algo | experts | topk
    algo: str
    layers: int
    experts: int
    topk: int
    lr: float

    @property
    def arch(self) -> tuple[int, int, int]:
        return (self.layers, self.experts, self.topk)

    @property
    def name(self) -> str:
        return f"{self.algo}-L{self.layers}-E{self.experts}-K{self.topk}-lr{self.lr:g}"


def sweep(p: dict) -> list[Config]:
    """The configurations of a preset, grouped by architecture (one SFT start each)."""
    rl, re_, rk = p["ref"]
    out = [Config("depth", "GRPO", n, re_, rk, lr) for n in p["depths"] for lr in p["lrs"]]
    out += [Config("algo", a, rl, re_, rk, lr) for a in p["algos"] if a != "GRPO" for lr in p["lrs"]]
    out += [Config("experts", "GRPO", rl, e, rk, lr) for e in p["experts"] if e != re_ for lr in p["lrs"]]
    out += [Config("topk", "GRPO", rl, re_, k, lr) for k in p["topks"] if k != rk for lr in p["lrs"]]
    return sorted(out, key=lambda c: c.arch)


def arch_overrides(p: dict, arch: tuple[int, int, int]) -> list[str]:
    n, e, k = arch
    return flatten(p["base"]) + flatten({"model": {"num_layers": n, "num_experts": e, "moe_router_topk": k}})


# -- measurement ---------------------------------------------------------------------------------
@dataclass
class StepProbe(StepHook):
    """A hook after each optimizer step: the natural routes of the first ``rows`` rows of the
    batch against the previous step's (per-step flip) and against pi_old's (drift)."""

    rows: int
    records: list = field(default_factory=list)

    def begin(self, run: Run, step: int, batch: RLBatch) -> None:
        self.tokens = batch.tokens_BT[: self.rows]
        self.valid = batch.valid_BS[: self.rows].reshape(-1)
        self.base = self.prev = self._routes(run)

    def _routes(self, run: Run):
        from moe_rl.trainer.rl import natural_routes

        routes_BSLK = natural_routes(run, self.tokens)
        return routes_BSLK.reshape(-1, *routes_BSLK.shape[2:])

    def __call__(self, event: OptimizerStep) -> None:
        from moe_rl.routing.flip import flip_counts

        now = self._routes(event.run)
        self.records.append(
            {
                "rl_step": event.step,
                "j": event.minibatch + 1,
                "step": flip_counts(self.prev, now, self.valid),
                "drift": flip_counts(self.base, now, self.valid),
            }
        )
        self.prev = now


def rates(counts: list[dict]) -> dict:
    """Summed flip counts as ``{"rate", "token_any", "layers"}``."""
    from moe_rl.routing.flip import flip_metrics

    if not counts:
        return {"rate": math.nan, "token_any": math.nan, "layers": []}
    tot = {k: sum(c[k] for c in counts) for k in counts[0]}
    m = flip_metrics(tot, "f")
    n = len(tot["flip_sum_L"])
    return {
        "rate": m["f/rate"],
        "token_any": m["f/token_any"],
        "layers": [m[f"f/layer_{i}"] for i in range(n)],
    }


TRAINER_KEYS = (
    "reward/mean",
    "reward/accuracy",
    "response/len_mean",
    "flip/drift/rate",
    "clip/token_frac",
    "clip/seq_frac",
    "clip/token_frac_of_clipped_seqs",
    "ratio/seq_log_sum_min",
    "ratio/seq_log_sum_max",
    "grad_norm",
    "entropy/mean",
)


def measure(run: Run, recipe: Recipe, ckpt: Path, rl_steps: int, probe_rows: int) -> dict:
    """``rl_steps`` real RL steps of ``recipe`` from ``ckpt`` on ``run``; flip records summarised."""
    from moe_rl.megatron.checkpoint import load_checkpoint
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.timer import StepTimer

    load_checkpoint(ckpt, run.policy.model, load_rng=False)
    # same policy, this configuration's algo / optim / train, Adam from scratch
    measured = run.derive(recipe=recipe, new_optimizer=True)
    probe = measured.add_hook(StepProbe(probe_rows))
    trainer = [rl_step(measured, step, StepTimer()).metrics for step in range(rl_steps)]
    mcount = recipe.train.minibatches
    # Adam's first updates (bias-corrected to about +-lr per parameter) move the routes about
    # twice as much as later ones: the headline numbers leave the first rollout batch out
    recs = [x for x in probe.records if x["rl_step"] >= 1] or probe.records
    last = [x["drift"] for x in recs if x["j"] == mcount]
    return {
        "flip_step": rates([x["step"] for x in recs]),
        "flip_step_all": rates([x["step"] for x in probe.records]),
        "flip_step_by_j": [
            rates([x["step"] for x in recs if x["j"] == j])["rate"] for j in range(1, mcount + 1)
        ],
        "flip_step_by_rl_step": [
            rates([x["step"] for x in probe.records if x["rl_step"] == s])["rate"] for s in range(rl_steps)
        ],
        "drift_by_j": [
            rates([x["drift"] for x in recs if x["j"] == j])["rate"] for j in range(1, mcount + 1)
        ],
        "drift_last": rates(last),
        "trainer": {k: mean(step_metrics.get(k) for step_metrics in trainer) for k in TRAINER_KEYS},
    }


def run_sweep(p: dict, cache: Path) -> tuple[list[dict], dict]:
    """Every configuration of preset ``p``; returns the results and the SFT starts used."""
    from moe_rl.config import load_recipe
    from moe_rl.lab.runner import ensure_parallel
    from moe_rl.trainer.run import Run

    ensure_parallel()
    results, starts = [], {}
    by_arch: dict[tuple, list[Config]] = {}
    for c in sweep(p):
        by_arch.setdefault(c.arch, []).append(c)
    for arch, cfgs in by_arch.items():
        ov = arch_overrides(p, arch)
        ckpt, info = warm_start(DEMO, ov, cache=cache)
        starts["L{}-E{}-K{}".format(*arch)] = {k: v for k, v in info.items() if k != "signature"}
        common = [
            *ov,
            "train.stages=[rl]",
            f"train.out_dir={cache / 'volatility_runs' / ckpt.parent.name}",
            "train.flip_probe_sequences=0",
        ]
        run = Run(load_recipe(DEMO, common))
        run.ensure_engine()
        try:
            for c in cfgs:
                t0 = time.perf_counter()
                recipe = load_recipe(DEMO, [*common, *flatten(ARMS[c.algo]), f"optim.lr={c.lr}"])
                res = measure(run, recipe, ckpt, p["rl_steps"], p["probe"])
                res.update(
                    name=c.name,
                    group=c.group,
                    algo=c.algo,
                    layers=c.layers,
                    experts=c.experts,
                    topk=c.topk,
                    lr=c.lr,
                    wall_s=time.perf_counter() - t0,
                )
                log.info(
                    "%-32s flip/step %.4f drift(M) %.4f reward %.3f (%.1fs)",
                    c.name,
                    res["flip_step"]["rate"],
                    res["drift_by_j"][-1],
                    res["trainer"]["reward/mean"],
                    res["wall_s"],
                )
                results.append(res)
        finally:
            run.close()
    return results, starts


# -- where 10% falls -----------------------------------------------------------------------------
def analyse(results: list[dict], p: dict) -> dict:
    """Log-log fits of per-step flip rate vs depth (per LR and jointly with LR); where 10% falls."""
    rl, re_, rk = p["ref"]
    depth = [x for x in results if x["algo"] == "GRPO" and x["experts"] == re_ and x["topk"] == rk]
    pts = [(x["layers"], x["lr"], x["flip_step"]["rate"]) for x in depth if x["flip_step"]["rate"] > 0]
    out: dict = {"per_lr": {}}
    for lr in p["lrs"]:
        xs = [(n, v) for n, a, v in pts if a == lr]
        if len({n for n, _ in xs}) >= 2:
            c, s = lstsq([[1.0, math.log(n)] for n, _ in xs], [math.log(v) for _, v in xs])
            out["per_lr"][f"{lr:g}"] = {
                "depth_exponent": s,
                "at_48_layers": math.exp(c + s * math.log(48)),
                "measured": {str(n): v for n, v in xs},
            }
    if len({n for n, _, _ in pts}) >= 2 and len({a for _, a, _ in pts}) >= 2:
        c, s, q = lstsq([[1.0, math.log(n), math.log(a)] for n, a, _ in pts], [math.log(v) for *_, v in pts])
        lr10 = math.exp((math.log(PAPER["flip_per_step"]) - c - s * math.log(PAPER["layers"])) / q)
        out["joint"] = {
            "log_rate": "c + a*log(layers) + b*log(lr)",
            "c": c,
            "a_depth": s,
            "b_lr": q,
            "lr_for_10pct_at_48_layers": lr10,
            "layers_for_10pct_at_lr": {
                f"{lr:g}": math.exp((math.log(0.1) - c - q * math.log(lr)) / s) for lr in p["lrs"]
            },
        }
    ratios = []
    for x in results:  # sparsity: the most experts at the reference top-k vs the reference shape
        if x["group"] == "experts" and x["experts"] == max(p["experts"]):
            ref = [y for y in depth if y["layers"] == rl and y["lr"] == x["lr"]]
            if ref and ref[0]["flip_step"]["rate"] > 0:
                ratios.append(x["flip_step"]["rate"] / ref[0]["flip_step"]["rate"])
    if ratios:
        out["sparsity_factor"] = {
            "experts": max(p["experts"]),
            "topk": rk,
            "vs_experts": re_,
            "mean_ratio": mean(ratios),
        }
    first = [
        x["flip_step_by_rl_step"][0] / x["flip_step"]["rate"]
        for x in results
        if len(x["flip_step_by_rl_step"]) > 1 and x["flip_step"]["rate"] > 0
    ]
    out["first_batch_factor"] = mean(first)
    prof = [
        x["flip_step"]["layers"][-1] / x["flip_step"]["layers"][0]
        for x in depth
        if x["layers"] >= 4 and x["flip_step"]["layers"][0] > 0
    ]
    out["last_over_first_layer"] = mean(prof)
    out["token_any"] = {
        f"{lr:g}": {str(x["layers"]): x["flip_step"]["token_any"] for x in depth if x["lr"] == lr}
        for lr in p["lrs"]
    }
    out["text"] = ten_percent_text(out, p)
    return out


def ten_percent_text(fit: dict, p: dict) -> str:
    """The fit in words, with its caveats."""
    rl, re_, rk = p["ref"]
    lines = []
    for lr, f in fit["per_lr"].items():
        lines.append(
            f"lr {lr}: flip/step ~ layers^{f['depth_exponent']:.2f}, extrapolated to 48 layers "
            f"{100 * f['at_48_layers']:.2f}% (measured {', '.join(f'L{n} {100 * v:.2f}%' for n, v in f['measured'].items())})"
        )
    j = fit.get("joint")
    if j:
        lines.append(
            f"joint fit: flip/step ~ layers^{j['a_depth']:.2f} x lr^{j['b_lr']:.2f}; 10% per step at "
            f"48 layers needs lr ~ {j['lr_for_10pct_at_48_layers']:.2g} on this policy (E{re_} K{rk})"
        )
        if j["a_depth"] > 0.05:
            lines.append(
                "depth for 10% per step at each LR: "
                + ", ".join(
                    f"lr {lr} -> " + (f"{n:.3g} layers" if n < 1e4 else "out of reach (> 10^4 layers)")
                    for lr, n in j["layers_for_10pct_at_lr"].items()
                )
            )
        else:
            lines.append("the flip rate does not grow with depth here: depth alone does not reach 10%")
    s = fit.get("sparsity_factor")
    if s:
        lines.append(
            f"{s['experts']} experts top-{s['topk']} (K/E = 1/{s['experts'] // s['topk']}; Qwen3-30B-A3B: "
            f"8/128 = 1/16) flips {s['mean_ratio']:.2f}x as much per step as {s['vs_experts']} experts "
            "at the same depth and LR (mean over the LRs)."
        )
    if fit.get("last_over_first_layer") == fit.get("last_over_first_layer"):
        lines.append(
            f"per layer: the last MoE layer flips {fit['last_over_first_layer']:.1f}x as much as the first "
            "(mean over depths >= 4 and LRs), so the layer mean grows slowly with depth while the share of "
            "tokens with any expert change grows fast: "
            + "; ".join(
                f"lr {lr}: " + ", ".join(f"L{n} {100 * v:.0f}%" for n, v in d.items())
                for lr, d in fit["token_any"].items()
            )
        )
    if fit.get("first_batch_factor") == fit.get("first_batch_factor"):
        lines.append(
            f"Adam's first rollout batch flips {fit['first_batch_factor']:.1f}x the later per-step rate "
            "(left out of the numbers above)."
        )
    lines.append(
        "Caveats: a tiny policy (hidden width, vocabulary, task) far from Qwen3-30B-A3B; the 48-layer "
        "numbers extrapolate a log-log depth trend beyond the deepest model measured; learning rates "
        "do not transfer across model scale, so the LR that gives 10% here says how large an update "
        "it takes, not what the paper used."
    )
    return "\n".join(lines)


# -- plot ----------------------------------------------------------------------------------------
def plot(results: list[dict], fit: dict, p: dict, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl, re_, rk = p["ref"]
    cmap = plt.get_cmap("plasma")
    lrs = p["lrs"]
    col = {lr: cmap(0.85 * i / max(1, len(lrs) - 1)) for i, lr in enumerate(lrs)}
    depth = [x for x in results if x["group"] == "depth"]
    fig, ax = plt.subplots(2, 3, figsize=(17, 9.5))
    a = ax[0, 0]
    for lr in lrs:
        xs = sorted((x["layers"], x["flip_step"]["rate"]) for x in depth if x["lr"] == lr)
        a.plot([n for n, _ in xs], [100 * v for _, v in xs], "o-", color=col[lr], label=f"lr {lr:g}")
        f = fit["per_lr"].get(f"{lr:g}")
        if f:  # the fitted power law from the shallowest model to 48 layers
            n0, e = min(n for n, _ in xs), f["depth_exponent"]
            ns = [n0 * (48 / n0) ** (i / 20) for i in range(21)]
            a.plot(ns, [100 * f["at_48_layers"] * (n / 48) ** e for n in ns], "--", color=col[lr], alpha=0.6)
    a.axhline(10, color="red", lw=1, ls=":", label="~10%/step (GSPO paper, 48 layers)")
    a.axvline(48, color="gray", lw=1, ls=":")
    a.set(
        xscale="log",
        yscale="log",
        xlabel="MoE layers",
        ylabel="flip rate per optimizer step (%)",
        title=f"GRPO flip/step vs depth (E{re_} K{rk}); dashed: log-log extrapolation",
    )
    a.legend(fontsize=8)
    a = ax[0, 1]
    mid = lrs[len(lrs) // 2]
    for n in sorted({x["layers"] for x in depth}):
        x = [y for y in depth if y["layers"] == n and y["lr"] == mid]
        if x:
            ls = x[0]["flip_step"]["layers"]
            a.plot([(i + 0.5) / n for i in range(n)], [100 * v for v in ls], "o-", ms=3, label=f"{n} layers")
    a.set(
        xlabel="relative depth of the layer ((i + 0.5) / layers)",
        ylabel="flip rate per step (%)",
        title=f"per-layer profile, GRPO, lr {mid:g}",
    )
    a.legend(fontsize=8)
    a = ax[0, 2]
    for lr in lrs:
        xs = sorted((x["layers"], x["flip_step"]["token_any"]) for x in depth if x["lr"] == lr)
        a.plot([n for n, _ in xs], [100 * v for _, v in xs], "s-", color=col[lr], label=f"lr {lr:g}")
    a.set(
        xscale="log",
        xlabel="MoE layers",
        ylabel="tokens with any expert change (%)",
        title="token any-flip rate per step, GRPO",
    )
    a.legend(fontsize=8)
    ref = [x for x in results if x["layers"] == rl and x["experts"] == re_ and x["topk"] == rk]
    a = ax[1, 0]
    styles = {"GRPO": "-", "GRPO+R2": "--", "GSPO": ":"}
    for x in ref:
        if x["lr"] in (lrs[0], mid, lrs[-1]):
            j = range(1, len(x["drift_by_j"]) + 1)
            a.plot(
                j,
                [100 * v for v in x["drift_by_j"]],
                "o",
                ls=styles.get(x["algo"], "-."),
                color=col[x["lr"]],
                label=f"{x['algo']} lr {x['lr']:g}",
            )
    a.set(
        xlabel="minibatch update j within the rollout batch",
        ylabel="drift vs pi_old (%)",
        yscale="log",
        title=f"routes vs pi_old after j updates (L{rl} E{re_} K{rk})",
    )
    a.legend(fontsize=7, ncol=2)
    a = ax[1, 1]
    for algo in p["algos"]:
        xs = sorted((x["lr"], x["flip_step"]["rate"]) for x in ref if x["algo"] == algo)
        a.plot([v for v, _ in xs], [100 * y for _, y in xs], "o", ls=styles.get(algo, "-."), label=algo)
    a.set(
        xscale="log",
        yscale="log",
        xlabel="learning rate",
        ylabel="flip rate per step (%)",
        title=f"algorithms (L{rl} E{re_} K{rk})",
    )
    a.legend(fontsize=8)
    a = ax[1, 2]
    for key, group, fixed in (("experts", "experts", f"top-{rk}"), ("topk", "topk", f"{re_} experts")):
        for lr in (lrs[0], lrs[-1]):
            pts = [
                (x[key], x["flip_step"]["rate"])
                for x in results
                if x["algo"] == "GRPO"
                and x["layers"] == rl
                and x["lr"] == lr
                and (x["group"] == group or (x["experts"] == re_ and x["topk"] == rk))
            ]
            pts = sorted(set(pts))
            a.plot(
                [v for v, _ in pts],
                [100 * y for _, y in pts],
                "o-" if key == "experts" else "s--",
                color=col[lr],
                label=f"vs {key} ({fixed}), lr {lr:g}",
            )
    a.set_xscale("log", base=2)
    a.set(
        yscale="log",
        xlabel="experts (o) / top-k (s)",
        ylabel="flip rate per step (%)",
        title=f"routing shape, GRPO, {rl} layers",
    )
    a.legend(fontsize=7)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    depths = sorted({x["layers"] for x in depth})
    for a, ticks in ((ax[0, 0], [*depths, 48]), (ax[0, 2], depths)):
        a.set_xticks(ticks)
        a.xaxis.set_major_formatter(ScalarFormatter())
        a.xaxis.set_minor_formatter(NullFormatter())
    for a in ax.flat:
        a.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m studies.collapse.volatility", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--preset", default="cpu", choices=PRESETS)
    ap.add_argument("--out", default=None, help="result JSON (default: the study's results/); PNG beside it")
    ap.add_argument("--cache", default=str(CACHE), help="SFT start cache directory")
    ap.add_argument(
        "--replot", default=None, metavar="JSON", help="redo the fits and the plot of a result file"
    )
    args = ap.parse_args(argv)
    if args.replot:
        path = Path(args.replot)
        doc = read_json(path)
        p = {**PRESETS[doc["preset"]], **doc["settings"], "ref": tuple(doc["settings"]["ref"])}
        doc["where_10pct"] = analyse(doc["configs"], p)
        plot(doc["configs"], doc["where_10pct"], p, path.with_suffix(".png"))
        write_json(path, doc)
        print(doc["where_10pct"]["text"])
        return doc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    p = PRESETS[args.preset]
    t0, c0 = time.perf_counter(), cpu_seconds()
    results, starts = run_sweep(p, Path(args.cache))
    fit = analyse(results, p)
    path = result_path("volatility", args.preset, args.out, folder=RESULTS)
    png = plot(results, fit, p, path.with_suffix(".png"))
    doc = {
        "bench": "volatility",
        "preset": args.preset,
        "machine": machine(),
        "commit": commit(),
        "wall_s": time.perf_counter() - t0,
        "cpu_s": cpu_seconds() - c0,
        "settings": {k: v for k, v in p.items()},
        "paper": PAPER,
        "sft_starts": starts,
        "where_10pct": fit,
        "configs": results,
        "plot": png.name,
    }
    write_json(path, doc)
    print(fit["text"])
    print(f"wrote {path} and {png} in {doc['wall_s']:.0f}s")
    return doc


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
