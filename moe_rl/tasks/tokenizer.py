"""Tokenizers: the built-in character tokenizer, and Hugging Face tokenizers behind the same interface.

The character tokenizer is built in code (STYLE 11): four special tokens, then one token
per character of a fixed printable alphabet (tab, newline and printable ASCII), then
reserved tokens that pad the vocabulary to a multiple of 8 so it divides tensor-parallel
sizes. ``save_pretrained`` writes a Hugging Face ``tokenizer.json`` (a BPE model with no
merges, so every character is one token) that ``tokenizers`` and ``transformers`` load
and that encodes and decodes exactly like :class:`CharTokenizer`.

Both tokenizers follow Hugging Face conventions: special-token strings written in the
text (``"<eos>"``) encode to their ids, characters outside the alphabet encode to
``<unk>``, and ``decode`` drops special tokens unless ``skip_special_tokens=False``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
"Special tokens, ids 0..3: padding, beginning and end of sequence, unknown character."
ALPHABET = "\t\n" + "".join(chr(c) for c in range(32, 127))
"Characters of the built-in tokenizer: tab, newline and the 95 printable ASCII characters."


class Tokenizer(Protocol):
    """What tasks, rollout engines and the trainer need from a tokenizer."""

    pad_id: int
    eos_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without added BOS/EOS."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens=False``."""
        ...


class CharTokenizer:
    """One token per character; see the module docstring for the layout of the vocabulary."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    unk_id = 3

    def __init__(self, alphabet: str = ALPHABET, *, multiple_of: int = 8) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("tokenizer alphabet has repeated characters: list each character once")
        if any(len(s) != 1 for s in alphabet):  # pragma: no cover - a str is always characters
            raise ValueError("tokenizer alphabet must be single characters")
        if multiple_of < 1:
            raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
        n = len(SPECIAL_TOKENS) + len(alphabet)
        reserved = [f"<reserved_{i}>" for i in range(-n % multiple_of)]
        self.alphabet = alphabet
        self.added_tokens: tuple[str, ...] = (*SPECIAL_TOKENS, *reserved)
        "Tokens matched in text before characters (specials and reserved padding tokens)."
        self.tokens: list[str] = [*SPECIAL_TOKENS, *alphabet, *reserved]
        "id -> token string."
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self._added_ids = {self._ids[t] for t in self.added_tokens}
        # Leftmost match, longest first among tokens starting at the same position (like HF).
        pattern = "|".join(re.escape(t) for t in sorted(self.added_tokens, key=len, reverse=True))
        self._added_re = re.compile(pattern)

    @property
    def vocab_size(self) -> int:
        """Number of ids, a multiple of ``multiple_of``."""
        return len(self.tokens)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text``: special-token strings map to their id, unknown characters to ``<unk>``."""
        ids = [self.bos_id] if add_bos else []
        get, unk, pos = self._ids.get, self.unk_id, 0
        for m in self._added_re.finditer(text):
            ids.extend(get(c, unk) for c in text[pos : m.start()])
            ids.append(self._ids[m.group()])
            pos = m.end()
        ids.extend(get(c, unk) for c in text[pos:])
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def unknown_chars(self, text: str) -> set[str]:
        """The characters of ``text`` this tokenizer lacks (each becomes ``<unk>``)."""
        return {c for c in set(text) if c not in self._ids}

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Concatenated token strings; special and reserved tokens dropped unless asked for."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} is outside the vocabulary [0, {len(self.tokens)})")
            if skip_special_tokens and i in self._added_ids:
                continue
            out.append(self.tokens[i])
        return "".join(out)

    # ---------------------------------------------------------------- Hugging Face export

    def hf_tokenizer_json(self) -> dict:
        """The ``tokenizer.json`` document: BPE without merges (a character vocabulary)."""
        added = [
            {
                "id": self._ids[t],
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t in self.added_tokens
        ]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": None,
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": "<unk>",
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": dict(self._ids),
                "merges": [],
            },
        }

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **names,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
            "added_tokens_decoder": {
                str(self._ids[t]): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for t in self.added_tokens
            },
        }
        _write_json(d / "tokenizer.json", self.hf_tokenizer_json())
        _write_json(d / "tokenizer_config.json", config)
        _write_json(d / "special_tokens_map.json", names)
        return d


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class HFTokenizer:
    """A local Hugging Face tokenizer directory behind the :class:`Tokenizer` interface.

    Needs the ``tokenizers`` package (imported here, only when used). Special tokens come
    from ``tokenizer_config.json`` or ``special_tokens_map.json``; ``pad_id`` falls back to
    ``eos_id`` when the tokenizer names no pad token (as many base models do). The chat template
    is ``tokenizer_config.json``'s ``chat_template`` (a string, or the one named ``default`` of a
    list) or ``chat_template.jinja``, as ``transformers`` saves it; None when there is none.
    """

    def __init__(self, directory: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:  # pragma: no cover - the dev extra installs it
            raise ImportError("loading a Hugging Face tokenizer needs `pip install tokenizers`") from e
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{d} has no tokenizer.json: save the tokenizer with a fast tokenizer")
        self.path = d
        self._tok = _HFTok.from_file(str(d / "tokenizer.json"))
        names = {}
        template = None
        for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
            f = d / fname
            if f.is_file():
                data = json.loads(f.read_text(encoding="utf-8"))
                for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                    if data.get(key) is not None:
                        names[key] = data[key]["content"] if isinstance(data[key], dict) else data[key]
                template = data.get("chat_template", template)
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        self.chat_template: str | None = template or None
        "The Jinja chat template (None: the tokenizer has none; chat prompts are then rendered plainly)."
        self.special_tokens: dict[str, str] = names
        "bos_token, eos_token, pad_token, unk_token strings the tokenizer names (the template sees them)."
        eos = self._id(names.get("eos_token"))
        if eos is None:
            raise ValueError(
                f"{d}: no eos_token in tokenizer_config.json or special_tokens_map.json; "
                "name the end-of-sequence token there"
            )
        self.eos_id: int = eos
        self.bos_id: int | None = self._id(names.get("bos_token"))
        pad = self._id(names.get("pad_token"))
        self.pad_id: int = eos if pad is None else pad

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (including added tokens); a model may have more rows."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without the tokenizer's post-processor specials (no BOS/EOS added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], *, tokenize: bool = False, add_generation_prompt: bool = True
    ) -> str | list[int]:
        """``messages`` rendered by :attr:`chat_template` as ``transformers`` renders it (its own
        Jinja renderer, with the special-token strings), the text or (``tokenize``) its ids."""
        if not self.chat_template:
            raise ValueError(f"{self.path} has no chat template (tokenizer_config.json chat_template)")
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError as e:  # pragma: no cover - the dev extra installs it
            raise ImportError("rendering a chat template needs `pip install transformers`") from e
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        return self.encode(rendered[0]) if tokenize else rendered[0]


