"""Checks of a recipe against what it will meet, run before any process group or stage starts.

:func:`moe_rl.config.load_recipe` checks every field on its own and across sections. What
needs the tokenizer, the task's data or the files it starts from is checked here:
``model.hf_path`` is a checkpoint directory with ``config.json`` and its weights, the vocabulary holds the tokenizer,
the longest prompt plus ``train.max_new_tokens`` fits ``model.max_seq_len``, and evaluation
has held-out prompts for every data-parallel rank, prompts hold no characters the tokenizer lacks
(a warning: they would become ``<unk>``), an attached SGLang server returns routed
experts when ``algo.routing=r3`` replays them (its ``server_info`` says), and the RL stage's
engine can run the layout (the embedded engine decodes at TP 1 only: refused here, before SFT,
not when RL begins). Each failure is a
:class:`moe_rl.config.ConfigError` naming the fields and the fix.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.configlib import ConfigError, require
from moe_rl.errors import Unavailable
from moe_rl.hf_arch import fields_from_hf, read_config_json
from moe_rl.tasks import build_task, load_tokenizer

if TYPE_CHECKING:
    from moe_rl.config import Recipe
    from moe_rl.tasks.base import Task
    from moe_rl.tasks.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def check_vocab(recipe: Recipe, tok: Tokenizer) -> None:
    """``model.vocab_size`` holds every id of the tokenizer; and a model read from ``model.hf_path``
    (a trained vocabulary) has no more than twice the tokenizer's ids: real models pad their
    vocabulary by well under 1% (Qwen3: 151,936 rows for 151,669 ids), so a tokenizer reaching less
    than half of it is another model's (the character tokenizer on a Qwen3 folder)."""
    m = recipe.model
    require(
        m.vocab_size >= tok.vocab_size,
        f"model.hf_path={m.hf_path}'s model.vocab_size={m.vocab_size} is smaller than the tokenizer's "
        f"{tok.vocab_size} ids (model.tokenizer={m.tokenizer}): give the model's own tokenizer "
        "(model.tokenizer=DIR, or leave it unset to take model.hf_path's)"
        if m.hf_path
        else f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {tok.vocab_size} ids: "
        f"set model.vocab_size={tok.vocab_size} (rounded up to a multiple of tensor_parallel)",
    )
    require(
        not m.hf_path or 2 * tok.vocab_size > m.vocab_size,
        f"model.tokenizer={m.tokenizer} has {tok.vocab_size} ids and model.hf_path={m.hf_path} a vocabulary "
        f"of {m.vocab_size}: they disagree (the tokenizer reaches under half of the model's rows); give the "
        "model's own tokenizer: model.tokenizer=DIR (the folder holding its tokenizer.json), or leave "
        "model.tokenizer unset to take model.hf_path's",
    )


def longest_prompt_tokens(task: Task, tok: Tokenizer) -> int:
    """Tokens of the task's longest prompt as the trainer encodes it (``<bos>`` included)."""
    bos = 1 if getattr(tok, "bos_id", None) is not None else 0
    return bos + max((len(tok.encode(t)) for t in task.longest_prompts()), default=0)


def check_lengths(recipe: Recipe, task: Task, tok: Tokenizer) -> None:
    """RL prompts plus ``train.max_new_tokens`` fit ``model.max_seq_len`` (else rollouts fail mid-run)."""
    if "rl" not in recipe.train.stages:
        return
    if not hasattr(task, "longest_prompts"):  # a task registered from outside, without the bound
        log.info("task %s gives no prompt bound: prompt lengths are checked at generation", recipe.task.name)
        return
    longest, new, cap = (
        longest_prompt_tokens(task, tok),
        recipe.train.max_new_tokens,
        recipe.model.max_seq_len,
    )
    require(
        longest + new <= cap,
        f"task {recipe.task.name}: the longest prompt ({longest} tokens) + train.max_new_tokens={new} exceeds "
        f"model.max_seq_len={cap}: lower train.max_new_tokens to {max(cap - longest, 0)}, raise "
        f"model.max_seq_len to {longest + new}, or shorten the prompts",
    )


def check_unknown_chars(recipe: Recipe, task: Task, tok: Tokenizer) -> list[str]:
    """Warn when the task's prompts hold characters the (character) tokenizer lacks: each becomes
    ``<unk>``, so the policy cannot read them (CJK or emoji under the built-in tokenizer). The
    characters, most frequent first (at most 10)."""
    if not hasattr(tok, "unknown_chars") or not hasattr(task, "longest_prompts"):
        return []
    counts: dict[str, int] = {}
    prompts = 0
    for text in task.longest_prompts():
        unknown = tok.unknown_chars(text)
        prompts += bool(unknown)
        for c in unknown:
            counts[c] = counts.get(c, 0) + 1
    if not counts:
        return []
    top = sorted(counts, key=lambda c: (-counts[c], c))[:10]
    log.warning(
        "task %s: %d prompts hold %d characters the %s tokenizer lacks (%s): each becomes <unk> and the "
        "policy cannot read it; use a Hugging Face tokenizer (model.tokenizer=DIR) or clean the data",
        recipe.task.name,
        prompts,
        len(counts),
        recipe.model.tokenizer,
        " ".join(repr(c) for c in top),
    )
    return top


