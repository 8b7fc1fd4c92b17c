"""Issue 47, item 6: ``moe-rl report`` says what it cannot plot and why, and writes only a
``.png`` (and its table beside it) that no one else wrote.

It said nothing of a run without RL rows, a non-numeric value or an empty ``metrics.jsonl`` and
accepted an ``--out`` that was a run's own ``metrics.jsonl`` (refused only by the plotting library).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.badinput.conftest import assert_kept, snapshot

cli_case = pytest.mark.bad_input("cli")


def write_run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


RL = [{"stage": "rl", "step": s, "reward/mean": 0.1 * s, "flip/step/rate": 0.01 * (s + 1)} for s in range(4)]
SFT = [{"stage": "sft", "step": s, "loss": 2.0 - 0.1 * s} for s in range(4)]


@cli_case
def test_a_run_without_rl_rows_is_named_as_not_plotted(cli, tmp_path, caplog):
    rl, sft = write_run(tmp_path / "rl", RL), write_run(tmp_path / "sft", SFT)
    with caplog.at_level(logging.WARNING):
        res = cli("report", rl, sft, "--out", tmp_path / "r.png")
    assert res.code == 0, res.err
    assert "sft: not plotted: no RL rows (its rows are sft" in caplog.text
    assert (tmp_path / "r.png").stat().st_size > 1000


@cli_case
@pytest.mark.parametrize(
    ("rows", "why"),
    [([], r"holds no rows"), (SFT, r"no RL rows \(its rows are sft")],
    ids=["empty", "sft-only"],
)
def test_nothing_to_plot_is_one_line(cli, tmp_path, rows, why):
    run = write_run(tmp_path / "run", rows)
    cli("report", run, "--out", tmp_path / "r.png").one_line(
        rf"data error: nothing to plot: run: not plotted: .*{why}"
    )
    assert not (tmp_path / "r.png").exists()


@cli_case
def test_values_that_are_no_number_are_left_out_and_counted(cli, tmp_path, caplog):
    rows = [dict(r) for r in RL]
    rows[2]["reward/mean"] = "n/a"
    rows[3]["flip/step/rate"] = [1]
    run = write_run(tmp_path / "run", rows)
    with caplog.at_level(logging.WARNING):
        res = cli("report", run, "--out", tmp_path / "r.png")
    assert res.code == 0, res.err
    assert "run: 1 value(s) of reward/mean are no number: left out" in caplog.text
    assert "run: 1 value(s) of flip/step/rate are no number" in caplog.text


@cli_case
def test_out_that_is_a_runs_metrics_file_is_refused(cli, tmp_path):
    run = write_run(tmp_path / "run", RL)
    before = snapshot(tmp_path)
    cli("report", run, "--out", run / "metrics.jsonl").one_line(r"--out .*metrics\.jsonl: give a \.png path")
    assert_kept(before, tmp_path)


@cli_case
def test_out_whose_table_files_are_someone_elses_is_refused(cli, tmp_path):
    run = write_run(tmp_path / "run", RL)
    (tmp_path / "r.csv").write_text("my,own,table\n")
    before = snapshot(tmp_path)
    cli("report", run, "--out", tmp_path / "r.png").one_line(r"r\.csv exist and no earlier report wrote them")
    assert_kept(before, tmp_path)


@cli_case
def test_a_step_that_is_no_whole_number_names_the_line(cli, tmp_path):
    run = write_run(tmp_path / "run", [*RL, {"stage": "rl", "step": "5", "reward/mean": 1.0}])
    cli("report", run, "--out", tmp_path / "r.png").one_line(
        r"metrics\.jsonl:5: 'step' is '5', not a whole number"
    )