def is_char_tokenizer_json(path: str | Path) -> bool:
    """Whether ``path`` (a ``tokenizer.json``) is :class:`CharTokenizer`'s own, as
    :meth:`CharTokenizer.save_pretrained` writes it (a policy exported by ``moe-rl export``)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return (
            doc["model"]["type"] == "BPE"
            and not doc["model"]["merges"]
            and doc["model"]["vocab"] == (CharTokenizer()._ids)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


_SAID: set[str] = set()


def model_tokenizer(hf_path: str | None) -> str:
    """``model.tokenizer`` of a recipe that names none: the tokenizer of ``model.hf_path`` (its
    folder, which holds ``tokenizer.json``), as verl and TRL take it from the model path; ``char``
    when that tokenizer is moe-rl's character tokenizer (an export of a char-tokenizer policy: the
    built-in class reads the same ids), when there is no ``hf_path``, or when the folder holds no
    ``tokenizer.json`` (then said in one warning line, once per folder). A folder that does not
    exist here keeps its path: ``moe-rl check`` and ``train`` refuse it, naming ``model.hf_path``."""
    if not hf_path:
        return "char"
    folder = Path(hf_path)
    if not folder.is_dir():
        return str(hf_path)
    if not (folder / "tokenizer.json").is_file():
        if str(hf_path) not in _SAID:
            _SAID.add(str(hf_path))
            logging.getLogger(__name__).warning(
                "model.tokenizer: model.hf_path=%s holds no tokenizer.json: using the built-in character "
                "tokenizer (set model.tokenizer=DIR to the model's tokenizer folder, or model.tokenizer=char "
                "to say so)",
                hf_path,
            )
        return "char"
    return "char" if is_char_tokenizer_json(folder / "tokenizer.json") else str(hf_path)


def load_tokenizer(path_or_name: str | Path) -> CharTokenizer | HFTokenizer:
    """``"char"``: the built-in :class:`CharTokenizer`; a local directory: :class:`HFTokenizer`."""
    if str(path_or_name) == "char":
        return CharTokenizer()
    from moe_rl.configlib import ConfigError

    p = Path(path_or_name)
    if p.is_dir():
        try:
            return HFTokenizer(p)
        except FileNotFoundError as e:
            raise ConfigError(f"model.tokenizer={str(p)!r}: {e}") from e
    raise ConfigError(
        f"model.tokenizer={str(path_or_name)!r}: use 'char' (built in) or a local directory "
        "holding tokenizer.json (models are never downloaded)"
    )
