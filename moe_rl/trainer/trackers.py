"""Trackers: where rank 0's metrics go besides ``metrics.jsonl`` (``train.loggers``).

One registry, :data:`TRACKERS` (name -> class), holds every tracker a recipe may name; its keys and
``jsonl`` (the sink's own file) are :data:`moe_rl.names.LOGGERS`, which the recipe is checked
against at load (a test holds them equal). Each tracker is driven through its own library:

- ``tensorboard``: ``torch.utils.tensorboard`` under ``<out_dir>/tb``: every metric as a scalar
  ``<stage>/<metric>``, the flattened recipe as hparams (the HPARAMS tab filters runs by
  ``algo.name``, ``algo.routing``, ...), the recipe's YAML as text ``recipe``, and samples as text;
- ``wandb``: ``wandb.init`` (mode from ``WANDB_MODE``: ``offline`` needs no server; project from
  ``WANDB_PROJECT``, else ``moe-rl``; files under ``$WANDB_DIR/wandb``, else ``<out_dir>/wandb``),
  config = the flattened
  recipe, each stage's metrics against its own step axis ``<stage>/step`` (SFT and RL both count
  from 0, and W&B drops a row whose ``step=`` goes backwards), samples as ``wandb.Table``;
- ``mlflow``: an ``MlflowClient`` on ``MLFLOW_TRACKING_URI``, else the file store
  ``<out_dir>/mlruns``; params = the flattened recipe (values cut to MLflow's limit; the whole
  recipe is the artifact ``recipe.yaml``), metrics with their step as ``<stage>/<metric>`` with the
  metric's own ``/`` as ``.`` (:func:`mlflow_key`: ``rl/flip.step.rate``), ``samples.jsonl`` as an
  artifact at the end.

The sink (:class:`moe_rl.trainer.metrics.MetricsSink`) starts them at its first row, so the
run's id is known, and closes them after ``metrics.jsonl``. A tracker that raises is warned about
once and dropped for the rest of the run: training goes on, and ``metrics.jsonl`` keeps every row.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from moe_rl.names import LOSS_NAMES
from moe_rl.routing import RoutingMode

HPARAM_METRICS = (
    "rl/reward/mean",
    "rl/reward/accuracy",
    "rl/flip/step/rate",
    "rl_eval/eval/accuracy",
    "sft/loss",
)
"The metrics TensorBoard's HPARAMS tab shows beside each run's hparams (their last value)."
PROJECT = "moe-rl"
"The W&B project and the MLflow experiment when ``WANDB_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME`` name none."


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker starts with."""

    out_dir: Path
    "``train.out_dir``."
    name: str
    "The run's name in the tracker: the folder's name, the run id and the attempt."
    tags: dict[str, object]
    "The rows' tags (``run``, ``attempt``)."
    params: dict[str, Any]
    "The resolved recipe flattened (:func:`flatten`): ``{'algo.name': 'gspo', 'optim.lr': 1e-4, ...}``."
    recipe_yaml: str | None
    "The resolved recipe as YAML (None: the sink was given no recipe)."
    samples: Path
    "The run's ``samples.jsonl`` (it may never be written)."


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """``{"algo": {"name": "gspo"}}`` -> ``{"algo.name": "gspo"}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def scalar_param(v: Any) -> bool | int | float | str:
    """A parameter as a bool, number or string (None as ``null``, a list as JSON)."""
    if isinstance(v, (bool, int, float, str)):
        return v
    return json.dumps(v)


class Tracker:
    """One tracker of a run. :meth:`start` once, then :meth:`log` and :meth:`samples` any number
    of times, then :meth:`close`; any of them may raise (the sink drops the tracker)."""

    name: ClassVar[str]

    def start(self, run: TrackedRun) -> None:
        raise NotImplementedError

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        """``metrics``: the row's finite numbers."""
        raise NotImplementedError

    def samples(self, step: int, kind: str, rows: list[dict]) -> None:
        """``rows``: the rows ``samples.jsonl`` got (tags and ``step``, ``kind`` included)."""

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self) -> None:
        self.writer = None

    def start(self, run: TrackedRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run.out_dir / "tb"))
        if run.params:
            self.write_hparams(run.params)
        if run.recipe_yaml is not None:
            self.writer.add_text("recipe", f"```yaml\n{run.recipe_yaml}```", 0)
        self.writer.flush()

    def write_hparams(self, params: dict[str, Any]) -> None:
        """The recipe as one hparams session in the scalars' own folder, so the HPARAMS tab shows
        the :data:`HPARAM_METRICS` this run logs beside its parameters (``SummaryWriter.add_hparams``
        would start another folder and write its metric values as scalars)."""
        from torch.utils.tensorboard.summary import hparams

        routings = [m.value for m in RoutingMode]
        values = {k: scalar_param(v) for k, v in params.items()}
        domains = {"algo.name": list(LOSS_NAMES), "algo.routing": routings}
        domains = {k: d for k, d in domains.items() if values.get(k) in d}
        summaries = hparams(values, dict.fromkeys(HPARAM_METRICS, 0.0), hparam_domain_discrete=domains)
        for summary in summaries:
            self.writer.file_writer.add_summary(summary)

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"{stage}/{k}", v, step)
        self.writer.flush()

    def samples(self, step: int, kind: str, rows: list[dict]) -> None:
        self.writer.add_text(f"samples/{kind}", samples_text(rows), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self) -> None:
        self.run = None
        self._stages: set[str] = set()

    def start(self, run: TrackedRun) -> None:
        import wandb

        where = Path(os.environ.get("WANDB_DIR") or run.out_dir)  # the user's WANDB_DIR wins, as in wandb
        where.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            dir=str(where),
            project=os.environ.get("WANDB_PROJECT") or PROJECT,
            name=run.name,
            config=run.params,
            tags=[f"{k}={run.params[k]}" for k in ("algo.name", "algo.routing") if k in run.params],
            reinit="create_new",  # one process may hold several runs (the lab's arms, tests)
            settings=wandb.Settings(console="off"),  # stdout and stderr stay the user's
        )

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        axis = f"{stage}/step"
        if stage not in self._stages:
            self.run.define_metric(f"{stage}/*", step_metric=axis)
            self._stages.add(stage)
        self.run.log({axis: step, **{f"{stage}/{k}": v for k, v in metrics.items()}})

    def samples(self, step: int, kind: str, rows: list[dict]) -> None:
        import wandb

        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[row.get(c) for c in columns] for row in rows]
        self.run.log({f"samples/{kind}": wandb.Table(columns=columns, data=data)})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_key(name: str) -> str:
    """``<stage>/<metric>`` as MLflow can keep it: only letters, digits, ``_ - . : `` and spaces
    (others become ``_``), the stage's ``/`` kept and the metric's own ``/`` turned into ``.``
    (``rl/flip/step/rate`` -> ``rl/flip.step.rate``). MLflow's name check allows ``/``, but its file
    store keeps each metric in a file at its name's path, so ``rl/experts/load_imbalance`` and
    ``rl/experts/load_imbalance/layer_0`` (a file and a folder of one path) cannot both be kept; and
    no part may be ``.`` or ``..`` (a path would normalise it away)."""
    stage, _, metric = _MLFLOW_BAD.sub("_", name).partition("/")
    parts = [p if p not in (".", "..") else "_" for p in (stage.strip("/"), metric.replace("/", "."))]
    return "/".join(p or "_" for p in parts) if metric else parts[0] or "_"


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self) -> None:
        self.client = None
        self.run_id: str | None = None
        self.samples_path: Path | None = None

    @staticmethod
    def tracking_uri(out_dir: Path) -> str:
        """``MLFLOW_TRACKING_URI``, else the file store ``<out_dir>/mlruns`` (MLflow 3 keeps that
        store behind ``MLFLOW_ALLOW_FILE_STORE=true``, set here unless the user set it)."""
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return uri
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (out_dir / "mlruns").resolve().as_uri()

    def start(self, run: TrackedRun) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        run.out_dir.mkdir(parents=True, exist_ok=True)
        self.samples_path = run.samples
        self.client = MlflowClient(tracking_uri=self.tracking_uri(run.out_dir))
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                experiment_id = self.client.create_experiment(experiment)
            except Exception:  # another run created it first
                experiment_id = self.client.get_experiment_by_name(experiment).experiment_id
        else:
            experiment_id = found.experiment_id
        tags = {f"moe_rl.{k}": str(v) for k, v in run.tags.items()}
        self.run_id = self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
        cut = "...(cut: the whole recipe is the artifact recipe.yaml)"
        params = []
        for k, v in run.params.items():
            text = str(scalar_param(v))
            if len(text) > MAX_PARAM_VAL_LENGTH:
                text = text[: MAX_PARAM_VAL_LENGTH - len(cut)] + cut
            params.append(Param(_MLFLOW_BAD.sub("_", k), text))
        if params:
            self.client.log_batch(self.run_id, params=params)  # in batches of MLflow's limit
        if run.recipe_yaml is not None:
            self.client.log_text(self.run_id, run.recipe_yaml, "recipe.yaml")

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(f"{stage}/{k}"), v, now, step) for k, v in metrics.items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        if self.run_id is None:
            return
        if self.samples_path.exists():
            self.client.log_artifact(self.run_id, str(self.samples_path))
        self.client.set_terminated(self.run_id)
        self.run_id = None


