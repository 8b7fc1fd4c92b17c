"""Performance regression check: each benchmark rerun against its committed baseline.

benchmarks/baselines.yaml names, per benchmark, the committed result it is compared with, the
arguments that reproduce it and the figures that count, each with its direction and tolerance (the
file's header says why those). A figure fails when it is worse than its baseline by more than its
tolerance factor; a figure in machine units (``absolute``) counts only on the baseline's own
machine (:func:`moe_rl.lab.results.machine`), so a faster or slower CPU is not a regression. The
check writes nothing under results/: the new JSON goes to a scratch folder (``--keep`` keeps it).

    python -m benchmarks.check                        # every benchmark this machine can run
    python -m benchmarks.check engine_throughput      # one (or a few)
    python -m benchmarks.check throughput --result NEW.json   # compare a result already measured

Exit status 1 when a figure regressed or went missing. On demand (`make bench-check`), not in CI:
it takes minutes and wants an idle machine (the table shows the load it ran under).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import RESULTS
from moe_rl.lab.results import machine

HERE = Path(__file__).resolve().parent
BASELINES = HERE / "baselines.yaml"
NEEDS = {
    "cuda": lambda: __import__("torch").cuda.is_available(),
    "trl": lambda: (HERE.parent / ".venv-trl" / "bin" / "python").exists(),
}
"What a benchmark or a figure may need (``needs:``), and whether this machine has it."


@dataclass(frozen=True)
class Row:
    """One figure's comparison: ``verdict`` is ok, regressed, missing, other machine or not measured."""

    bench: str
    figure: str
    base: float | None
    new: float | None
    worse_by: float | None
    tolerance: float
    verdict: str


def load(path: Path = BASELINES) -> dict[str, dict]:
    import yaml

    return yaml.safe_load(path.read_text())


def value_at(doc: dict, dotted: str) -> float | None:
    """The number at ``dotted`` (``a.b.c``) in ``doc``, or None."""
    node = doc
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def compare(bench: str, spec: dict, base: dict, new: dict, here: str) -> list[Row]:
    """Every figure of ``spec`` in ``new`` against ``base`` (``here``: this machine's name)."""
    rows = []
    for figure, f in spec["figures"].items():
        b, n, tol = value_at(base, figure), value_at(new, figure), float(f["tolerance"])
        if f.get("absolute") and here != spec["machine"]:
            verdict, worse = f"other machine ({spec['machine']})", None
        elif n is None or b is None:
            missing = f.get("needs") and not NEEDS[f["needs"]]()
            verdict, worse = (f"not measured (needs {f['needs']})" if missing else "missing"), None
        else:
            worse = worse_by(b, n, f["better"])
            verdict = "regressed" if worse > tol else "ok"
        rows.append(Row(bench, figure, b, n, worse, tol, verdict))
    return rows


def worse_by(base: float, new: float, better: str) -> float:
    """The factor ``new`` is worse than ``base`` by (below 1: better; a count from 0 to more: inf)."""
    num, den = (base, new) if better == "higher" else (new, base)
    if den == 0:
        return 1.0 if num == 0 else math.inf
    return num / den


def run(bench: str, spec: dict, out: Path) -> dict:
    """Rerun ``bench`` with its baseline's arguments; the newest JSON it wrote under ``out``."""
    args = [a.replace("{out}", str(out)) for a in spec["args"]]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE.parent), os.environ.get("PYTHONPATH")))),
    }
    subprocess.run([sys.executable, "-m", f"benchmarks.{bench}", *args], cwd=HERE.parent, env=env, check=True)
    found = sorted(out.rglob("*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"benchmarks.{bench} wrote no JSON under {out}")
    return json.loads(found[-1].read_text())


def table(rows: list[Row]) -> str:
    def num(x):
        return "-" if x is None else f"{x:.4g}"

    lines = [
        "| benchmark | figure | baseline | now | worse by | tolerance | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        worse = "-" if r.worse_by is None else f"{r.worse_by:.2f}x"
        lines.append(
            f"| {r.bench} | {r.figure} | {num(r.base)} | {num(r.new)} | {worse} | {r.tolerance:.2f}x | {r.verdict} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    baselines = load()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.check", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "benches", nargs="*", help=f"of {', '.join(baselines)} (default: every one this machine runs)"
    )
    ap.add_argument(
        "--result", type=Path, help="compare this result JSON instead of rerunning (one benchmark)"
    )
    ap.add_argument("--keep", type=Path, help="keep the new results in this folder")
    args = ap.parse_args(argv)
    if set(args.benches) - set(baselines):
        ap.error(
            f"no baseline for {sorted(set(args.benches) - set(baselines))}: one of {', '.join(baselines)}"
        )
    if args.result and len(args.benches) != 1:
        ap.error("--result compares one benchmark: name it")
    here, rows = machine(), []
    print(f"machine {here}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    for bench in args.benches or list(baselines):
        spec = baselines[bench]
        if spec.get("pending"):
            print(f"{bench}: no baseline yet ({spec['pending']})", flush=True)
            continue
        if spec.get("needs") and not NEEDS[spec["needs"]]():
            print(f"{bench}: skipped (needs {spec['needs']})", flush=True)
            continue
        base = json.loads((RESULTS / spec["result"]).read_text())
        if args.result:
            new = json.loads(args.result.read_text())
            rows += compare(bench, spec, base, new, new.get("machine", here))
            continue
        out = args.keep or Path(tempfile.mkdtemp(prefix=f"check-{bench}-"))
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        new = run(bench, spec, out)
        print(f"{bench}: {time.perf_counter() - t0:.0f} s", flush=True)
        rows += compare(bench, spec, base, new, here)
    print(table(rows))
    bad = [r for r in rows if r.verdict in ("regressed", "missing")]
    for r in bad:
        print(f"{r.bench}: {r.figure} {r.verdict} (benchmarks/baselines.yaml)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
