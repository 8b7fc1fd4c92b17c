"""The reporting half of benchmarks/throughput.py: TRL ratios, the matmul floor, world-size
scaling, the PNG and the text table (pure functions of measured records)."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

PHASES = ("rollout", "old_logprob", "train", "probe", "sync", "sync_hf", "step")


def trl_ratio(ours: dict, peer: dict) -> dict:
    """moe-rl (gspo, no replay) over TRL: response tokens per second of a whole RL step."""
    ph = ours["phases"]
    ours_s, ours_cpu = ph["step"]["s"], ph["step"]["cpu_s"]
    med = peer["median"]
    out = {
        "moe_rl_tokens_per_s": ours["tokens"] / ours_s,
        "trl_tokens_per_s": med["tokens"] / med["step_s"],
        "moe_rl_tokens_per_cpu_s": ours["tokens"] / ours_cpu,
        "trl_tokens_per_cpu_s": med["tokens"] / med["step_cpu_s"],
        "moe_rl_tokens_per_step": ours["tokens"],
        "trl_tokens_per_step": med["tokens"],
    }
    out["ratio_wall"] = out["moe_rl_tokens_per_s"] / out["trl_tokens_per_s"]
    out["ratio_cpu"] = out["moe_rl_tokens_per_cpu_s"] / out["trl_tokens_per_cpu_s"]
    # CPU seconds / wall seconds of a step: below ~0.9 (one thread) other jobs took the cores
    out["cpu_utilisation"] = {"moe_rl": ours_cpu / ours_s, "trl": med["step_cpu_s"] / med["step_s"]}
    out["wall_ratio_reliable"] = min(out["cpu_utilisation"].values()) > 0.9
    no_probe = ours_cpu - ph["probe"]["cpu_s"]
    out["ratio_cpu_without_flip_probe"] = (ours["tokens"] / no_probe) / out["trl_tokens_per_cpu_s"]
    out["seconds_per_step"] = {
        "moe_rl": {p: ph[p]["s"] for p in ("rollout", "old_logprob", "train", "probe", "sync")},
        "trl": {"rollout": med["rollout_s"], "old_logprob": med["old_logprob_s"], "train": med["train_s"]},
    }
    out["cpu_seconds_per_step"] = {
        "moe_rl": {p: ph[p]["cpu_s"] for p in ("rollout", "old_logprob", "train", "probe", "sync")},
        "trl": {
            "rollout": med["rollout_cpu_s"],
            "old_logprob": med["old_logprob_cpu_s"],
            "train": med["train_cpu_s"],
        },
    }
    return out


def matmul_peak_flops(threads: int, device: str) -> dict:
    """The best fp32 matmul rate this process reaches (square-ish GEMMs, best of the sizes)."""
    from benchmarks.common import gemm_rate

    shapes = ((1024, 512, 2048), (2048, 1024, 2048), (4096, 2048, 4096))
    return {**gemm_rate(device, torch.float32, shapes, reps=5 if device == "cpu" else 50), "threads": threads}


def forward_flops_per_position(dims: dict, vocab: int, context: float) -> float:
    """Matmul FLOPs of one token's forward through the policy (attending to ``context`` keys)."""
    h, layers, heads, groups, hd = (
        dims[k] for k in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim")
    )
    f, e, k = dims["moe_ffn_hidden_size"], dims["num_experts"], dims["moe_router_topk"]
    per_layer = (
        2 * h * (heads + 2 * groups) * hd  # QKV
        + 2 * heads * hd * h  # output projection
        + 2 * 2 * heads * hd * context  # QK^T and PV
        + 2 * h * e  # router
        + k * 2 * 3 * h * f
    )  # top-k SwiGLU experts (fc1 is 2F wide, fc2 F -> H)
    return layers * per_layer + 2 * h * vocab


STEP_FORWARDS = 5
"""Forwards of every position in one RL step: the rollout's, pi_old's, and training's forward and
backward (3x)."""


def step_floor(combo: dict, dims: dict, vocab: int, peak: dict, peer_median: dict | None) -> dict:
    """The step's matmul work at the measured matmul peak: the fastest any framework could run it.

    Work of one RL step without padding, flip probes or recomputation: every position of every
    sequence forwarded once by the rollout, once for pi_old, and forward + backward (3x) in
    training: 5 forwards. Attention context: half the mean sequence length (causal).
    """
    positions = combo["positions"]
    seqs = combo.get("sequences") or 1
    per = forward_flops_per_position(dims, vocab, context=0.5 * positions / seqs)
    flops = STEP_FORWARDS * positions * per
    floor_s = flops / peak["flops_per_s"]
    out = {
        "positions": positions,
        "forward_flops_per_position": per,
        "step_flops": flops,
        "floor_s": floor_s,
        "moe_rl_step_s_over_floor": combo["phases"]["step"]["cpu_s"] / floor_s,
    }
    if peer_median:  # also the highest moe-rl/TRL ratio that equal work at this peak allows
        out["trl_step_s_over_floor"] = peer_median["step_cpu_s"] / floor_s
    return out


