"""The OpenAI-compatible endpoints of ``moe-rl serve``: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

As SGLang offers them (``srt/entrypoints/openai/protocol.py``, ``serving_completions.py``,
``serving_chat.py``, ``usage_processor.py``, sgl-project/sglang 0.5.23), without streaming. Each
request becomes one native ``/generate`` of ``n`` rows per prompt (so it shares the limits, the
pause gate and the micro-batching), and its outputs become the OpenAI objects:

- requests: ``model`` (the id ``/v1/models`` lists, or its last path component, echoed back;
  omitted: the one served; another: 404 with OpenAI's ``model_not_found`` error), ``prompt`` (a string, a list of
  strings, token ids or a list of them) or ``messages`` (``role`` + ``content``, a string or text
  parts, rendered by the tokenizer's chat template, see :mod:`.text`), ``max_tokens`` (completions:
  16; chat: ``max_completion_tokens`` or ``max_tokens``, else the rest of the model's context),
  ``temperature``, ``top_p``, ``top_k``, ``n``, ``stop`` (string or list), ``stop_token_ids``,
  ``ignore_eos``, ``skip_special_tokens``, ``seed`` (choice ``j`` of a prompt samples with
  ``seed + j``), ``echo`` (completions), ``stream`` (false only: ``true`` is a 400 saying streaming
  is not implemented). Fields OpenAI clients send at their neutral value (``logprobs``,
  penalties, ``logit_bias``, ``tools``...) are accepted there and refused (400 naming the field)
  otherwise; other fields are ignored, as SGLang's pydantic models ignore them.
- responses: ``id``, ``object`` (``text_completion`` / ``chat.completion``), ``created``, ``model``,
  ``choices`` (``index`` prompt-major, ``prompt * n + j``; ``text`` or ``message{role, content}``;
  ``finish_reason`` ``stop`` / ``length`` / ``abort``; ``matched_stop``: the stop string or token
  id), ``usage`` (``prompt_tokens`` counted once per prompt, ``completion_tokens`` summed over
  choices, ``total_tokens``).
- errors: SGLang's ErrorResponse (``{"object": "error", "message", "type", "param", "code"}``), the
  message naming the field; every endpoint but ``/v1/models`` needs the tokenizer (400 without).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from moe_rl.serve.limits import limit_message
from moe_rl.serve.protocol import MAX_SEED, BadRequest, ModelNotFound, check_kind, get_field, get_number

# field -> the values accepted (a client sends these; anything else is not implemented).
_COMMON_NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "regex": (),
    "ebnf": (),
    "response_format": ({"type": "text"},),
    "stop_regex": ([],),
    "return_routed_experts": (False,),
    "return_hidden_states": (False,),
    "lora_path": (),
    "custom_logit_processor": (),
}
_COMPLETION_NEUTRAL = {**_COMMON_NEUTRAL, "json_schema": (), "logprobs": (), "suffix": ("",), "best_of": ()}
_CHAT_NEUTRAL = {
    **_COMMON_NEUTRAL,
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
}
_SAMPLING = ("model", "n", "stream", "stop", "seed", "temperature", "top_p", "top_k", "stop_token_ids")
_SAMPLING += ("ignore_eos", "skip_special_tokens", "no_stop_trim")
COMPLETION_FIELDS = (*_SAMPLING, "prompt", "max_tokens", "echo", *_COMPLETION_NEUTRAL)
"The request fields /v1/completions reads (SGLang's CompletionRequest has each; the tests check)."
CHAT_FIELDS = (*_SAMPLING, "messages", "max_completion_tokens", "max_tokens", *_CHAT_NEUTRAL)
"The request fields /v1/chat/completions reads (SGLang's ChatCompletionRequest has each)."


def _refuse_unsupported(body: dict, neutral: dict[str, tuple]) -> None:
    for key, ok in neutral.items():
        value = body.get(key)
        if value is not None and not any(value == v and type(value) is type(v) for v in ok):
            if key == "best_of" and value == body.get("n", 1):
                continue
            raise BadRequest(f"body.{key}={json.dumps(value)[:80]} is not supported by moe-rl serve")


class OpenAIEndpoints:
    """Needs from the app: ``text`` (ServeTokenizer or None), ``model_path``, ``engine``, ``limits``,
    ``generate()``, ``check_token_ids()``."""

    def v1_models(self, body: dict) -> tuple[int, Any]:
        context = int(getattr(self.engine, "max_context_length", 0) or 0)
        card = {
            "id": self.model_path,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "moe-rl",
            "root": self.model_path,
            "parent": None,
            "max_model_len": context or None,
        }
        return 200, {"object": "list", "data": [card]}

    # ----------------------------------------------------------------- requests
    def _check_model(self, model: str) -> None:
        """``model`` is the one served (the id ``/v1/models`` lists, or its last path component), or
        none (omitted or empty, as SGLang takes it); another is a 404 as OpenAI answers it."""
        served = str(self.model_path)
        if model and model not in (served, served.rstrip("/").rsplit("/", 1)[-1]):
            raise ModelNotFound(
                f"The model `{model}` does not exist: this server serves `{served}` (GET /v1/models)"
            )

    def _need_tokenizer(self, path: str) -> None:
        if self.text is None:
            raise BadRequest(
                f"{path} needs the model's tokenizer and this server has none (started with "
                "--skip-tokenizer-init, or its engine has none): use /generate with input_ids"
            )

    def _openai_sampling(
        self, body: dict, max_tokens: int, max_field: str = "max_tokens"
    ) -> tuple[dict, int, int | None]:
        """(SGLang sampling_params, n, seed) of an OpenAI request."""
        if get_field(body, "stream", "bool", False):
            raise BadRequest(
                "body.stream: streaming is not implemented by moe-rl serve; send stream=false (or omit it)"
            )
        self._check_model(get_field(body, "model", "str", ""))
        n = get_number(body, "n", "int", 1, lo=1)
        if max_tokens < 1:
            raise BadRequest(f"body.{max_field}={max_tokens}: expected an integer >= 1")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and not check_kind(stop, "list[str]"):
            raise BadRequest(
                f"body.stop: expected a string or a list of strings, got {json.dumps(stop)[:80]}"
            )
        sp = {
            "max_new_tokens": max_tokens,
            "temperature": get_number(body, "temperature", "num", 1.0, lo=0),
            "top_p": get_number(body, "top_p", "num", 1.0, lo=0, hi=1, above=True),
            "top_k": get_field(body, "top_k", "int", -1),
            "stop": stop or None,
            "stop_token_ids": get_field(body, "stop_token_ids", "list[int]", []),
            "ignore_eos": get_field(body, "ignore_eos", "bool", False),
            "skip_special_tokens": get_field(body, "skip_special_tokens", "bool", True),
            "no_stop_trim": get_field(body, "no_stop_trim", "bool", False),
        }
        return sp, n, get_number(body, "seed", "int", None, lo=0, hi=MAX_SEED - (n - 1))

    def _check_budget(self, prompts: list[list[int]], n: int, max_tokens: int, max_field: str) -> None:
        """Refuse, before a row is built, a request that ``n`` multiplies past the server's limits:
        ``len(prompts) * n`` rows, ``n * sum(prompt + max_tokens)`` tokens (400 naming the fields)."""
        lim = self.limits
        rows, tokens = len(prompts) * n, n * sum(len(p) + max_tokens for p in prompts)
        if rows > lim.max_running_requests:
            what = f"body.n={n} x {len(prompts)} prompt(s): rows"
            raise BadRequest(limit_message(what, rows, "max_running_requests", lim))
        if tokens > lim.max_total_tokens:
            what = f"body.n={n} x (prompt + body.{max_field}={max_tokens}) tokens"
            raise BadRequest(limit_message(what, tokens, "max_total_tokens", lim))
        self.check_token_ids(prompts, "body.prompt")

    def _run_openai(
        self, prompts: list[list[int]], sp: dict | list[dict], n: int, seed: int | None, prefix: str
    ) -> tuple[str, list[dict]]:
        """(response id, the /generate outputs, prompt-major: prompt i's choice j at i * n + j)."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        rows, params, rids = [], [], []
        for i, (p, s) in enumerate(zip(prompts, sps)):
            for j in range(n):
                rows.append(p)
                params.append(s if seed is None else {**s, "sampling_seed": seed + j})
                rids.append(f"{rid}-{i * n + j}")
        status, out = self.generate({"input_ids": rows, "sampling_params": params, "rid": rids})
        if status != 200:
            raise BadRequest(
                out["error"]["message"] if isinstance(out, dict) and "error" in out else str(out)
            )
        return rid, out

    @staticmethod
    def _finish(item: dict) -> tuple[str | None, Any]:
        fr = item["meta_info"]["finish_reason"] or {}
        return fr.get("type"), fr.get("matched")

    @staticmethod
    def _usage(prompts: list[list[int]], items: list[dict]) -> dict:
        prompt = sum(len(p) for p in prompts)
        completion = sum(it["meta_info"]["completion_tokens"] for it in items)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ----------------------------------------------------------------- /v1/completions
    def v1_completions(self, body: dict) -> tuple[int, Any]:
        self._need_tokenizer("/v1/completions")
        _refuse_unsupported(body, _COMPLETION_NEUTRAL)
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("body.prompt: field required")
        max_tokens = get_field(body, "max_tokens", "int", 16)
        sp, n, seed = self._openai_sampling(body, max_tokens)
        if isinstance(prompt, str) or check_kind(prompt, "list[str]") and prompt:
            texts = [prompt] if isinstance(prompt, str) else prompt
            self._check_budget([[]] * len(texts), n, max_tokens, "max_tokens")  # rows, before encoding
            prompts = [self.text.encode(t) for t in texts]
        elif check_kind(prompt, "list[int]") and prompt or check_kind(prompt, "list[list[int]]") and prompt:
            prompts = [prompt] if check_kind(prompt, "list[int]") else prompt
            self._check_budget([[]] * len(prompts), n, max_tokens, "max_tokens")
            self.check_token_ids(prompts, "body.prompt")  # before they are decoded
            texts = [self.text.decode(p) for p in prompts]
        else:
            raise BadRequest(
                "body.prompt: expected a string, a list of strings, a list of token ids or a list of them"
            )
        for i, p in enumerate(prompts):
            if not p:
                raise BadRequest(f"body.prompt[{i}]: empty (no tokens)")
        self._check_budget(prompts, n, max_tokens, "max_tokens")
        echo = get_field(body, "echo", "bool", False)
        rid, items = self._run_openai(prompts, sp, n, seed, "cmpl")
        choices = []
        for k, it in enumerate(items):
            reason, matched = self._finish(it)
            text = (texts[k // n] if echo else "") + it["text"]
            choices.append(
                {"index": k, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
            )
        return 200, {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_path,
            "choices": choices,
            "usage": self._usage(prompts, items),
        }

    # ----------------------------------------------------------------- /v1/chat/completions
    def _messages(self, body: dict) -> list[dict[str, str]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("body.messages: expected a non-empty list of {role, content} objects")
        out = []
        for i, m in enumerate(messages):
            where = f"body.messages[{i}]"
            if not isinstance(m, dict):
                raise BadRequest(f"{where}: expected an object with role and content")
            role = get_field(m, "role", "str", where=where)
            content = m.get("content")
            if content is None:
                content = ""
            if isinstance(content, list):  # text parts: [{"type": "text", "text": "..."}]
                parts = []
                for j, part in enumerate(content):
                    if not (isinstance(part, dict) and part.get("type") == "text"):
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise BadRequest(f"{where}.content[{j}]: only text parts are supported, got {kind}")
                    parts.append(get_field(part, "text", "str", where=f"{where}.content[{j}]"))
                content = "".join(parts)
            if not isinstance(content, str):
                raise BadRequest(f"{where}.content: expected a string or a list of text parts")
            out.append(
                {
                    **{k: v for k, v in m.items() if k not in ("role", "content")},
                    "role": role,
                    "content": content,
                }
            )
        return out

    def v1_chat_completions(self, body: dict) -> tuple[int, Any]:
        self._need_tokenizer("/v1/chat/completions")
        _refuse_unsupported(body, _CHAT_NEUTRAL)
        prompt = self.text.encode(self.text.render_chat(self._messages(body)))
        if not prompt:
            raise BadRequest("body.messages: the rendered chat encodes to no tokens")
        max_field = "max_completion_tokens"
        max_tokens = get_field(body, max_field, "int", None)
        if max_tokens is None:
            max_field = "max_tokens"
            max_tokens = get_field(body, max_field, "int", None)
        if max_tokens is None:  # SGLang: up to the model's context length
            context = int(getattr(self.engine, "max_context_length", 0) or 0)
            max_tokens = max(1, context - len(prompt)) if context else 128
        sp, n, seed = self._openai_sampling(body, max_tokens, max_field)
        self._check_budget([prompt], n, max_tokens, max_field)
        rid, items = self._run_openai([prompt], sp, n, seed, "chatcmpl")
        choices = []
        for k, it in enumerate(items):
            reason, matched = self._finish(it)
            choices.append(
                {
                    "index": k,
                    "message": {"role": "assistant", "content": it["text"]},
                    "logprobs": None,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
        return 200, {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_path,
            "choices": choices,
            "usage": self._usage([prompt], items),
        }
