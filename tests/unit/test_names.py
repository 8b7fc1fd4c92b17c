"""moe_rl.names: the plain lists config validates against agree with the registries they stand for,
and the recipe module imports no torch (nor the losses, the engines or the trainer)."""

import subprocess
import sys

import pytest
import torch

from moe_rl import names
from moe_rl.config import AlgoConfig, ConfigError
from moe_rl.losses import LOSSES, corrections
from moe_rl.tasks import TASKS


def _loaded_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.integration
def test_import_config_imports_no_torch():
    loaded = _loaded_after("import moe_rl.config")
    assert "torch" not in loaded
    upper = ("moe_rl.losses", "moe_rl.rollout", "moe_rl.trainer", "moe_rl.serve", "moe_rl.megatron")
    assert [m for m in loaded if m.startswith(upper)] == []


@pytest.mark.integration
def test_names_is_data_only():
    assert {m for m in _loaded_after("import moe_rl.names") if m.startswith("moe_rl")} == {
        "moe_rl",
        "moe_rl.names",
    }


def test_loss_names_agree_with_the_loss_registry():
    assert sorted(names.LOSS_NAMES) == sorted(LOSSES)
    assert sorted(names.PAPER_CLIP) == sorted(LOSSES)
    for name, spec in LOSSES.items():
        assert (spec.eps_low, spec.eps_high) == names.PAPER_CLIP[name], name
    token = sorted(n for n, spec in LOSSES.items() if spec.ratio_level == "token")
    assert sorted(names.TOKEN_RATIO_LOSSES) == token


def test_task_names_agree_with_the_task_registry():
    assert sorted(names.TASK_NAMES) == sorted(TASKS)


def test_correction_names_agree_with_what_corrections_implements():
    assert corrections.CORRECTIONS is names.CORRECTIONS and corrections.DEFAULT_BOUNDS is names.DEFAULT_BOUNDS
    assert sorted(("none", *names.TOKEN_LEVEL, *names.SEQUENCE_LEVEL)) == sorted(names.CORRECTIONS)
    assert set(names.DEFAULT_BOUNDS) <= set(names.CORRECTIONS)
    logp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    shapes = {m: corrections.correction_weights(logp, logp, mask, method=m) for m in names.CORRECTIONS}
    assert shapes.pop("none") is None
    assert {m: tuple(w.shape) for m, w in shapes.items()} == {
        **{m: (2, 3) for m in names.TOKEN_LEVEL},
        **{m: (2,) for m in names.SEQUENCE_LEVEL},
    }
    with pytest.raises(ValueError, match="unknown rollout correction 'clip'"):
        corrections.correction_weights(logp, logp, mask, method="clip")


def test_config_checks_token_level_corrections_against_the_loss_ratio_level():
    for name, spec in LOSSES.items():
        for corr in names.TOKEN_LEVEL:
            if spec.ratio_level == "token":
                assert AlgoConfig(name=name, rollout_correction=corr).rollout_correction == corr
            else:
                with pytest.raises(ConfigError, match="clips one ratio per sequence"):
                    AlgoConfig(name=name, rollout_correction=corr)