def own_gemms_vs_floor(own: dict, combo: dict, floor: dict) -> dict:
    """The step's own GEMMs timed alone (``benchmarks.gemm_floor``; warm: inputs left in cache by
    the previous repeat, cold: flushed first) against the step and its FLOP floor."""
    step = combo["phases"]["step"]["cpu_s"]
    out = {}
    for k in ("warm", "cold"):
        s = own[k]["gemm_cpu_s"]
        out[k] = {"gemm_cpu_s": s, "over_flop_floor": s / floor["floor_s"], "step_over_gemms": step / s}
    return out


REPLAY_PHASES = {"r2": ("old_logprob", "train", "probe"), "r3": ("rollout", "old_logprob", "train", "probe")}
"""The step phases each replay mode changes. R2 asks the engine for nothing more than routing none
does (same prompts, sampling, no routes), so its rollout is the same computation and only adds
noise to a difference; R3's rollout also returns the engine's routes."""


def paired_probe_fracs(cpu: dict[str, list[float]]) -> list[float]:
    """Per timed step: the flip probes' CPU seconds over that step's (``cpu``: phase -> per-step)."""
    return [pr / st for pr, st in zip(cpu["probe"], cpu["step"], strict=True)]


def paired_replay_overheads(
    none: dict[str, list[float]], mode_cpu: dict[str, list[float]], mode: str
) -> list[float]:
    """Per timed step index: the CPU seconds routing ``mode`` added in the phases it changes
    (:data:`REPLAY_PHASES`), over that step's CPU seconds under routing none. The two steps of an
    index share prompts and sampling seeds and ran one after the other, so machine noise that
    drifts over minutes cancels in the pair (``none``/``mode_cpu``: phase -> per-step CPU s)."""
    n = len(none["step"])
    if len(mode_cpu["step"]) != n:
        raise ValueError(
            f"{len(mode_cpu['step'])} steps of {mode} against {n} of routing none: pair equal counts"
        )
    return [sum(mode_cpu[p][i] - none[p][i] for p in REPLAY_PHASES[mode]) / none["step"][i] for i in range(n)]


def paired_replay_by_combo(combos: dict) -> dict[str, list[float]]:
    """:func:`paired_replay_overheads` of every replay combo (``algo/r2``, ``algo/r3``) against its
    algorithm's routing-none combo, both from one run's per-step CPU seconds."""
    out = {}
    for name, c in combos.items():
        algo, _, mode = name.partition("/")
        if mode in REPLAY_PHASES and f"{algo}/none" in combos:
            none = combos[f"{algo}/none"]["cpu_s_per_step"]
            out[name] = paired_replay_overheads(none, c["cpu_s_per_step"], mode)
    return out


