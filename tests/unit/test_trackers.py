"""train.loggers: a run writes through TensorBoard, W&B (offline) and MLflow (a local file store),
and each is read back with its own library's reader: TensorBoard's EventAccumulator (scalars, the
hparams plugin's data, text), the W&B run's transaction log decoded with wandb's own protobuf
``Record`` (wandb 0.31 ships no Python reader of it), MLflow's ``MlflowClient``. A tracker that fails
mid-run is warned about once and the run goes on; the registry and the recipe's names agree."""

from __future__ import annotations

import json
import logging
import math
import struct
import time
from pathlib import Path

import pytest

from moe_rl import names
from moe_rl.config import ConfigError, TrainConfig, to_dict
from moe_rl.trainer.metrics import MetricsSink, read_metrics
from moe_rl.trainer.trackers import TRACKERS, Tracker, mlflow_key

ALL = ["jsonl", "tensorboard", "wandb", "mlflow"]


@pytest.fixture
def offline(monkeypatch):
    """W&B offline, MLflow on its default store under the run folder; env restored after."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in (
        "WANDB_PROJECT",
        "WANDB_DIR",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_ALLOW_FILE_STORE",
    ):
        monkeypatch.delenv(var, raising=False)  # the tracker sets MLFLOW_ALLOW_FILE_STORE: undone after


# -- readers ------------------------------------------------------------------------------------------
def tensorboard_events(tb_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tensorboard_hparams(acc) -> dict:
    """The hparams plugin's session start info: name -> value."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    out = {}
    for k, v in data.session_start_info.hparams.items():
        out[k] = getattr(v, v.WhichOneof("kind"))
    return out


def wandb_records(out_dir: Path, timeout_s: float = 60.0) -> list:
    """The records of the one offline W&B run under ``out_dir/wandb``: its ``run-*.wandb`` file is
    a LevelDB-style log (7-byte header, 32 KiB blocks of chunks ``crc32 u32, length u16, type u8``:
    full 1, first 2, middle 3, last 4) of wandb's protobuf ``Record`` messages.

    Read until its ``exit`` record is there (``timeout_s`` at most): ``run.finish()`` returns once
    wandb's service has handled the exit, and tells the service to close the run's stream without
    waiting (``ServiceConnection.inform_finish``, a publish), so the file is flushed after it. On a
    loaded CI machine the file was read with no record in it yet."""
    from wandb.proto import wandb_internal_pb2 as pb

    (run_dir,) = sorted((out_dir / "wandb").glob("offline-run-*"))
    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = [pb.Record.FromString(r) for r in _log_chunks(path.read_bytes())]
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _log_chunks(data: bytes) -> list[bytes]:
    """The whole records of a W&B transaction log (:func:`wandb_records`), a chunk cut off at the
    end of what is written so far left out."""
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # not all written yet
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    return records


def wandb_history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


