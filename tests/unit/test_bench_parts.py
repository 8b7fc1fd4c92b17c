"""The benchmarks' parts in process: the paired overheads of throughput_report, the count flags."""

import pytest


@pytest.mark.parametrize(
    "module, argv, flag",
    [
        ("step_time", ["--threads", "0"], "--threads"),
    ],
)
def test_a_count_flag_below_one_is_a_usage_error(module, argv, flag, capsys):
    """Every count a benchmark takes is checked (a zero or negative count used to run nothing or
    fail later)."""
    import importlib

    mod = importlib.import_module(f"benchmarks.{module}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_paired_overheads_difference_only_the_phases_a_mode_changes():
    from benchmarks.throughput_report import paired_probe_fracs, paired_replay_overheads

    def steps(rollout, train, probe=(0.1, 0.1)):
        d = {"rollout": list(rollout), "old_logprob": [0.5, 0.5], "train": list(train), "probe": list(probe)}
        d["step"] = [sum(d[p][i] for p in ("rollout", "old_logprob", "train", "probe")) for i in range(2)]
        return d

    none = steps((1.0, 1.4), (2.0, 2.0))  # step 3.6, 4.0
    other = steps((1.3, 1.0), (2.036, 2.04))  # a noisier rollout, +0.036 / +0.04 s of training
    assert paired_replay_overheads(none, other, "r2") == pytest.approx(
        [0.01, 0.01]
    )  # rollout noise: not R2's
    assert paired_replay_overheads(none, other, "r3") == pytest.approx([0.336 / 3.6, -0.36 / 4.0])
    assert paired_probe_fracs(none) == pytest.approx([0.1 / 3.6, 0.1 / 4.0])
    with pytest.raises(ValueError, match="pair equal counts"):
        paired_replay_overheads(none, {k: v[:1] for k, v in other.items()}, "r2")
