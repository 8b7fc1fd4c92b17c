"""``moe-rl serve``: the SGLang-protocol server around the embedded engine.

``--model-path`` takes what SGLang takes, a Hugging Face Qwen3-MoE checkpoint directory
(what ``moe-rl export`` and the disk weight sync write), or a moe-rl recipe YAML (random
init, or its ``checkpoint.load``). The server runs one process (TP 1, the embedded engine's
limit) and binds 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path


def build_engine(args):
    """Server factory: the policy from ``args.model_path`` behind an EmbeddedEngine."""
    from moe_rl.config import ConfigError, ParallelConfig, load_recipe
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.tasks import load_tokenizer

    path = Path(args.model_path)
    load = None
    if path.suffix in (".yaml", ".yml"):
        recipe = load_recipe(path)
        model_cfg, load = recipe.model, recipe.checkpoint.load
    elif (path / "config.json").is_file():
        from moe_rl.megatron.hf import model_config_from_path

        model_cfg = model_config_from_path(path)
    else:
        raise ConfigError(
            f"--model-path {path}: expected an HF checkpoint directory (config.json) or a moe-rl recipe .yaml"
        )
    par = ParallelConfig()
    info = init_parallel(par, seed=0)
    policy = build_policy(model_cfg, par, info)
    if load:
        from moe_rl.megatron.checkpoint import load_checkpoint

        load_checkpoint(load, policy.model, load_rng=False)
    policy.eval()
    tok = load_tokenizer(model_cfg.tokenizer)
    dtype = serve_dtype(args.dtype)
    return EmbeddedEngine(
        policy, pad_id=tok.pad_id, eos_id=tok.eos_id, dtype=dtype, router_dtype=args.router_dtype
    )


SGLANG_DTYPES = {
    "auto": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp32": "fp32",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp16": "fp16",
}
"SGLang's ``--dtype`` values -> ``rollout.dtype`` (auto: the checkpoint's own fp32, no copy)."


def serve_dtype(value: str) -> str:
    """The engine precision for SGLang's ``--dtype`` value, or a ConfigError naming the valid ones."""
    from moe_rl.config import ConfigError

    if value not in SGLANG_DTYPES:
        raise ConfigError(f"--dtype {value}: use one of {', '.join(SGLANG_DTYPES)}")
    return SGLANG_DTYPES[value]


def main(argv: list[str] | None = None) -> int:
    from moe_rl.serve.http import main as server_main

    return server_main(argv, factory=build_engine)


if __name__ == "__main__":
    sys.exit(main())
