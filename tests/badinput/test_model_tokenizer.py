"""The tokenizer comes from ``model.hf_path`` when the recipe names none (as verl and TRL take it from
the model path); the character tokenizer only when asked for, or when the folder has none (one
warning line); ``moe-rl check`` refuses a tokenizer whose vocabulary disagrees with the model's.

Before: a recipe with ``model.hf_path`` and no ``model.tokenizer`` trained on the built-in character
tokenizer's ids, silently, whatever tokenizer the folder held; ``check`` passed a character
tokenizer against any vocabulary at least 104 rows long.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from moe_rl.config import load_recipe
from tests.badinput.test_hf_path import START, hf_recipe

recipe_case = pytest.mark.bad_input("recipe")


def own_tokenizer(folder: Path, vocab: int) -> None:
    """Replace ``folder``'s tokenizer with a byte-level BPE of ``vocab`` ids trained on arithmetic
    (not the character tokenizer: other ids for the same text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / f).unlink(missing_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"Q: {a}+{b}-{c}= A: {a + b - c}" for a in range(10) for b in range(10) for c in range(10)]
    text += [" ".join(f"{x}{y}{z}" for z in "stuvwxyz") for x in "abcdefgh" for y in "ijklmnop"]
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials))
    assert tok.get_vocab_size() == vocab
    tok.save(str(folder / "tokenizer.json"))
    names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(names))


@pytest.fixture
def start_copy(tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(START, folder)
    return folder


def test_the_tokenizer_comes_from_hf_path(tmp_path, start_copy, caplog):
    from moe_rl.tasks import HFTokenizer, load_tokenizer

    own_tokenizer(start_copy, 104)
    with caplog.at_level(logging.WARNING):
        recipe = load_recipe(hf_recipe(tmp_path, start_copy))
    assert recipe.model.tokenizer == str(start_copy)
    tok = load_tokenizer(recipe.model.tokenizer)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("Q: 1+2-3=") != load_tokenizer("char").encode("Q: 1+2-3=")
    assert not caplog.records


def test_an_exported_char_tokenizer_is_read_as_char(tmp_path, caplog):
    """The shipped starts hold moe-rl's character tokenizer (as ``moe-rl export`` writes it): the
    built-in class reads it, no tokenizers package needed and no line said."""
    with caplog.at_level(logging.WARNING):
        assert load_recipe(hf_recipe(tmp_path, START)).model.tokenizer == "char"
    assert not caplog.records


def test_a_folder_without_tokenizer_falls_back_to_char_in_one_line(tmp_path, start_copy, caplog):
    for f in start_copy.glob("*token*"):
        f.unlink()
    with caplog.at_level(logging.WARNING):
        recipe = load_recipe(hf_recipe(tmp_path, start_copy))
        load_recipe(hf_recipe(tmp_path, start_copy))  # said once per folder
    assert recipe.model.tokenizer == "char"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"model.hf_path={start_copy} holds no tokenizer.json" in said[0], said
    assert "built-in character tokenizer" in said[0]


def test_an_explicit_tokenizer_is_kept(tmp_path, start_copy, caplog):
    own_tokenizer(start_copy, 104)
    with caplog.at_level(logging.WARNING):
        assert load_recipe(hf_recipe(tmp_path, start_copy, tokenizer="char")).model.tokenizer == "char"
    assert not caplog.records


REFUSED = {
    # 48 ids against the model's 104 rows: another model's tokenizer (the char tokenizer on a Qwen3
    # folder is the same story at 104 against 151,936)
    48: r"configuration error: model\.tokenizer=.*model has 48 ids and model\.hf_path=.*model a vocabulary "
    r"of 104: they disagree .* give the model's own tokenizer",
    # more ids than the model has rows
    200: r"configuration error: model\.hf_path=.*'s model\.vocab_size=104 is smaller than the tokenizer's "
    r"\d+ ids .*give the model's own tokenizer",
}


@recipe_case
@pytest.mark.parametrize("ids", sorted(REFUSED))
def test_check_refuses_a_tokenizer_whose_vocabulary_disagrees_with_the_models(cli, tmp_path, start_copy, ids):
    own_tokenizer(start_copy, ids)
    cli("check", hf_recipe(tmp_path, start_copy)).one_line(REFUSED[ids])


@recipe_case
def test_check_shows_the_tokenizer_it_took(cli, tmp_path, start_copy):
    own_tokenizer(start_copy, 104)
    res = cli("check", hf_recipe(tmp_path, start_copy))
    assert res.code == 0, res.err[-2000:]
    assert yaml.safe_load(res.out)["model"]["tokenizer"] == str(start_copy)
