"""Held-out evaluations are counted once per weights evaluated (issue 31: the learning rule read the
last periodic evaluation, logged at step 99, and the final one, on the same weights, at 100)."""

from __future__ import annotations

from moe_rl.lab.report import eval_rows


def test_periodic_evaluations_sit_at_their_update_count_and_the_final_one_is_not_repeated():
    rows = [
        {"stage": "rl_eval", "step": 0, "eval/accuracy": 0.5},
        {"stage": "rl", "step": 0, "reward/mean": 0.1},
        {"stage": "rl", "step": 1, "eval/accuracy": 0.6},
        {"stage": "rl", "step": 2},
        {"stage": "rl", "step": 3, "eval/accuracy": 0.7},
        {"stage": "rl_eval", "step": 4, "eval/accuracy": 0.7},
    ]
    got = [(r["step"], r["eval/accuracy"]) for r in eval_rows(rows)]
    assert got == [(0, 0.5), (2, 0.6), (4, 0.7)]


def test_a_run_whose_last_step_was_evaluated_does_not_evaluate_it_again(tmp_path, parallel_info, monkeypatch):
    from moe_rl.lab.report import load_arm
    from moe_rl.trainer import loop
    from moe_rl.trainer.run import run
    from tests.tiny import tiny_rl_recipe

    calls = []
    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda r, step: calls.append(step) or real(r, step))
    run(tiny_rl_recipe(tmp_path / "run", train={"rl_steps": 2, "eval_every": 2, "flip_probe_sequences": 0}))
    assert calls == [0, 2]
    evals = load_arm(tmp_path / "run")["eval"]
    assert [r["step"] for r in evals] == [0, 2]
