"""Worker for the DP=2 device-boundary check (tests/dist/test_device_boundary_dp.py), under torchrun.

Each rank runs one RL step and the evaluation of the tiny recipe at data_parallel 2 (gloo) with
its policy on the pretend accelerator of :mod:`tests.device_ledger`, the ledger open, and every
torch.distributed collective checked: a host tensor given to one (what NCCL refuses) is
recorded. Writes ``{"mixes": [...], "off": [...]}`` to ``<out>/rank<r>.json``.
"""

import json
import sys
from pathlib import Path


class _Patch:
    """The one monkeypatch method the helpers need, outside pytest."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def main(out: Path, algo: str, routing: str) -> None:
    import torch.distributed as tdist

    from moe_rl.trainer.loop import evaluate
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.timer import StepTimer
    from tests.device_ledger import HOST, DeviceLedger, check_collectives, run_on_accel

    patch = _Patch()
    run = run_on_accel(
        out / "run",
        {"name": algo, "routing": routing},
        patch,
        parallel={"data_parallel": 2, "backend": "gloo"},
    )
    ledger = DeviceLedger([*run.policy.model.parameters(), *run.policy.model.buffers()])
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")
    off = check_collectives(patch, ledger, tdist, names, lambda lg, t: lg.tag(t) != HOST)
    with ledger:
        result = rl_step(run, 0, StepTimer())
        evaluate(run, 1)
    rank = run.info.rank
    report = {
        "mixes": sorted({str(m) for m in ledger.mixes}),
        "off": off,
        "dp_size": run.info.dp_size,
        "rows": int(result.batch.tokens_BT.shape[0]),
        "skipped": result.skipped_updates,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    run.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
