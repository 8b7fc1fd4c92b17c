# ruff: noqa: F811  (the imported fixtures run_copy and finished are parameters below)
"""Issue 47's own probe: adversarial cases beyond the issue's, on every command, each as a user
would meet it (the list with verdicts is in the issue's closing note). In process, seconds each;
the few that train use the one-layer MoE of the bad-input suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from moe_rl.serve.app import SGLangProtocolApp
from tests.badinput.conftest import assert_kept, snapshot
from tests.badinput.test_nothing_lost import compare, finished, one_line, run_copy  # noqa: F401  fixtures
from tests.badinput.test_outputs_checkpoints import recipe
from tests.badinput.test_report_says import RL, write_run
from tests.unit.test_serve_bounds import CountingEngine
from tests.unit.test_serve_text import TOK

probe = pytest.mark.bad_input


# -- train ---------------------------------------------------------------------------------------
@probe("output")
def test_p01_train_out_dir_that_is_a_file(cli, tmp_path):
    (tmp_path / "run").write_text("mine")
    cli("train", recipe(tmp_path)).one_line(r"file system: EEXIST on .*run: it already exists")
    assert (tmp_path / "run").read_text() == "mine"


@probe("checkpoint")
def test_p02_checkpoint_dir_that_is_a_file(cli, tmp_path):
    (tmp_path / "ck").write_text("mine")
    cli("train", recipe(tmp_path), f"checkpoint.dir={tmp_path / 'ck'}").one_line(r"EEXIST on .*ck")
    assert (tmp_path / "ck").read_text() == "mine" and not (tmp_path / "run").exists()


@probe("checkpoint")
def test_p03_checkpoint_dir_in_a_live_runs_out_dir_is_refused(cli, tmp_path):
    from moe_rl.trainer.run_lock import hold_run_dir

    live = tmp_path / "a"
    live.mkdir()
    with hold_run_dir(live, rank=0):
        res = cli("train", recipe(tmp_path), f"checkpoint.dir={live}")
    res.one_line(r"checkpoint\.dir .*/a is in use by another run")


@probe("checkpoint")
def test_p04_train_out_dir_inside_another_runs_checkpoint_folder_is_refused(cli, run_copy):  # noqa: F811
    before = snapshot(run_copy)
    cli("train", run_copy / "r.yaml", f"train.out_dir={run_copy / 'run/checkpoints'}").one_line(
        r"train\.out_dir .*run/checkpoints is or sits inside a run's checkpoint folder"
    )
    assert_kept(before, run_copy)


@probe("checkpoint")
def test_p05_checkpoint_dir_equal_to_out_dir_trains_and_resumes(cli, tmp_path):
    r = recipe(tmp_path, sft_steps=2)
    assert cli("train", r, f"checkpoint.dir={tmp_path / 'run'}").code == 0
    assert (tmp_path / "run" / "latest").is_file()
    assert cli("train", r, f"checkpoint.dir={tmp_path / 'run'}", "train.sft_steps=4", "--resume").code == 0


@probe("checkpoint")
def test_p06_resume_with_an_unreadable_run_json_treats_the_folder_as_an_older_run(cli, run_copy):  # noqa: F811
    (run_copy / "run" / "run.json").write_text("{not json")
    res = cli("train", run_copy / "r.yaml", "train.sft_steps=6", "--resume")
    assert res.code == 0, res.err
    assert json.loads((run_copy / "run" / "run.json").read_text())["run_id"]  # written again


@probe("checkpoint")
def test_p07_fresh_twice_keeps_every_runs_checkpoints(cli, run_copy):  # noqa: F811
    from moe_rl.megatron.checkpoint import checkpoint_dirs

    owners = set()
    for _ in range(2):
        assert cli("train", run_copy / "r.yaml", "--fresh").code == 0
    for ckpt in checkpoint_dirs(run_copy / "run" / "checkpoints"):
        owners.add(json.loads((ckpt / "meta.json").read_text())["owner"])
    assert len(owners) == 3


@probe("signal")
def test_p08_sigint_while_a_resume_loads_is_one_line_and_the_folder_resumes_later(
    cli,
    run_copy,
    monkeypatch,  # noqa: F811
):
    from moe_rl.trainer.state import Checkpointer

    load = Checkpointer.load

    def load_under_sigint(self, optimizer):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        return load(self, optimizer)

    monkeypatch.setattr(Checkpointer, "load", load_under_sigint)
    before = snapshot(run_copy / "run" / "checkpoints")
    cli("train", run_copy / "r.yaml", "train.sft_steps=6", "--resume").one_line(
        r"stopped: SIGINT received", code=130
    )
    assert_kept(before, run_copy / "run" / "checkpoints")
    monkeypatch.setattr(Checkpointer, "load", load)
    assert cli("train", run_copy / "r.yaml", "train.sft_steps=6", "--resume").code == 0


@probe("recipe")
@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.seed=4294967296", "train.seed"),
        ("model.seed=-3", "model.seed"),
        ("train.sft_steps=0", "train.sft_steps"),
        ("optim.adam_eps=1e-320", "optim.adam_eps"),
        ("rollout.sglang.gpus=[0, -1]", "rollout.sglang.gpus"),
        ("train.loggers=[jsonl, ' ']", "train.loggers[1]"),
        ("task.jsonl.response_field=''", "task.jsonl.response_field"),
    ],
)
def test_p09_degenerate_values_are_one_line_naming_the_field(cli, tmp_path, override, field):
    cli("check", recipe(tmp_path), override).one_line(
        rf"configuration error: .*{field.replace('[', '.').replace(']', '.')}"
    )


# -- check: data ---------------------------------------------------------------------------------
def _jsonl(tmp_path: Path, rows: list[dict], **jsonl) -> Path:
    from tests.badinput.test_data_rewards import _recipe

    return _recipe(tmp_path, data="".join(json.dumps(r) + "\n" for r in rows), **jsonl)


@probe("data")
def test_p10_blank_prompts_in_every_row_are_refused(cli, tmp_path):
    rows = [{"prompt": "  ", "answer": str(i)} for i in range(8)]
    cli("check", _jsonl(tmp_path, rows)).one_line(r"field 'prompt' is null or empty in all 8 rows")


@probe("data")
def test_p11_numeric_ground_truths_are_usable(cli, tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(12)]
    assert cli("check", _jsonl(tmp_path, rows)).code == 0


@probe("data")
def test_p12_a_response_field_null_in_every_row_is_refused_for_sft(cli, tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "solution": None} for i in range(12)]
    cli("check", _jsonl(tmp_path, rows), "task.jsonl.response_field=solution").one_line(
        r"field 'solution' is null or empty in all 12 rows"
    )


@probe("data")
def test_p13_a_file_of_blank_lines_has_no_records(cli, tmp_path):
    from tests.badinput.test_data_rewards import _recipe

    cli("check", _recipe(tmp_path, data="\n \n\n")).one_line(r"the file has no records")


@probe("data")
def test_p14_a_prompt_of_the_wrong_type_in_many_rows_is_counted(cli, tmp_path):
    rows = [{"prompt": i, "answer": "1"} for i in range(5)] + [{"prompt": "x", "answer": "1"}] * 5
    cli("check", _jsonl(tmp_path, rows)).one_line(
        r"data\.jsonl:1: field 'prompt' must be a string, got 0.* in 5 of 10 rows \(also .*:2, .*:3, .*:4, \.\.\.\)"
    )


# -- export --------------------------------------------------------------------------------------
@probe("output")
def test_p15_export_overwrite_replaces_an_earlier_export(cli, run_copy):  # noqa: F811
    args = ["export", run_copy / "r.yaml", run_copy / "hf", "--checkpoint", run_copy / "run/checkpoints"]
    assert cli(*args).code == 0
    (run_copy / "hf" / "stale.txt").write_text("from before")
    assert cli(*args, "--overwrite").code == 0
    assert not (run_copy / "hf" / "stale.txt").exists() and (run_copy / "hf" / "config.json").is_file()


@probe("output")
def test_p16_export_through_a_symlink_into_a_checkpoint_folder_is_refused(cli, run_copy):  # noqa: F811
    (run_copy / "link").symlink_to(run_copy / "run" / "checkpoints")
    before = snapshot(run_copy / "run")
    res = cli(
        "export",
        run_copy / "r.yaml",
        run_copy / "link" / "hf",
        "checkpoint.dir=/nonexistent",
        "--random-init",
    )
    res.one_line(r"is inside a run's checkpoint folder")
    assert_kept(before, run_copy / "run")


@probe("output")
def test_p17_export_overwrite_of_a_folder_holding_runs_is_refused(cli, run_copy, tmp_path):  # noqa: F811
    before = snapshot(run_copy / "run")
    res = cli(
        "export", run_copy / "r.yaml", run_copy, "--checkpoint", run_copy / "run/checkpoints", "--overwrite"
    )
    res.one_line(
        r"would overwrite or sit inside the checkpoint it exports|holds .*a run or checkpoint directory"
    )
    other = tmp_path / "runs"
    shutil.copytree(run_copy / "run", other / "x")
    res = cli(
        "export", run_copy / "r.yaml", other, "--checkpoint", run_copy / "run/checkpoints", "--overwrite"
    )
    res.one_line(r"holds \(x\) a run or checkpoint directory")
    assert_kept(before, run_copy / "run")


@probe("output")
def test_p18_export_into_a_new_folder_of_the_run_is_fine(cli, run_copy):  # noqa: F811
    res = cli(
        "export", run_copy / "r.yaml", run_copy / "run" / "hf", "--checkpoint", run_copy / "run/checkpoints"
    )
    assert res.code == 0, res.err


# -- compare / demo --------------------------------------------------------------------------------
@probe("output")
def test_p19_a_second_compare_into_a_live_compares_out_is_refused(tmp_path):
    from moe_rl.trainer.run_lock import hold_run_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / ".moe-rl-compare").write_text("{}")
    with hold_run_dir(out, rank=0, what="compare --out"):
        code, _, err = compare(out)
    assert code == 2 and "compare --out" in one_line(err) and "in use by another run" in one_line(err)


@probe("output")
def test_p20_a_compare_arm_folder_with_a_corrupt_recipe_is_refused_not_wiped(tmp_path):
    out = tmp_path / "out"
    (out / "grpo" / "s0").mkdir(parents=True)
    (out / ".moe-rl-compare").write_text("{}")
    (out / "grpo" / "s0" / "recipe.yaml").write_text("model: [")
    (out / "grpo" / "s0" / "notes.txt").write_text("mine")
    before = snapshot(out)
    code, _, err = compare(out)
    assert code == 2 and "recipe.yaml unreadable" in one_line(err)
    assert_kept(before, out)


@probe("cli")
def test_p21_seeds_past_any_plan_are_refused_before_a_job_list_is_built(cli):
    t0 = time.perf_counter()
    cli("compare", "recipes/tiny.yaml", "--seeds", "1000000000").one_line(
        r"--seeds '1000000000': give at most 10000"
    )
    assert time.perf_counter() - t0 < 5


@probe("cli")
def test_p22_a_train_into_a_live_compares_out_is_refused(cli, tmp_path):
    from moe_rl.trainer.run_lock import hold_run_dir

    out = tmp_path / "out"
    out.mkdir()
    with hold_run_dir(out, rank=0, what="compare --out"):
        res = cli("train", recipe(tmp_path), f"train.out_dir={out}")
    res.one_line(r"train\.out_dir .*out is in use by another run")


# -- report ----------------------------------------------------------------------------------------
@probe("cli")
def test_p23_two_runs_of_one_name_are_refused_not_merged(cli, tmp_path):
    a, b = write_run(tmp_path / "x" / "run", RL), write_run(tmp_path / "y" / "run", RL)
    cli("report", a, b, "--out", tmp_path / "r.png").one_line(r"two runs are named 'run'.*NAME=DIR")


@probe("cli")
def test_p24_report_out_in_a_new_folder_is_made(cli, tmp_path):
    run = write_run(tmp_path / "run", RL)
    assert cli("report", run, "--out", tmp_path / "new" / "deep" / "r.png").code == 0
    assert (tmp_path / "new" / "deep" / "r.md").is_file()


@probe("cli")
def test_p25_a_metrics_row_that_is_a_list_names_its_line(cli, tmp_path):
    run = write_run(tmp_path / "run", RL)
    with (run / "metrics.jsonl").open("a") as f:
        f.write("[1, 2]\n")
    cli("report", run, "--out", tmp_path / "r.png").one_line(
        r"metrics\.jsonl:5: a metrics row needs 'stage' and 'step'"
    )


@probe("cli")
def test_p26_nan_values_in_metrics_are_plotted_around(cli, tmp_path):
    rows = [dict(r) for r in RL]
    rows[1]["reward/mean"] = float("nan")
    run = write_run(tmp_path / "run", rows)
    assert cli("report", run, "--out", tmp_path / "r.png").code == 0


# -- plan ------------------------------------------------------------------------------------------
@probe("cli")
@pytest.mark.parametrize(
    "flag", ["--num-gpus=0", "--gpu-mem-gib=5e-324", "--micro-batch=-2", "--gpu-mem-gib=inf"]
)
def test_p27_plan_flags_out_of_range_are_usage_lines(cli, flag):
    cli("plan", "recipes/tiny.yaml", flag).one_line(rf"usage error: .*{flag.split('=')[0]}")


# -- serve -----------------------------------------------------------------------------------------
@pytest.fixture
def app():
    return SGLangProtocolApp(CountingEngine(), tokenizer=TOK, model_path="tiny")


def _400(app, path, body, text):
    status, out = app.handle("POST", path, body)
    message = out.get("message") or out.get("error", {}).get("message", "")
    assert status == 400 and text in message, (status, out)
    assert app.engine.calls == 0


@probe("server")
def test_p28_max_tokens_past_the_token_limit_names_it(app):
    _400(app, "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "body.max_tokens=1000000000")


@probe("server")
def test_p29_many_texts_are_counted_before_any_is_encoded(app, monkeypatch):
    encoded = []
    monkeypatch.setattr(app.text, "encode", lambda t: encoded.append(t) or [1])
    _400(app, "/generate", {"text": ["a"] * 100_000}, "number of prompts (100000)")
    assert encoded == []


@probe("server")
def test_p30_chat_with_n_zero_names_n(app):
    _400(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 0}, "body.n=0")


@probe("server")
def test_p31_negative_prompt_token_ids_name_the_prompt(app):
    _400(app, "/v1/completions", {"prompt": [[3, -1]]}, "body.prompt[0]: token id -1")


@probe("server")
def test_p32_a_huge_top_k_means_the_whole_vocabulary(app):
    status, _ = app.handle(
        "POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"top_k": 2**40, "max_new_tokens": 2}}
    )
    assert status == 200 and app.engine.sampling.top_k == -1


@probe("server")
def test_p33_a_one_rank_weight_group_is_refused(app):
    body = {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 1}
    _400(app, "/init_weights_update_group", body, "body.world_size=1")


@probe("server")
def test_p34_update_from_a_folder_without_weights_is_400_naming_it(app, tmp_path):
    status, out = app.handle("POST", "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and str(tmp_path) in out["message"] and "no *.safetensors" in out["message"]


@probe("server")
def test_p35_seed_plus_n_past_the_largest_seed_names_seed(app):
    _400(app, "/v1/completions", {"prompt": "hi", "n": 4, "seed": 2**63 - 2}, "body.seed=")


@probe("server")
def test_p36_a_sampling_params_list_of_another_length_is_400(app):
    _400(
        app,
        "/generate",
        {"input_ids": [[1], [2]], "sampling_params": [{}]},
        "body.sampling_params: 1 entries for 2",
    )


@probe("server")
def test_p37_serve_of_a_missing_model_path_is_one_line(cli, tmp_path, monkeypatch):
    import moe_rl.serve.http as http

    monkeypatch.setattr(http, "serve", lambda *a, **k: (_ for _ in ()).throw(AssertionError("served")))
    cli("serve", "--model-path", tmp_path / "gone", "--port", "0").one_line(
        r"--model-path .*gone: expected an HF checkpoint"
    )


@probe("server")
@pytest.mark.parametrize(
    "flag",
    [
        "--moe-rl-read-timeout=5e-324",
        "--max-total-tokens=18446744073709551616",
        "--base-gpu-id=-1",
        "--mem-fraction-static=1.5",
    ],
)
def test_p38_serve_flags_out_of_range_are_one_line(cli, flag, monkeypatch):
    import moe_rl.serve.embedded as embedded

    monkeypatch.setattr(embedded, "build_engine", lambda a: (_ for _ in ()).throw(AssertionError("built")))
    line = cli("serve", "--port", "0", flag).one_line(r"(usage|configuration) error")
    assert flag.split("=")[0] in line


# -- bench and the shared handler -------------------------------------------------------------------
@probe("cli")
def test_p39_an_unknown_benchmark_lists_the_ones_there_are(cli):
    cli("bench", "nope").one_line(r"no benchmark 'nope'; available: .*startup")


@probe("signal")
def test_p40_ctrl_c_in_a_benchmark_main_is_one_line_130(capsys):
    from moe_rl.argparsing import run_main

    def main():
        raise KeyboardInterrupt

    assert run_main(main, verbose=False) == 130
    assert capsys.readouterr().err.startswith("moe-rl: stopped: SIGINT received")


@probe("os")
def test_p41_a_quota_error_is_disk_full_naming_the_file(capsys):
    import errno

    from moe_rl.argparsing import one_line_errors

    def write():
        raise OSError(errno.EDQUOT, "Disk quota exceeded", "/data/x.json")

    assert one_line_errors(write, verbose=False) == 2
    assert "moe-rl: disk full: no space left on the device writing /data/x.json" in capsys.readouterr().err


@probe("os")
def test_p42_a_wrapped_full_disk_in_any_library_exception_is_one_line(capsys):
    from moe_rl.argparsing import one_line_errors

    class Wrapped(BaseException):
        failures = {0: (RuntimeError("Worker failure: [Errno 28] No space left on device"), "tb")}

    def save():
        raise Wrapped("write failed on rank 0")

    assert one_line_errors(save, verbose=False) == 2
    assert capsys.readouterr().err.startswith("moe-rl: disk full: no space left on the device")


@probe("cli")
def test_p43_a_bug_still_keeps_its_traceback(capsys):
    from moe_rl.argparsing import one_line_errors

    def bug():
        raise ZeroDivisionError("x")

    with pytest.raises(ZeroDivisionError):
        one_line_errors(bug, verbose=False)