# -- a run through every tracker ------------------------------------------------------------------------
@pytest.mark.integration  # W&B runs its service (wandb-core) as a child process
def test_a_run_writes_every_tracker_and_each_reads_back(tmp_path, parallel_info, offline):
    """Two RL steps of the tiny recipe with every logger: each tracker holds the rows metrics.jsonl
    holds (same steps, same values), the recipe (hparams / config / params, and its YAML), and the
    samples. Broken wiring killed: Run not passing train.loggers or the recipe to the sink, a
    tracker's log / samples / close never called (each leaves its reader without the rows)."""
    from mlflow.tracking import MlflowClient

    from moe_rl.trainer.run import run
    from tests.tiny import tiny_rl_recipe

    out = tmp_path / "run"
    recipe = tiny_rl_recipe(
        out,
        algo={"name": "grpo", "routing": "r3"},
        train={"rl_steps": 2, "samples_every": 1, "samples_per_step": 2, "loggers": ALL},
    )
    run(recipe)
    rows = read_metrics(out / "metrics.jsonl", "rl")
    assert [r["step"] for r in rows] == [0, 1]
    numbers = {k for r in rows for k, v in r.items() if isinstance(v, float) and k not in ("time", "step")}
    assert {"flip/step/rate", "reward/mean", "grad_norm"} <= numbers
    values = {k: [r[k] for r in rows] for k in sorted(numbers)}  # each metric's value at steps 0, 1

    # TensorBoard: scalars, hparams (filterable by algorithm and routing), the recipe, the samples
    acc = tensorboard_events(out / "tb")
    for k, want in values.items():
        got = acc.Scalars(f"rl/{k}")
        assert [e.step for e in got] == [0, 1] and [e.value for e in got] == pytest.approx(want, rel=1e-6), k
    hp = tensorboard_hparams(acc)
    assert hp["algo.name"] == "grpo" and hp["algo.routing"] == "r3"
    assert hp["optim.lr"] == pytest.approx(1e-3) and hp["train.seed"] == recipe.train.seed
    assert hp["train.stages"] == '["rl"]' and hp["model.hf_path"] == "null"
    text = acc.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "name: grpo" in text and "routing: r3" in text
    assert [e.step for e in acc.Tensors("samples/rollout/text_summary")] == [0, 1]

    # W&B (offline): config, each stage's rows against its own step axis, the samples table, finish
    records = wandb_records(out)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "exit" in kinds  # finish() ran
    (start,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in start.config.update}
    assert config["algo.name"] == "grpo" and config["algo.routing"] == "r3" and config["optim.lr"] == 1e-3
    assert start.project == "moe-rl" and start.display_name.startswith("run-")
    history = wandb_history(records)
    rl = [h for h in history if "rl/step" in h]
    assert [h["rl/step"] for h in rl] == [0, 1]
    for k, want in values.items():
        assert [h[f"rl/{k}"] for h in rl] == pytest.approx(want), k
    tables = [h for h in history if "samples/rollout/_type" in h]
    assert [t["samples/rollout/_type"] for t in tables] == ["table-file", "table-file"]
    table = json.loads(
        (
            sorted((out / "wandb").glob("offline-run-*"))[0] / "files" / tables[0]["samples/rollout/path"]
        ).read_text()
    )
    assert "prompt" in table["columns"] and "response" in table["columns"] and len(table["data"]) == 2

    # MLflow (a file store under the run folder): params, metrics with steps, artifacts, ended
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("moe-rl").experiment_id])
    got = client.get_run(found.info.run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params["algo.name"] == "grpo" and got.data.params["algo.routing"] == "r3"
    assert float(got.data.params["optim.lr"]) == 1e-3
    assert got.data.tags["moe_rl.run"] == rows[0]["run"]
    for k, want in values.items():
        history = client.get_metric_history(found.info.run_id, f"rl/{k.replace('/', '.')}")
        assert [m.step for m in history] == [0, 1] and [m.value for m in history] == pytest.approx(want), k
    assert {a.path for a in client.list_artifacts(found.info.run_id)} == {"recipe.yaml", "samples.jsonl"}
    yaml_text = Path(client.download_artifacts(found.info.run_id, "recipe.yaml", str(tmp_path))).read_text()
    assert "routing: r3" in yaml_text


def test_default_loggers_write_jsonl_and_tensorboard_only(tmp_path):
    """train.loggers' default is today's: metrics.jsonl and TensorBoard, no W&B or MLflow folder."""
    assert TrainConfig().loggers == ("jsonl", "tensorboard")
    sink = MetricsSink(tmp_path, recipe={"algo": {"name": "gspo", "routing": "none"}})
    sink.log(0, "rl", {"reward/mean": 0.5})
    sink.close()
    assert [e.value for e in tensorboard_events(tmp_path / "tb").Scalars("rl/reward/mean")] == [0.5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tb"]


# -- failures ---------------------------------------------------------------------------------------------
class _Failing(Tracker):
    """Fails at its ``fail_at``-th call of ``log`` (counting from 1)."""

    name = "tensorboard"
    seen: list = []

    def __init__(self, fail_at=2):
        self.fail_at, self.calls, self.closed = fail_at, 0, 0

    def start(self, run):
        type(self).seen.append(self)

    def log(self, step, stage, metrics):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("server went away")

    def close(self):
        self.closed += 1


def test_a_tracker_failing_mid_run_warns_once_and_the_jsonl_keeps_every_row(tmp_path, monkeypatch, caplog):
    _Failing.seen = []
    monkeypatch.setitem(TRACKERS, "tensorboard", _Failing)
    sink = MetricsSink(tmp_path, loggers=("jsonl", "tensorboard"))
    with caplog.at_level(logging.WARNING, logger="moe_rl.trainer.metrics"):
        for step in range(4):
            sink.log(step, "rl", {"reward/mean": step / 10, "odd": math.nan})
        sink.samples(4, "eval", [{"row": 0}])
        sink.close()
    (tracker,) = _Failing.seen
    assert tracker.calls == 2 and tracker.closed == 1  # dropped after the failure, closed once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tensorboard failed to log rl step 1" in warnings[0]
    assert (
        "ConnectionError: server went away" in warnings[0] and "metrics.jsonl keeps every row" in warnings[0]
    )
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_tracker_failing_to_start_leaves_the_run_going(tmp_path, monkeypatch, caplog):
    class NoStart(_Failing):
        def start(self, run):
            raise RuntimeError("no login")

    monkeypatch.setitem(TRACKERS, "tensorboard", NoStart)
    sink = MetricsSink(tmp_path, loggers=("jsonl", "tensorboard"))
    with caplog.at_level(logging.WARNING, logger="moe_rl.trainer.metrics"):
        sink.log(0, "sft", {"loss": 1.0})
        sink.log(1, "sft", {"loss": 0.5})
        sink.close()
    assert sink.trackers == []
    assert [r.getMessage() for r in caplog.records].count(
        "train.loggers: tensorboard failed to start (RuntimeError: no login): it is off for the rest of "
        "this run; metrics.jsonl keeps every row"
    ) == 1
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2


def test_only_an_enabled_sink_starts_trackers(tmp_path, monkeypatch):
    """Ranks other than 0 (enabled=False) start no tracker and write nothing."""
    _Failing.seen = []
    monkeypatch.setitem(TRACKERS, "tensorboard", _Failing)
    sink = MetricsSink(tmp_path / "r1", enabled=False, loggers=("jsonl", "tensorboard"))
    sink.log(0, "rl", {"x": 1.0})
    sink.samples(0, "rollout", [{"row": 0}])
    sink.close()
    assert _Failing.seen == [] and not (tmp_path / "r1").exists()


# -- names -------------------------------------------------------------------------------------------------
def test_logger_names_agree_with_the_tracker_registry():
    assert sorted(names.LOGGERS) == sorted(["jsonl", *TRACKERS])
    assert all(cls.name == name for name, cls in TRACKERS.items())
    assert set(names.DEFAULT_LOGGERS) <= set(names.LOGGERS)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("rl/flip/step/rate", "rl/flip.step.rate"),
        ("rl/clip/token_frac", "rl/clip.token_frac"),
        ("rl_eval/eval/acc@1", "rl_eval/eval.acc_1"),
        ("rl/load[0]/max", "rl/load_0_.max"),
        ("rl/a//b/", "rl/a..b."),
        ("rl/..", "rl/_"),
        ("sft/ok: it", "sft/ok: it"),
        ("/", "_"),
    ],
)
def test_metric_names_become_names_mlflow_accepts(name, key):
    from mlflow.utils.validation import _validate_metric_name

    assert mlflow_key(name) == key
    _validate_metric_name(key)  # raises on a name MLflow refuses


