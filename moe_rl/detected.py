"""What ``moe-rl check`` found out about a recipe, in a few lines (its closing summary): the model and
where its weights come from, the tokenizer and how it was chosen, the task's data layout and prompt
form, the reward function's signature, and what the run will do. Each line is a YAML comment, so
``moe-rl check``'s output stays a YAML document.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_rl.config import Recipe


def _model(recipe: Recipe) -> str:
    m = recipe.model
    shape = (
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts top-{m.moe_router_topk}, "
        f"vocabulary {m.vocab_size}, {m.dtype}"
    )
    if m.hf_path:
        where = f"weights and architecture from model.hf_path={m.hf_path} (its config.json)"
    else:
        where = f"random weights (model.seed {m.seed})"
    if recipe.checkpoint.load:
        where += f", then checkpoint.load={recipe.checkpoint.load}"
    return f"model: {shape}; {where}"


def _tokenizer(recipe: Recipe, tok: Any) -> str:
    m = recipe.model
    if m.tokenizer == "char":
        how = "the built-in character tokenizer"
        if m.hf_path:
            how += f" (model.hf_path={m.hf_path} holds it, or no tokenizer.json)"
        return f"tokenizer: {how}, {tok.vocab_size} ids"
    source = "model.hf_path's own" if m.tokenizer == m.hf_path else "model.tokenizer"
    template = "with a chat template" if getattr(tok, "chat_template", None) else "without a chat template"
    return (
        f"tokenizer: {m.tokenizer} ({source}; Hugging Face tokenizer.json), {tok.vocab_size} ids, {template}"
    )


def _task(recipe: Recipe, tok: Any, task: Any) -> list[str]:
    name = recipe.task.name
    n = recipe.train.eval_prompts
    if name != "jsonl":
        return [
            f"task: {name} (built in, prompts generated from task.seed); evaluation on {n} held-out prompts"
        ]
    c = recipe.task.jsonl
    row = task.sample(0, 1, recipe.task.seed)[0].metadata["row"]
    layout = (
        "verl's RL layout (data_source, prompt, reward_model.ground_truth)"
        if row.layout == "verl"
        else f"the plain layout ({c.prompt_field}, {c.answer_field})"
    )
    if isinstance(row.prompt, list):
        chat = (
            "with the tokenizer's chat template"
            if getattr(tok, "chat_template", None)
            else "as role: content lines"
        )
        prompts = f"chat messages, rendered {chat}"
    else:
        prompts = "strings"
    held = (
        "task.jsonl.heldout_path"
        if c.heldout_path
        else f"task.heldout_fraction {recipe.task.heldout_fraction}"
    )
    sft = f"; SFT demonstrations from {c.response_field}" if c.response_field else ""
    reward = task.reward_fn
    batched = ", batched (lists in, a list out)" if c.reward_batched else ""
    return [
        f"data: {c.path}: {task.num_train} training prompts in {layout}; prompts are {prompts}{sft}",
        f"held-out: {len(task.heldout(n))} of train.eval_prompts={n} prompts ({held})",
        f"reward: {c.reward_fn}, {reward.kind} signature{batched}",
    ]


def _run(recipe: Recipe) -> str:
    t, a, p = recipe.train, recipe.algo, recipe.parallel
    steps = {"sft": t.sft_steps, "rl": t.rl_steps}
    stages = " then ".join(f"{s} ({steps[s]} steps)" for s in t.stages)
    kl = "none"
    if a.kl_coef or a.kl_reward_coef:
        kl = f"{a.kl_estimator} to the RL start, loss x{a.kl_coef}, reward x{a.kl_reward_coef}"
    layout = (
        f"{p.world_size} process(es): tp {p.tensor_parallel}, ep {p.expert_parallel}, dp {p.data_parallel}"
    )
    return (
        f"run: {stages}; {a.name} with routing {a.routing}; KL: {kl}; {layout}; rollouts: {recipe.rollout.engine}; "
        f"writes into {t.out_dir}"
    )


def detected(recipe: Recipe, tok: Any = None, task: Any = None) -> list[str]:
    """The summary's lines (without the leading ``# ``); ``tok`` and ``task`` as preflight built
    them (None when the tokenizer is not on this machine: then only what the recipe says)."""
    lines = [_model(recipe)]
    if tok is None:
        lines.append(f"tokenizer: model.tokenizer={recipe.model.tokenizer} is not on this machine: not read")
    else:
        lines.append(_tokenizer(recipe, tok))
        lines += _task(recipe, tok, task)
    lines.append(_run(recipe))
    return lines
