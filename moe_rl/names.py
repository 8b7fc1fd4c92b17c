"""Plain data under the recipe: the names a recipe may choose, and the constants it fills in.

``moe_rl.config`` validates ``algo.name``, ``task.name`` and ``algo.rollout_correction``
against these lists instead of importing the registries (``moe_rl.losses.LOSSES``,
``moe_rl.tasks.TASKS``, ``moe_rl.losses.corrections``), which need torch and the tasks.
``tests/unit/test_layering.py`` checks that each list equals its registry's keys. The
losses import their clip bands and correction constants from here: one definition.

Only the standard library is imported: nothing here may import torch or another module
of the package.
"""

from __future__ import annotations

LOSS_NAMES = ("grpo", "gspo", "gspo_token")
"Valid algo.name values: the keys of moe_rl.losses.LOSSES."
PAPER_CLIP = {"grpo": (0.2, 0.27), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4)}
"""(eps_low, eps_high) of each loss when algo.eps_low / eps_high are None: GRPO's band is DAPO's
clip-higher [0.2, 0.27]; GSPO's is the GSPO paper's. moe_rl.losses.LOSSES is built from it."""
TOKEN_RATIO_LOSSES = ("grpo", "gspo_token")
"Losses that clip one importance ratio per token (gspo clips one per sequence)."

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Valid algo.kl_estimator values (moe_rl.losses.kl.ESTIMATORS): with d = log pi_ref - log pi_theta,
k1 = -d, k2 = d^2 / 2, k3 = e^d - 1 - d (verl's kl / mse / low_var_kl, TRL's beta uses k3)."""

TASK_NAMES = ("arithmetic", "countdown", "jsonl")
"Valid task.name values: the keys of moe_rl.tasks.TASKS."

LOGGERS = {
    "jsonl": None,
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}
"""Valid train.loggers values -> (the module the tracker imports, the pip package that provides it);
jsonl is the sink's own file. The other keys are those of moe_rl.trainer.trackers.TRACKERS."""
DEFAULT_LOGGERS = ("jsonl", "tensorboard")
"train.loggers when a recipe names none: metrics.jsonl and TensorBoard."

CORRECTIONS = ("none", "tis", "seq_tis", "icepop", "icepop_mask", "geo_mask")
"Valid values of algo.rollout_correction (moe_rl.losses.corrections implements them)."
TOKEN_LEVEL = ("tis", "icepop", "icepop_mask")
"Corrections with one weight per token ([B, T])."
SEQUENCE_LEVEL = ("seq_tis", "geo_mask")
"Corrections with one weight per sequence ([B])."
DEFAULT_BOUNDS = {"icepop": (0.5, 5.0), "icepop_mask": (0.5, 5.0), "geo_mask": (1 / 1.001, 1.001)}
"""Bounds (low, high) of icepop and icepop_mask (IcePop's [0.5, 5] on rho) and geo_mask (verl's
decoupled_geo_rs: the geometric mean of rho within 1.001 of 1) when the config leaves them None."""
