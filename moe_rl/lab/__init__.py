"""Experiments: what runs and judges comparisons of the trainer's algorithms (the trainer never
imports this package).

- :mod:`moe_rl.lab.arms`: the arm table (GRPO, GRPO + R2 / R3 / TIS, GSPO, GSPO + R2) as recipe
  overrides, clip bands from :data:`moe_rl.losses.LOSSES`;
- :mod:`moe_rl.lab.starts`: SFT starts (shipped, cached by SFT signature, trained once);
- :mod:`moe_rl.lab.runner`: one runner (in process, child process or launcher; resume; atomic
  status files; a pool; CPU accounting);
- :mod:`moe_rl.lab.collapse`: the fixed collapse criterion and its verdict;
- :mod:`moe_rl.lab.report`: metrics read back, tables and pictures (``moe-rl report``);
- :mod:`moe_rl.lab.demo`: ``moe-rl demo``;
- :mod:`moe_rl.lab.compare`: ``moe-rl compare`` (arms x seeds on a recipe, a seed-paired table);
- :mod:`moe_rl.lab.stats`: means, least-squares fits, a run's AUC and ratio-outlier steps, paired
  differences across seeds, time-to-event;
- :mod:`moe_rl.lab.results`: result files named by machine, preset and commit, written atomically;
- :mod:`moe_rl.lab.mismatch`: one engine batch against the trainer's fp32 recompute (the mismatch
  study and the GPU check).

What only one study uses lives in that study (``studies/``); nothing here imports a study.
"""