def check_heldout(recipe: Recipe, task: Task) -> None:
    """Evaluation (at the end of RL, and every ``train.eval_every``) has a prompt for every DP rank."""
    if "rl" not in recipe.train.stages:
        return
    dp, asked = recipe.parallel.data_parallel, recipe.train.eval_prompts
    n = len(task.heldout(asked))
    if asked < dp:
        fix = f"raise train.eval_prompts to at least {dp}"
    elif recipe.task.name == "jsonl":
        fix = "set task.jsonl.heldout_path to a held-out JSONL file, or raise task.heldout_fraction"
    else:
        fix = "raise task.heldout_fraction"
    require(
        n >= dp,
        f"task {recipe.task.name}: {n} held-out prompts for evaluation, fewer than parallel.data_parallel={dp} "
        f"(the accuracy would be NaN): {fix}",
    )
    if n % dp:
        log.warning("evaluation uses %d of %d held-out prompts (a multiple of data_parallel)", n - n % dp, n)


def check_routes_served(recipe: Recipe) -> None:
    """R3 against attached SGLang servers: each must have been started with routed experts on.

    Launched engines get ``--enable-return-routed-experts`` from the launcher; a server that does
    not answer is left to engine setup (it may still be starting)."""
    cfg = recipe.rollout.sglang
    if recipe.rollout.engine != "sglang" or not recipe.algo.routing.wants_engine_routes:
        return
    urls = [u for field, u in attached_urls(recipe) if field != "rollout.sglang.router_url"]
    from moe_rl.rollout.sglang_client import SGLangClient
    from moe_rl.rollout.sglang_protocol import SGLangError

    for url in urls:
        try:
            info = SGLangClient(
                url, api_key=cfg.admin_api_key or cfg.api_key, timeout_s=10, retries=0
            ).server_info()
        except (SGLangError, OSError) as e:
            log.warning("could not ask %s whether it returns routed experts (%s); engine setup will", url, e)
            continue
        require(
            info.get("enable_return_routed_experts") is not False,
            f"algo.routing=r3 replays the rollout engine's routes, but the SGLang server at {url} was started "
            "without --enable-return-routed-experts: restart it with that flag, or use algo.routing=r2",
        )


def attached_urls(recipe: Recipe) -> list[tuple[str, str]]:
    """``(field, url)`` of every SGLang server or router the recipe attaches to (none launched)."""
    cfg = recipe.rollout.sglang
    if recipe.rollout.engine != "sglang":
        return []
    urls = [("rollout.sglang.url", cfg.url)] if cfg.url else []
    if isinstance(cfg.engines, list):
        urls += [(f"rollout.sglang.engines[{i}]", u) for i, u in enumerate(cfg.engines)]
    if cfg.router_url:
        urls.append(("rollout.sglang.router_url", cfg.router_url))
    return urls


def check_services(recipe: Recipe, timeout_s: float = 10.0) -> None:
    """Every SGLang server or router the recipe attaches to answers ``/health`` now: an
    :class:`~moe_rl.errors.Unavailable` naming the field and the URL otherwise. For commands that
    would train for minutes (an SFT start) before the RL stage first asks them."""
    from moe_rl.rollout.sglang_client import SGLangClient
    from moe_rl.rollout.sglang_protocol import SGLangError

    cfg = recipe.rollout.sglang
    for field, url in attached_urls(recipe):
        client = SGLangClient(url, api_key=cfg.api_key, timeout_s=timeout_s, retries=0)
        try:
            client.health(timeout_s=timeout_s)
        except (SGLangError, OSError) as e:
            raise Unavailable(
                f"{field}={url}: no SGLang server answers /health ({type(e).__name__}: {str(e)[:120]}); "
                "checked before anything trains"
            ) from None
        finally:
            client.close()


def check_hf_path(recipe: Recipe) -> None:
    """``model.hf_path``, when set, is a Hugging Face Qwen3-MoE checkpoint directory: it exists,
    its ``config.json`` reads as a supported config, and its safetensors weights are there (the
    shards ``model.safetensors.index.json`` lists, else ``*.safetensors``). Whether every tensor
    fits the model is checked when the policy is built (from the files' headers)."""
    path = recipe.model.hf_path
    if not path:
        return
    try:
        fields_from_hf(read_config_json(path))
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(
            msg if msg.startswith("model.hf_path=") else f"model.hf_path={path}: {msg}"
        ) from None
    folder, index = Path(path), Path(path) / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"model.hf_path={path}: {index.name} is unreadable ({e!r})") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        require(
            not missing,
            f"model.hf_path={path}: {len(missing)} of the {len(shards)} weight files {index.name} lists "
            f"are missing ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}): copy the whole "
            "checkpoint directory",
        )
        return
    require(
        any(folder.glob("*.safetensors")),
        f"model.hf_path={path} has config.json but no weights (no {index.name}, no *.safetensors): "
        "copy the whole checkpoint directory (moe-rl reads safetensors only)",
    )


def preflight(recipe: Recipe) -> tuple[Tokenizer, Task]:
    """The tokenizer and task of ``recipe``, after every check that needs them (see the module)."""
    check_hf_path(recipe)
    tok = load_tokenizer(recipe.model.tokenizer)
    check_vocab(recipe, tok)
    task = build_task(recipe.task, tok)
    check_lengths(recipe, task, tok)
    check_unknown_chars(recipe, task, tok)
    check_heldout(recipe, task)
    check_routes_served(recipe)
    check_engine_layout(recipe)
    return tok, task


def check_engine_layout(recipe: Recipe) -> None:
    """The RL stage's embedded engine needs ``parallel.tensor_parallel=1``."""
    tp = recipe.parallel.tensor_parallel
    require(
        tp == 1 or recipe.rollout.engine != "embedded" or "rl" not in recipe.train.stages,
        f"parallel.tensor_parallel={tp} with rollout.engine=embedded: the embedded engine decodes at "
        "TP 1 only (megatron's sequence parallelism splits the sequence over TP ranks); use "
        "tensor_parallel=1 (expert and data parallelism work) or rollout.engine=sglang",
    )
