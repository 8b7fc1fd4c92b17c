"""Quiet output (issue 33, item 11): megatron-core's INFO lines and warnings only with ``-v``, and
``moe-rl train``'s final summary a short table. In process, no subprocess."""

from __future__ import annotations

import logging
import warnings

import pytest

from moe_rl.cli import SUMMARY_KEYS, main, summary_table


@pytest.fixture
def restore_logging():
    """The logging and warning set-up as it was: the CLI configures the root logger in process (a
    handler on the captured stderr would outlive the test)."""
    megatron, root = logging.getLogger("megatron"), logging.getLogger()
    level, root_level, handlers = megatron.level, root.level, root.handlers[:]
    with warnings.catch_warnings():
        yield
    megatron.setLevel(level)
    root.setLevel(root_level)
    root.handlers[:] = handlers


def _megatron_warning_shown() -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(
            "Transformer Engine and Apex are not installed",
            UserWarning,
            "optimizer.py",
            1,
            "megatron.core.optimizer",
        )
    return bool(seen)


@pytest.mark.parametrize("verbose", [False, True])
def test_megatron_logs_at_warning_unless_verbose(restore_logging, capsys, verbose):
    """``moe-rl check`` (the same set-up as every command): megatron-core's loggers at WARNING, so
    its INFO lines (DDP buckets, optimizer config) do not print, and its known warnings off; with
    ``-v`` INFO and every warning. Planted bugs killed: the megatron level left at the root's INFO;
    ``-v`` still hiding megatron's INFO; the warning filter ignoring ``-v``."""
    warnings.simplefilter("always")  # what a user sees with warnings on, whatever pytest set
    assert main(["-v", "check", "recipes/tiny.yaml"] if verbose else ["check", "recipes/tiny.yaml"]) == 0
    capsys.readouterr()
    child = logging.getLogger("megatron.core.distributed.param_and_grad_buffer")
    assert logging.getLogger("megatron").level == (logging.INFO if verbose else logging.WARNING)
    assert child.isEnabledFor(logging.INFO) == verbose
    assert child.isEnabledFor(logging.WARNING)
    assert _megatron_warning_shown() == verbose
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("ours", UserWarning, "x.py", 1, "moe_rl.trainer")
    assert seen, "a warning outside megatron-core is never hidden"


DEPENDENCY_WARNINGS = [
    # (message, category, module): what torchrun, --resume and export printed (issue 49)
    (
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...",
        FutureWarning,
        "torch.distributed.c10d_logger",
    ),
    (
        "Please use DTensor instead and we are deprecating ShardedTensor.",
        FutureWarning,
        "torch.distributed.checkpoint.planner_helpers",
    ),
    (
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad ...",
        UserWarning,
        "moe_rl.megatron.shims",
    ),
]


@pytest.mark.parametrize("verbose", [False, True])
def test_dependency_warnings_no_user_caused_show_only_with_v(restore_logging, capsys, verbose):
    """Issue 49: torch.distributed's deprecations that megatron-core's calls trigger (under torchrun,
    in dist_checkpointing's save and load) and the non-leaf .grad warning megatron-core's DDP causes
    through the CPU shim are off unless -v; a FutureWarning of moe-rl's own, or the shim's other
    warnings, still show."""
    warnings.simplefilter("always")
    assert main(["-v", "check", "recipes/tiny.yaml"] if verbose else ["check", "recipes/tiny.yaml"]) == 0
    capsys.readouterr()
    for message, category, module in DEPENDENCY_WARNINGS:
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn_explicit(message, category, module.replace(".", "/") + ".py", 1, module)
        assert bool(seen) == verbose, module
    for message, category, module in (
        ("ours", FutureWarning, "moe_rl.trainer.run"),
        ("another", UserWarning, "moe_rl.megatron.shims"),
    ):
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn_explicit(message, category, "x.py", 1, module)
        assert seen, module


def test_the_package_metadata_is_what_setuptools_asks_for():
    """``pip install`` printed setuptools' deprecation of ``project.license`` as a table (twice, in
    the 180 lines of ``make venv``): an SPDX string, with the setuptools that reads it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in meta["build-system"]["requires"]


def test_summary_table_shows_the_key_metrics_of_each_stage():
    """The stages' key metrics, one per line under their stage, values in 4 significant digits (rates
    in percent, with their % sign);
    the other metrics (in metrics.jsonl) and non-numbers left out; the wall time and the JSONL path
    on the first line. Planted bugs killed: the full dict printed; a key metric dropped; a stage
    name repeated on every line."""
    results = {
        "sft": {"loss": 4.50004, "tokens": 482.0, "grad_norm": 5.83291, "lr": 2e-4, "step_s": 0.3796},
        "rl": {
            "reward/mean": 0.25,
            "eval/accuracy": 0.5,
            "flip/step/rate": 0.0012345,
            "experts/load_imbalance": 1.4321,
            "time/step": 2.5,
            "clip/seq_frac": 0.1,
            "ratio/token_max": 1.7,
            "note": "text",
        },
    }
    text = summary_table(results, 21.46, "runs/x")
    assert text.splitlines() == [
        "done in 21.5s; every metric: runs/x/metrics.jsonl",
        "stage  metric                  last",
        "sft    loss                    4.5",
        "       grad_norm               5.833",
        "       step_s                  0.3796",
        "rl     reward/mean             0.25",
        "       eval/accuracy           50.00%",  # rates in percent (issue 49: one unit per quantity)
        "       flip/step/rate          0.12%",
        "       experts/load_imbalance  1.432",
        "       time/step               2.5",
    ]
    assert summary_table({"rl": {"other": 1.0}}, 3.0, "o") == "done in 3.0s; every metric: o/metrics.jsonl"
    assert len(SUMMARY_KEYS["rl"]) <= 12  # short: a screen, not the ~80 metrics of a step