def test_a_metric_and_one_under_it_are_both_kept_by_the_mlflow_file_store(tmp_path, offline):
    """``experts/load_imbalance`` and ``experts/load_imbalance/layer_0`` (the RL step logs both) as
    MLflow names: a file and a folder of one path in its file store, unless the metric's ``/`` go."""
    from mlflow.tracking import MlflowClient

    sink = MetricsSink(tmp_path, loggers=("jsonl", "mlflow"))
    for step in range(2):
        sink.log(
            step, "rl", {"experts/load_imbalance": 1.0 + step, "experts/load_imbalance/layer_0": 2.0 + step}
        )
    sink.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("moe-rl").experiment_id])
    assert client.get_run(found.info.run_id).data.metrics == {
        "rl/experts.load_imbalance": 2.0,
        "rl/experts.load_imbalance.layer_0": 3.0,
    }
    history = client.get_metric_history(found.info.run_id, "rl/experts.load_imbalance.layer_0")
    assert [(m.step, m.value) for m in history] == [(0, 2.0), (1, 3.0)]


def test_the_mlflow_params_of_a_long_value_are_cut_and_the_recipe_kept_whole(tmp_path, offline):
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    long = "x" * (MAX_PARAM_VAL_LENGTH + 100)
    recipe = {"task": {"prompt": long}, "algo": {"name": "gspo"}, **{f"s{i}": {"v": i} for i in range(150)}}
    sink = MetricsSink(tmp_path, loggers=("jsonl", "mlflow"), recipe=recipe)
    sink.log(0, "sft", {"loss": 1.0})
    sink.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("moe-rl").experiment_id])
    params = client.get_run(found.info.run_id).data.params
    assert len(params) == 152  # more than one batch of MLflow's 100
    assert len(params["task.prompt"]) == MAX_PARAM_VAL_LENGTH and params["task.prompt"].endswith(
        "recipe.yaml)"
    )
    whole = Path(
        client.download_artifacts(found.info.run_id, "recipe.yaml", str(tmp_path / "dl"))
    ).read_text()
    assert long in whole