TRACKERS: dict[str, type[Tracker]] = {
    cls.name: cls for cls in (TensorBoardTracker, WandbTracker, MlflowTracker)
}
"``train.loggers`` name -> tracker class (``jsonl`` is the sink's own file)."


def make_tracker(name: str) -> Tracker:
    """A new tracker of kind ``name``; an unknown name fails with the valid ones."""
    try:
        cls = TRACKERS[name]
    except KeyError:
        raise KeyError(f"unknown tracker {name!r}: use one of {', '.join(TRACKERS)}") from None
    return cls()


def samples_text(rows: list[dict]) -> str:
    """Markdown of sample rows for TensorBoard's text view: a header line per row, then the prompt
    and the response as code blocks (so the text shows as generated)."""
    parts = []
    for r in rows:
        head = [f"reward {r['reward']:.4g}"]
        if "advantage" in r:
            head.append(f"advantage {r['advantage']:+.4g}")
        head += [f"{r['response_tokens']} tokens", str(r["finish_reason"]), f"answer `{r['answer']}`"]
        parts.append(
            f"**row {r['row']}**: "
            + ", ".join(head)
            + f"\n\n```\n{r['prompt']}\n```\n\n```\n{r['response']}\n```"
        )
    return "\n\n---\n\n".join(parts)
