"""moe_rl.lab: its place in the layers, and the definitions it keeps once (arms' clip bands, the
tiny policy, the report panels, the verdicts' names)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_the_trainer_never_imports_the_lab_and_the_cli_never_edits_sys_path():
    for f in (ROOT / "moe_rl" / "trainer").glob("*.py"):
        assert not {m for m in _imports(f) if m.startswith("moe_rl.lab")}, f
    for f in (ROOT / "moe_rl").rglob("*.py"):
        assert "sys.path.insert" not in f.read_text(), f
        assert not {m for m in _imports(f) if m.split(".")[0] == "benchmarks"}, f


def test_the_arms_clip_bands_are_the_loss_registrys():
    from moe_rl.lab.arms import ARMS
    from moe_rl.losses import LOSSES

    for arm in ARMS.values():
        algo = arm["algo"]
        assert (algo["eps_low"], algo["eps_high"]) == (
            LOSSES[algo["name"]].eps_low,
            LOSSES[algo["name"]].eps_high,
        )


def test_the_tiny_policy_is_defined_once():
    """ModelConfig's defaults are the tiny policy: the demo recipe and the benchmarks derive it."""
    from dataclasses import asdict

    from benchmarks.common import TINY_MODEL
    from moe_rl.config import ModelConfig, load_recipe

    demo = asdict(load_recipe(ROOT / "recipes/demo/base.yaml").model)
    default = asdict(ModelConfig())
    assert {k: demo[k] for k in demo if k != "max_seq_len"} == {
        k: default[k] for k in default if k != "max_seq_len"
    }
    assert {k: v for k, v in TINY_MODEL.items() if k != "max_seq_len"} == {
        k: default[k] for k in TINY_MODEL if k != "max_seq_len"
    }
    from benchmarks.throughput import MODELS  # derived from TINY_MODEL: they agree

    assert MODELS["tiny"] == {k: TINY_MODEL[k] for k in MODELS["tiny"]}


def test_one_panel_table_and_distinct_verdicts():
    import moe_rl.trainer.sentinel as sentinel
    from moe_rl.lab import collapse as lab_collapse
    from moe_rl.lab.report import DETAIL_PANELS, PANELS

    assert set(DETAIL_PANELS) <= set(PANELS)
    assert hasattr(sentinel, "SentinelVerdict") and not hasattr(sentinel, "Verdict")
    assert lab_collapse.Verdict is not sentinel.SentinelVerdict


def test_every_package_of_moe_rl_is_built():
    """pyproject lists its packages by hand: moe_rl.lab (and any other) is among them."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moe_rl").rglob("__init__.py")}
    assert "moe_rl.lab" in found and found <= listed, found - listed
