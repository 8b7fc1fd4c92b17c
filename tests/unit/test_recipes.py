"""Every recipe under recipes/ loads (includes followed), round-trips, and old keys name the new ones."""

from pathlib import Path

import pytest
import yaml

from moe_rl.config import ConfigError, load_recipe, read_recipe_data, recipe_from_dict, to_dict

ROOT = Path(__file__).parents[2] / "recipes"
RECIPES = sorted(p for p in ROOT.rglob("*.yaml") if ".plan" not in p.suffixes)  # *.plan.yaml: sweep plans
INCLUDING = [p for p in RECIPES if "include" in yaml.safe_load(p.read_text())]


def test_there_are_recipes():
    assert len(RECIPES) >= 3
    assert INCLUDING, "no recipe exercises include"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recipe_loads(path):
    r = load_recipe(path)
    assert r.model.vocab_size % r.parallel.tensor_parallel == 0
    assert recipe_from_dict(to_dict(r)) == r  # what a run writes next to its outputs loads back


@pytest.mark.parametrize("path", INCLUDING, ids=lambda p: str(p.relative_to(ROOT)))
def test_includes_are_merged_under_the_recipe(path):
    own = yaml.safe_load(path.read_text())
    base = read_recipe_data(path.parent / own["include"])
    merged = read_recipe_data(path)
    assert "include" not in merged
    for section, fields in base.items():  # every base value survives unless the recipe sets it
        for k, v in fields.items():
            if isinstance(v, dict):
                continue  # a nested section merges key by key
            assert merged[section][k] == own.get(section, {}).get(k, v), f"{section}.{k}"


def test_cluster_recipes_use_the_sglang_section():
    for name in ("qwen3_30b_a3b_grpo", "qwen3_30b_a3b_grpo_r2", "qwen3_30b_a3b_gspo"):
        sg = load_recipe(ROOT / "cluster" / f"{name}.yaml").rollout.sglang
        assert (sg.tp, sg.ep, sg.mem_fraction) == (8, 8, 0.8), name


MOVED = ["url", "model_path", "tp", "ep", "port", "host", "mem_fraction", "module", "startup_timeout_s"]


@pytest.mark.parametrize("key", MOVED)
def test_moved_sglang_key_in_a_recipe_names_the_new_key(tmp_path, key):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"rollout": {"engine": "sglang", f"sglang_{key}": 1}}))
    top = tmp_path / "top.yaml"
    top.write_text("include: base.yaml\ntrain: {stages: [sft]}\n")
    for path in (base, top):  # directly, and through an include
        with pytest.raises(ConfigError, match=rf"^rollout\.sglang_{key} moved: use rollout\.sglang\.{key}$"):
            load_recipe(path)


def test_moved_sglang_key_in_an_override_names_the_new_key():
    with pytest.raises(ConfigError, match=r"rollout\.sglang_url moved: use rollout\.sglang\.url"):
        recipe_from_dict({}, ["rollout.sglang_url=http://h:1"])
    r = recipe_from_dict({}, ["rollout.sglang.url=http://h:1", "rollout.sglang.tp=4"])
    assert (r.rollout.sglang.url, r.rollout.sglang.tp) == ("http://h:1", 4)