def headline(res: dict) -> dict:
    """The figures issue 17 asks for, from one run (None where the run did not measure them).

    moe_rl_over_trl_*: tokens per CPU second of the whole step (flip probes on, GSPO, routing
    none) over TRL's, same model, weights, prompts, G and batch, 1 thread each: the median over
    the paired rounds where the run has them (``trl_rounds`` of benchmarks/throughput.py, each on a
    prompt stream of its own; else the one comparison of the run), ``moe_rl_over_trl_range`` the
    rounds' lowest and highest (for 5 rounds, a 94% interval for the median),
    ``moe_rl_over_trl_tokens`` the median of the rounds' response tokens, moe-rl's over TRL's: the
    two sides sample their own responses, and a side that drew more tokens spreads a step's fixed
    costs over more of them (1.0: equal work). probe_frac: the flip
    probes' (and the routing share's) share of the step's CPU
    seconds (small model, gspo/none, median of the per-step shares of the run's timed steps and of
    its rounds', ``probe_frac_range`` their lowest and highest; ``probe_frac_max`` the highest
    median over every combo and model of the run). replay_overhead:
    the CPU seconds R2 / R3 add to the phases they change, over the step's CPU seconds under
    routing none, paired by step index (:func:`paired_replay_overheads`; small model; median over
    the algorithms' steps; the larger of the two modes). floor_multiple_*: the step's CPU
    seconds over its matmul floor. own_gemms_small: the small step's own GEMMs, each timed alone
    at its shapes (warm and cache-flushed), over that floor and under the step
    (:func:`own_gemms_vs_floor`). padding_share_removed: the share of a padded batch's input
    positions that packing does not compute (gspo/none rollouts of each model). probe_work_share:
    the probes' share of the step's forward work counted in input positions (small model,
    gspo/none): the positions their forwards feed the model over those plus the step's own five
    forwards of every position (:func:`step_floor`); the probe_frac a step would show if every
    position of every forward cost the same CPU time; per step, pooled and summarised as
    probe_frac (``probe_work_share_range``). The probe rows are the batch's first, so both shares
    follow how long the first prompt group's rows are in the steps timed.
    """
    models, trl = res.get("models", {}), res.get("trl", {})

    compared = {n: [r for r in t.get("rounds", []) if r.get("ratio_cpu")] for n, t in trl.items()}
    rounds = {n: [r["ratio_cpu"] for r in rs] for n, rs in compared.items()}
    token_ratios = {n: [r["moe_rl_tokens"] / r["trl_tokens"] for r in rs] for n, rs in compared.items()}

    def ratio(name):
        if rounds.get(name):
            return statistics.median(rounds[name])
        vs = trl.get(name, {}).get("vs")
        return vs["ratio_cpu"] if vs else None

    def probe(c):
        return statistics.median(paired_probe_fracs(c["cpu_s_per_step"]))

    def probe_fracs(name):  # the run's timed steps and every round's
        pooled = paired_probe_fracs(models[name]["combos"]["gspo/none"]["cpu_s_per_step"])
        for r in trl.get(name, {}).get("rounds", []):
            if "moe_rl_cpu_s_per_step" in r:
                pooled += paired_probe_fracs(r["moe_rl_cpu_s_per_step"])
        return pooled

    def probe_works(name):  # per step, pooled as probe_fracs (medians where a run kept no steps)
        c = models[name]["combos"]["gspo/none"]
        if "probe_positions" not in c:
            return []
        kept = [c.get("positions_per_step", {k: [c[k]] for k in ("positions", "probe_positions")})]
        kept += [
            r["moe_rl_positions_per_step"]
            for r in trl.get(name, {}).get("rounds", [])
            if "moe_rl_positions_per_step" in r
        ]
        return [
            pr / (STEP_FORWARDS * po + pr)
            for k in kept
            for po, pr in zip(k["positions"], k["probe_positions"], strict=True)
        ]

    def replay(name, mode):
        paired = paired_replay_by_combo(models[name]["combos"])
        r = [x for combo, xs in paired.items() if combo.endswith(f"/{mode}") for x in xs]
        return statistics.median(r) if r else None

    small = "small" if "small" in models else None
    fracs = probe_fracs(small) if small else []
    works = probe_works(small) if small else []
    out = {
        "moe_rl_over_trl_tiny": ratio("tiny"),
        "moe_rl_over_trl_small": ratio("small"),
        "moe_rl_over_trl_range": {n: [min(r), max(r)] for n, r in rounds.items() if r},
        "moe_rl_over_trl_tokens": {n: statistics.median(r) for n, r in token_ratios.items() if r},
        "trl_rounds": {n: len(r) for n, r in rounds.items()},
        "probe_frac": statistics.median(fracs) if fracs else None,
        "probe_frac_range": [min(fracs), max(fracs)] if fracs else None,
        "probe_frac_max": max(
            (probe(c) for m in models.values() for c in m["combos"].values()), default=None
        ),
        "replay_overhead_by_mode": {mode: replay(small, mode) for mode in ("r2", "r3")} if small else None,
        "floor_multiple_tiny": models.get("tiny", {}).get("floor", {}).get("moe_rl_step_s_over_floor"),
        "floor_multiple_small": models.get("small", {}).get("floor", {}).get("moe_rl_step_s_over_floor"),
        "own_gemms_small": models[small]["floor"].get("own_gemms") if small else None,
        "probe_work_share": statistics.median(works) if works else None,
        "probe_work_share_range": [min(works), max(works)] if works else None,
        "padding_share_removed": {n: m["combos"]["gspo/none"]["padding_share"] for n, m in models.items()},
        "loadavg_1m": [res.get("loadavg_1m_start"), res.get("loadavg_1m_end")],
        "measure": "CPU seconds at 1 thread (wall seconds swing with the machine's load)",
    }
    modes = [v for v in (out["replay_overhead_by_mode"] or {}).values() if v is not None]
    out["replay_overhead"] = max(modes) if modes else None
    return out


