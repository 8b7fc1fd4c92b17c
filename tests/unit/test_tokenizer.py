"""The character tokenizer, its Hugging Face export, and load_tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from moe_rl.tasks.tokenizer import ALPHABET, SPECIAL_TOKENS, CharTokenizer, HFTokenizer, load_tokenizer

TOK = CharTokenizer()


def _random_strings(n: int, seed: int = 0) -> list[str]:
    """Alphabet text mixed with special-token strings, near-misses and characters outside the alphabet."""
    rng = random.Random(seed)
    pieces = [*ALPHABET] * 4 + [
        *SPECIAL_TOKENS,
        "<reserved_1>",
        "<eos",
        "eos>",
        "<<pad>>",
        "é",
        "€",
        "\r",
        "🙂",
    ]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return TOK.save_pretrained(tmp_path_factory.mktemp("char_tok"))


def test_vocab_layout():
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.unk_id) == (0, 1, 2, 3)
    assert TOK.tokens[:4] == list(SPECIAL_TOKENS)
    assert TOK.vocab_size % 8 == 0 and TOK.vocab_size == len(TOK.tokens) == 104
    assert len(set(TOK.tokens)) == TOK.vocab_size
    for tp in (1, 2, 4, 8):
        assert TOK.vocab_size % tp == 0
    assert CharTokenizer("abc", multiple_of=16).vocab_size == 16
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aab")


def test_round_trip_and_one_token_per_char():
    rng = random.Random(1)
    for _ in range(200):
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 80)))
        ids = TOK.encode(s)
        assert len(ids) == len(s)
        assert all(i > 3 for i in ids)
        assert TOK.decode(ids) == s


def test_specials_unknown_and_flags():
    ids = TOK.encode("A:7<eos>é")
    assert ids == [TOK.tokens.index("A"), TOK.tokens.index(":"), TOK.tokens.index("7"), 2, 3]
    assert TOK.decode(ids) == "A:7"
    assert TOK.decode(ids, skip_special_tokens=False) == "A:7<eos><unk>"
    assert TOK.encode("x", add_bos=True, add_eos=True) == [1, TOK.tokens.index("x"), 2]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([TOK.vocab_size])


def test_hf_tokenizer_json_agrees(hf_dir):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert hf.get_vocab_size(with_added_tokens=True) == TOK.vocab_size
    for s in _random_strings(300):
        ids = TOK.encode(s)
        assert hf.encode(s).ids == ids, s
        assert hf.decode(ids) == TOK.decode(ids), s
        assert hf.decode(ids, skip_special_tokens=False) == TOK.decode(ids, skip_special_tokens=False), s


def test_transformers_autotokenizer_agrees(hf_dir):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    at = AutoTokenizer.from_pretrained(str(hf_dir))
    assert (at.pad_token_id, at.bos_token_id, at.eos_token_id, at.unk_token_id) == (0, 1, 2, 3)
    assert len(at) == TOK.vocab_size
    for s in _random_strings(100, seed=2):
        ids = TOK.encode(s)
        assert at.encode(s) == ids, s  # no BOS/EOS added by default
        assert at.decode(ids, skip_special_tokens=True) == TOK.decode(ids), s
        assert at.decode(ids, skip_special_tokens=False) == TOK.decode(ids, skip_special_tokens=False), s


def test_load_tokenizer(hf_dir, tmp_path):
    pytest.importorskip("tokenizers")
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    hf = load_tokenizer(hf_dir)
    assert isinstance(hf, HFTokenizer)
    assert (hf.pad_id, hf.bos_id, hf.eos_id, hf.vocab_size) == (0, 1, 2, TOK.vocab_size)
    for s in _random_strings(50, seed=3):
        assert hf.encode(s) == TOK.encode(s)
        assert hf.decode(TOK.encode(s)) == TOK.decode(TOK.encode(s))
    with pytest.raises(ValueError, match="'char'"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)


def test_hf_pad_falls_back_to_eos_and_eos_required(hf_dir, tmp_path):
    pytest.importorskip("tokenizers")
    d = tmp_path / "nopad"
    d.mkdir()
    (d / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<eos>"}, "bos_token": None})
    )
    hf = HFTokenizer(d)
    assert (hf.pad_id, hf.eos_id, hf.bos_id) == (2, 2, None)
    (d / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="eos_token"):
        HFTokenizer(d)
