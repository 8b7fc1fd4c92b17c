"""``moe-rl serve``: the SGLang-protocol server around the embedded engine.

``--model-path`` takes what SGLang takes, a Hugging Face Qwen3-MoE checkpoint directory
(what ``moe-rl export`` and the disk weight sync write), or a moe-rl recipe YAML (random
init, or its ``checkpoint.load``). The server runs one process (TP 1, the embedded engine's
limit: ``--tp-size`` / ``--ep-size`` other than 1 are refused, not ignored) and binds 127.0.0.1
unless ``--host`` says otherwise. Weights with a NaN or an infinity are refused at start, as
pushed ones are: a server on them would answer every request with token 0.
The model's tokenizer (``model.tokenizer`` of the recipe, the checkpoint directory's
``tokenizer.json``) rides on the engine as ``engine.tokenizer``: the server takes text with it
unless ``--skip-tokenizer-init`` is given.
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

    check_engine_args(args)
    path = Path(args.model_path)
    load = None
    if path.suffix in (".yaml", ".yml"):
        recipe = load_recipe(path)
        model_cfg, load = recipe.model, recipe.checkpoint.load
    elif (path / "config.json").is_file():
        from moe_rl.hf_arch import read_config_json
        from moe_rl.megatron.hf import model_config_from_path

        try:
            read_config_json(path)  # a broken config.json: one line naming it
        except ConfigError as e:
            raise ConfigError(str(e).replace("model.hf_path=", "--model-path ")) from None
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
    check_finite(policy.model, f"--model-path {path}" + (f" (checkpoint.load {load})" if load else ""))
    policy.eval()
    tok = load_tokenizer(model_cfg.tokenizer)
    dtype = serve_dtype(args.dtype)
    engine = EmbeddedEngine(
        policy, pad_id=tok.pad_id, eos_id=tok.eos_id, dtype=dtype, router_dtype=args.router_dtype
    )
    engine.tokenizer = tok  # text in /generate and the OpenAI endpoints (moe_rl.serve.text)
    return engine


def check_engine_args(args) -> None:
    """The embedded engine's flags, before anything is built: ``--tp-size`` / ``--ep-size`` 1 (it
    runs one process) and a ``--dtype`` SGLang knows; ConfigError naming the flag."""
    from moe_rl.config import ConfigError

    for flag, value in (("--tp-size", args.tp_size), ("--ep-size", args.ep_size)):
        if value != 1:
            raise ConfigError(
                f"{flag} {value}: moe-rl serve runs the embedded engine in one process (TP 1, EP 1); "
                f"drop {flag}, or serve with SGLang (rollout.sglang.module=sglang.launch_server)"
            )
    serve_dtype(args.dtype)


def check_finite(model, source: str) -> None:
    """A ConfigError naming the first parameters of ``model`` with a NaN or an infinity."""
    from moe_rl.config import ConfigError
    from moe_rl.megatron.checkpoint import non_finite_names, weights_finite

    if weights_finite(model):
        return
    bad = non_finite_names(model)
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise ConfigError(
        f"{source}: weights with NaN or infinite values ({', '.join(bad[:3])}{more}); "
        "the server would answer every request with token 0: serve a checkpoint that trained cleanly"
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

    return server_main(argv, factory=build_engine, check=check_engine_args)


if __name__ == "__main__":  # as SGLang's launch_server (rollout.sglang.module): one line for an error
    from moe_rl.argparsing import run_main

    sys.exit(run_main(main))