def scaling(world: dict, ref: dict) -> dict:
    """Tokens/s of a world-2 layout over the world-1 run's, per combo and phase (wall and CPU).

    A layout without a rollout phase (TP=2 replays rollouts) compares its step with the world-1
    step less its rollout."""
    out = {}
    for name, d in world.get("combos", {}).items():
        if name not in ref:
            continue
        r, w, row = ref[name]["phases"], d["phases"], {}
        for p in w:
            if p not in r:
                continue
            rs, rc = r[p]["s"], r[p]["cpu_s"]
            if p == "step" and "rollout" not in w:
                rs, rc = rs - r["rollout"]["s"], rc - r["rollout"]["cpu_s"]
            if min(rs, rc, w[p]["s"], w[p]["cpu_s"]) <= 0:
                continue
            # tokens/s ratio = (tokens_w / s_w) / (tokens_r / s_r)
            tw, tr = d["tokens"], ref[name]["tokens"]
            row[p] = {
                "tokens_per_s": (tw / w[p]["s"]) / (tr / rs),
                "tokens_per_cpu_s": (tw / w[p]["cpu_s"]) / (tr / rc),
            }
        out[name] = row
    return out


# -- plot --------------------------------------------------------------------------------------
def plot(res: dict, path: Path) -> None:
    """Bars per phase (tokens per CPU-second, peak memory), overhead ratios, moe-rl vs TRL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(16, 10))
    series = _phase_series(res)
    phases = [p for p in PHASES if p != "sync"]
    width = 0.85 / max(1, len(series))
    for i, (name, ph) in enumerate(series):
        xs = [j + i * width for j in range(len(phases))]
        tps = [(ph.get(p) or {}).get("tokens_per_cpu_s") or 0 for p in phases]
        mib = [(ph.get(p) or {}).get("peak_mib") or 0 for p in phases]
        ax[0, 0].bar(xs, tps, width, label=name)
        ax[0, 1].bar(xs, mib, width, label=name)
    for a, title in (
        (ax[0, 0], "response tokens per CPU-second per phase (gspo, no replay; log scale)"),
        (
            ax[0, 1],
            f"peak memory per phase, MiB ({res['models'][next(iter(res['models']))]['layout']['memory_meter']})",
        ),
    ):
        a.set_xticks([j + 0.425 - width / 2 for j in range(len(phases))], phases)
        a.set_title(title, fontsize=10)
        a.legend(fontsize=7)
    ax[0, 0].set_yscale("log")
    _plot_overheads(ax[1, 0], res)
    _plot_trl(ax[1, 1], res)
    fig.suptitle(
        f"moe-rl throughput, preset {res['preset']}, {res['machine']}, {res['threads']} torch thread(s) per "
        f"process, commit {res['commit']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _phase_series(res: dict) -> list[tuple[str, dict]]:
    """(label, phase -> stats) of gspo/none for every model, world layout and TRL peer."""
    out = [
        (f"{model}", d["combos"]["gspo/none"]["phases"])
        for model, d in res["models"].items()
        if "gspo/none" in d["combos"]
    ]
    for k, d in res["world"].items():
        if "gspo/none" in d.get("combos", {}):
            out.append((f"tiny {k.upper()}", d["combos"]["gspo/none"]["phases"]))
    for model, t in res["trl"].items():
        med = t.get("peer", {}).get("median")
        if med:
            out.append(
                (
                    f"TRL {model}",
                    {
                        p: {
                            "tokens_per_cpu_s": med["tokens"] / med[f"{p}_cpu_s"],
                            "peak_mib": med.get(f"{p}_peak_mib"),
                        }
                        for p in ("rollout", "old_logprob", "train", "step")
                    },
                )
            )
    return out


def _plot_overheads(a, res: dict) -> None:
    """Per model: each replay combo's paired overhead and the flip probes' paired share (medians
    over the timed steps, :func:`paired_replay_overheads` / :func:`paired_probe_fracs`), against
    the targets (3% and 5%)."""
    labels, vals = [], []
    for model, d in res["models"].items():
        for name, xs in paired_replay_by_combo(d["combos"]).items():
            labels.append(f"{model} {name}")
            vals.append(statistics.median(xs))
        labels.append(f"{model}\nprobes")
        vals.append(statistics.median(paired_probe_fracs(d["combos"]["gspo/none"]["cpu_s_per_step"])))
    a.bar(range(len(vals)), [100 * v for v in vals], color=["C1" if "probe" in s else "C0" for s in labels])
    a.axhline(0.0, color="k", lw=0.8)
    a.axhline(3.0, color="C0", ls="--", lw=1, label="replay target 3%")
    a.axhline(5.0, color="C1", ls="--", lw=1, label="probe target 5%")
    a.set_xticks(range(len(vals)), labels, rotation=70, fontsize=7)
    a.set_ylabel("% of the step's CPU seconds")
    a.legend(fontsize=7)
    a.set_title(
        "replay: CPU s added to the phases it changes; probes: share of the step (paired per step)",
        fontsize=9,
    )


def _plot_trl(a, res: dict) -> None:
    bars = []
    for model, t in res["trl"].items():
        vs = t.get("vs")
        if vs:
            bars.append(
                (f"moe-rl {model}", vs["cpu_seconds_per_step"]["moe_rl"], vs["moe_rl_tokens_per_step"], vs)
            )
            bars.append((f"TRL {model}", vs["cpu_seconds_per_step"]["trl"], vs["trl_tokens_per_step"], None))
    if not bars:
        a.text(0.5, 0.5, "TRL peer not run", ha="center")
        return
    colors = {"rollout": "C0", "old_logprob": "C1", "train": "C2", "probe": "C3", "sync": "C4"}
    for i, (_, secs, tokens, vs) in enumerate(bars):
        bottom = 0.0
        for p, s in secs.items():
            h = 1000 * s / tokens
            a.bar(i, h, bottom=bottom, color=colors[p], label=p if i == 0 else None)
            bottom += h
        if vs:
            a.text(
                i,
                bottom,
                f"moe-rl/TRL tokens/s:\nx{vs['ratio_cpu']:.2f} (CPU s)\nx{vs['ratio_wall']:.2f} (wall)",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    a.set_ylim(0, a.get_ylim()[1] * 1.25)
    a.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    a.set_ylabel("CPU seconds per 1000 response tokens")
    a.set_title("moe-rl (gspo) vs TRL GRPOTrainer (GSPO): where an RL step's time goes", fontsize=10)
    a.legend(fontsize=8)


# -- main --------------------------------------------------------------------------------------


def table(res: dict) -> str:
    """A plain-text summary: tokens/s (wall, CPU) and peak MiB per phase, overheads, TRL ratio."""
    lines = [f"{'model':6} {'combo':18} " + " ".join(f"{p:>24}" for p in PHASES)]
    runs = [(model, d) for model, d in res["models"].items()] + [
        (f"tiny-{k}", d) for k, d in res["world"].items()
    ]
    for model, d in runs:
        for name, c in d.get("combos", {}).items():
            cells = []
            for p in PHASES:
                x = c["phases"].get(p)
                cells.append(
                    f"{x['tokens_per_s'] or 0:9.0f}/{x['tokens_per_cpu_s'] or 0:7.0f}/"
                    f"{x.get('peak_mib', 0):6.0f}"
                    if x
                    else f"{'-':>24}"
                )
            lines.append(f"{model:6} {name:18} " + " ".join(f"{s:>24}" for s in cells))
    lines.append("cells: tokens/s wall / tokens/s CPU / peak MiB")
    for model, t in res["trl"].items():
        if t.get("vs"):
            v = t["vs"]
            lines.append(
                f"TRL {model}: moe-rl/TRL response tokens per second of an RL step: CPU x{v['ratio_cpu']:.2f} "
                f"(x{v['ratio_cpu_without_flip_probe']:.2f} without flip probes), wall x{v['ratio_wall']:.2f}"
                + ("" if v["wall_ratio_reliable"] else " (wall unreliable: other jobs took the cores)")
            )
            if "floor" in v:
                f = v["floor"]
                lines.append(
                    f"TRL {model}: matmul floor of the step {f['floor_s']:.3f} s at "
                    f"{res['matmul_peak']['flops_per_s'] / 1e9:.0f} GFLOP/s: moe-rl x"
                    f"{f['moe_rl_step_s_over_floor']:.1f}, TRL x{f['trl_step_s_over_floor']:.1f} of it; "
                    f"moe-rl/TRL cannot exceed x{f['trl_step_s_over_floor']:.1f} at equal work"
                )
            if "with_rollout_logprobs" in v:
                w = v["with_rollout_logprobs"]
                lines.append(
                    f"TRL {model}: with pi_old = the engine's log-probs: CPU x{w['ratio_cpu']:.2f} "
                    f"(x{w['ratio_cpu_without_flip_probe']:.2f} without flip probes)"
                )
    whole = res.get("trl_whole_machine", {}).get("vs")
    if whole:
        lines.append(
            f"whole machine: moe-rl DP=2 (2 processes) / TRL (2 threads) tokens per second of "
            f"an RL step: wall x{whole['ratio_wall']:.2f}"
        )
    return "\n".join(lines)
