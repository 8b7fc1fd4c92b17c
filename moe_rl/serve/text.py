"""Text for ``moe-rl serve``: the run's tokenizer, chat templates and stop strings (no HTTP, no engine).

The server holds a tokenizer unless it runs with ``--skip-tokenizer-init`` or its engine has none
(:func:`moe_rl.serve.embedded.build_engine` attaches the model's: ``model.tokenizer`` of a recipe,
or the ``tokenizer.json`` of an HF checkpoint directory). With one:

- ``/generate`` takes ``text`` (a string or a list of them) as SGLang does, and every output carries
  ``text``, the decoded ``output_ids`` (special tokens dropped, ``skip_special_tokens``);
- ``stop`` strings end a completion as in SGLang: the output ends at the token that completed
  the first stop string, its ``text`` is cut before that string (``no_stop_trim`` keeps it) and
  ``finish_reason`` is ``{"type": "stop", "matched": "<the string>"}``. The engine has no stop
  strings, so the tokens after the match are generated and then dropped;
- chat messages are rendered with the tokenizer's chat template (``chat_template`` of
  ``tokenizer_config.json``, or ``chat_template.jinja``, in the tokenizer directory; rendered as
  ``transformers`` renders them: a sandboxed Jinja environment, ``messages``,
  ``add_generation_prompt=True``, ``bos_token`` / ``eos_token``). A tokenizer without a template (the
  built-in character tokenizer) gets :data:`SIMPLE_CHAT_TEMPLATE`: one ``"<role>: <content>\\n"``
  line per message, then ``"assistant:"``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe_rl.serve.protocol import BadRequest

SIMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"The chat template of a tokenizer that has none: ``role: content`` lines, then ``assistant:``."


def _chat_template(directory: Path | None) -> tuple[str | None, dict[str, str]]:
    """(the chat template of a tokenizer directory or None, its special-token strings)."""
    if directory is None:
        return None, {}
    names: dict[str, str] = {}
    template = None
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
        f = directory / fname
        if not f.is_file():
            continue
        data = json.loads(f.read_text(encoding="utf-8"))
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = data.get(key)
            if value is not None:
                names[key] = value["content"] if isinstance(value, dict) else value
        found = data.get("chat_template")
        if isinstance(found, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
            found = by_name.get("default") or next(iter(by_name.values()), None)
        if isinstance(found, str):
            template = found
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template, names


class ServeTokenizer:
    """The served model's tokenizer: encode, decode, chat rendering and stop strings."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        path = getattr(tokenizer, "path", None)
        self.chat_template, self.special = _chat_template(Path(path) if path else None)
        self._compiled: Any = None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of chat ``messages`` (``role`` and ``content`` strings), ready for the reply."""
        if self._compiled is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._compiled = env.from_string(self.chat_template or SIMPLE_CHAT_TEMPLATE)
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as e:
            raise BadRequest(f"body.messages: the chat template refused them: {e}") from None

    def cut_at_stop(
        self, ids: list[int], stops: Sequence[str], skip_special_tokens: bool = True, trim: bool = True
    ) -> tuple[int, str, str | None]:
        """(tokens kept, their text, the stop string matched or None) of a completion ``ids``.

        Kept: the shortest prefix whose text holds a stop string (the earliest one in the text);
        its text ends before that string when ``trim``, else after it."""
        text = self.decode(ids, skip_special_tokens)
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if not hits:
            return len(ids), text, None
        at, stop = min(hits)
        lo, hi = 1, len(ids)  # shortest prefix whose text contains the stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in self.decode(ids[:mid], skip_special_tokens):
                hi = mid
            else:
                lo = mid + 1
        return lo, text[: at if trim else at + len(stop)], stop
