"""moe-rl: reinforcement learning of Mixture-of-Experts language models on megatron-core.

``import moe_rl`` is cheap: it needs only torch-free modules; megatron-core, triton and
sglang are imported inside the modules that use them.
"""

__version__ = "0.1.0"

# The Python API (docs/api.md; each name is imported when first used, so that ``import moe_rl``
# stays cheap):
#   recipe = moe_rl.load_recipe("recipes/tiny.yaml", ["optim.lr=3e-4"])   # or moe_rl.recipe_from_dict({...})
#   results = moe_rl.train(recipe)                 # every stage, as `moe-rl train` runs it
#   results = moe_rl.train(recipe, data=rows, reward=my_reward)   # your prompts and reward function
#   moe_rl.read_metrics(recipe.train.out_dir)      # every row of metrics.jsonl
#   moe_rl.evaluate(recipe)                        # held-out greedy accuracy of the newest checkpoint
#   run = moe_rl.Run(recipe); run.ensure_engine()  # or drive the stages yourself
_API = {
    "load_recipe": "moe_rl.config",
    "recipe_from_dict": "moe_rl.config",
    "Recipe": "moe_rl.config",
    "ConfigError": "moe_rl.config",
    "Run": "moe_rl.trainer.context",
    "train": "moe_rl.api",
    "evaluate": "moe_rl.api",
    "read_metrics": "moe_rl.api",
    "with_data": "moe_rl.api",
    "rl_step": "moe_rl.trainer.rl",
    "LOSSES": "moe_rl.losses",
    "TASKS": "moe_rl.tasks",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'moe_rl' has no attribute {name!r}")
    import importlib

    where = _API[name]
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
