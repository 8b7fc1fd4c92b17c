"""What ``moe-rl compare`` (and ``demo``) check before anything runs: the output folder is the
command's own (:func:`check_out`, :func:`claim_out`), its run folders hold no run of another
recipe (:func:`check_reruns`), and every arm's recipe and service passes the checks ``moe-rl
train`` makes (:func:`check_arms`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moe_rl.config import ConfigError, load_recipe
from moe_rl.errors import PathError, Unavailable
from moe_rl.lab.arms import arm_overrides
from moe_rl.lab.results import write_json
from moe_rl.lab.runner import arm_run_overrides, differences
from moe_rl.preflight import check_engine_layout, check_routes_served, check_services, preflight

MARKER = ".moe-rl-compare"
"Written into a comparison's ``out``: the folder is the command's own (a rerun may write into it)."


@dataclass(frozen=True)
class Job:
    """One run of the comparison: ``arm``'s replicate ``seed`` into ``out``."""

    arm: str
    seed: int
    out: Path

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed}"

    @property
    def log_file(self) -> Path:
        """Beside the run's folder (which a fresh run empties)."""
        return self.out.parent / f"{self.out.name}.log"


def job_overrides(overrides: list[str], job: Job) -> list[str]:
    """The recipe overrides of ``job``: the user's, then the arm's and the seed's."""
    return [*overrides, *arm_overrides(job.arm, seed=job.seed)]


def check_out(out: Path, *, command: str, marker: str, writes: str) -> None:
    """Refuse an ``out`` holding anything ``command`` did not write (a user's folders or files):
    one without ``command``'s ``marker`` (:func:`claim_out`) that is not empty."""
    if out.exists() and not out.is_dir():
        raise PathError(f"{command} --out {out} is a file: give a new or empty folder")
    if out.is_dir() and not (out / marker).exists():
        theirs = sorted(p.name for p in out.iterdir())
        if theirs:
            shown = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
            raise PathError(
                f"{command} --out {out} holds files the {command} did not write ({shown}): give a new or "
                f"empty folder (the {command} writes {writes} there)"
            )


def claim_out(out: Path, recipe: Path, overrides: list[str], *, marker: str) -> None:
    """Mark ``out`` (checked by :func:`check_out`) as its command's (``marker``)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / marker, {"recipe": str(recipe), "overrides": overrides})


def check_reruns(out: Path, jobs: list[Job], recipe: Path, overrides: list[str], *, fresh: bool) -> None:
    """Refuse, before anything trains, to run into folders of ``out`` that hold a run of another
    recipe (a changed override, another recipe, another ``--out`` reused), unless ``fresh``: the
    message names the runs, how their recipe differs (saved -> asked) and the ways on. A rerun of
    the same recipe resumes or skips them instead; ``fresh`` trains them again beside what they
    hold (:func:`moe_rl.lab.runner.run_arm`: nothing is deleted)."""
    differing: dict[tuple[str, ...], list[str]] = {}
    for job in jobs:
        ov = arm_run_overrides(job.out, job_overrides(overrides, job), None, None)
        diff = differences(job.out, recipe, ov, any_start=True)
        if diff:
            differing.setdefault(tuple(diff), []).append(job.label)
    if not differing or fresh:
        return
    parts = []
    for diff, labels in differing.items():
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        parts.append(f"{', '.join(labels)} ran with {'; '.join(diff[:4])}{more}")
    try:
        was = json.loads((out / MARKER).read_text())
        ran = " ".join([str(was["recipe"]), *map(str, was["overrides"])])
    except (OSError, ValueError, KeyError, TypeError):
        ran = "their recipe.yaml"
    raise PathError(
        f"compare --out {out} holds runs of another recipe (saved -> asked): {' | '.join(parts)}; "
        f"keep them (rerun with what they ran with: {ran}), --fresh to train these runs again beside "
        "them (their checkpoints and metrics rows are kept), or give another --out"
    )


def check_arms(recipe: Path, overrides: list[str], arms: list[str]) -> dict[str, int]:
    """Before anything trains (the SFT start takes minutes): every arm's RL recipe loads and passes
    the checks ``moe-rl train`` makes before it starts (:func:`moe_rl.preflight.preflight`: data,
    lengths, held-out split, layout, an attached server's routes), and every SGLang server or
    router it attaches to answers (:func:`moe_rl.preflight.check_services`); an error names the
    arm. Returns each arm's RL steps."""
    steps, checked = {}, False
    for name in arms:
        try:
            r = load_recipe(recipe, [*overrides, *arm_overrides(name, seed=0), "train.stages=[rl]"])
            if not checked:  # the data, tokenizer and services every arm shares: once
                preflight(r)
                check_services(r)
                checked = True
            check_routes_served(r)
            check_engine_layout(r)
        except ConfigError as e:
            raise type(e)(f"compare arm {name}: {e}") from None
        except Unavailable as e:
            raise Unavailable(f"compare arm {name}: {e}") from None
        steps[name] = r.train.rl_steps
    return steps