@pytest.mark.integration  # W&B and MLflow start `uname -p` (platform.processor)
def test_the_trackers_own_environment_wins(tmp_path, offline, monkeypatch):
    """Issue 49: WANDB_DIR, WANDB_PROJECT and MLFLOW_TRACKING_URI are the user's and win over the run
    folder and moe-rl's defaults (W&B used to write into the run folder whatever WANDB_DIR said)."""
    from mlflow.tracking import MlflowClient

    wandb_dir, store = tmp_path / "wandb_here", tmp_path / "mlflow_store"
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_PROJECT", "my-project")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.resolve().as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    sink = MetricsSink(out, loggers=("jsonl", "wandb", "mlflow"), recipe={"algo": {"name": "gspo"}})
    sink.log(0, "rl", {"reward/mean": 0.5})
    sink.close()
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    assert not (out / "wandb").exists() and not (out / "mlruns").exists()
    records = wandb_records(wandb_dir)
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.project == "my-project"
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("moe-rl").experiment_id])
    assert client.get_run(found.info.run_id).data.metrics == {"rl/reward.mean": 0.5}


# -- the recipe --------------------------------------------------------------------------------------------
def test_loggers_refused_at_load():
    with pytest.raises(
        ConfigError, match=r"train\.loggers\[1\]='neptune' is unknown: use jsonl, tensorboard"
    ):
        TrainConfig(loggers=("jsonl", "neptune"))
    with pytest.raises(ConfigError, match=r"leaves out jsonl"):
        TrainConfig(loggers=("wandb",))
    with pytest.raises(ConfigError, match=r"names a logger twice"):
        TrainConfig(loggers=("jsonl", "mlflow", "mlflow"))
    assert list(to_dict(TrainConfig(loggers=("jsonl", "wandb", "mlflow")))["loggers"]) == [
        "jsonl",
        "wandb",
        "mlflow",
    ]
