"""The ``mlflow`` logger: metrics, the config and the sample table to an MLflow tracking store.

By default the store is local: ``<output_dir>/mlflow.db`` (SQLite) for the runs and metrics and
``<output_dir>/mlartifacts`` for the artifacts; no server, no network. View it with
``mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db``. ``tracking_uri`` (or
``MLFLOW_TRACKING_URI``) points the logger at a server or another store instead. MLflow's older file
store (``file:...``) works too, but keeps each metric in a file named after it, so it cannot hold both
``reward/failed`` and ``reward/failed/exception``, which rlx logs: SQLite is the default for that reason
(and MLflow 3 refuses the file store unless ``MLFLOW_ALLOW_FILE_STORE`` is set).

- Every numeric metric is an MLflow metric under its own name, at its step. MLflow allows letters,
  digits, ``_ - . / `` and space in a name; any other character is replaced by ``_`` (the console says
  which names changed, once).
- The resolved config is the artifact ``config.yaml`` and, flattened to dotted keys, the run's params
  (``actor.optim.lr``, ...), so runs can be compared by their settings in the MLflow UI.
- The sample rows of each step go to a table artifact ``samples/step_<step>.json`` (``log_table``;
  one file per step, since appending to one table makes MLflow re-read it and turn text such as ``"007"``
  into numbers).
- A resumed run continues the same MLflow run (its id is kept in ``<output_dir>/.rlx-mlflow-run-id``).

Read a store back with :func:`read_store`.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.errors import UserError, require
from rlx.plugins.loggers._common import cell, flatten, numbers, read_run_id, sample_columns, save_run_id
from rlx.registry import Requirement

log = logging.getLogger(__name__)

_RUN_ID_FILE = ".rlx-mlflow-run-id"
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- ]")
# MLflow's own limits (mlflow.utils.validation): entities per log_batch call, and a param's length.
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100
_PARAM_VALUE_LENGTH = 6000
_KEY_LENGTH = 250


class MlflowOptions(BaseModel):
    """Options of the ``mlflow`` logger."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (http://..., databricks, sqlite:///...). Default: "
        "MLFLOW_TRACKING_URI when set, else a local store: <output_dir>/mlflow.db and <output_dir>/mlartifacts.")
    experiment: str | None = Field(None, description="MLflow experiment name. Default: the run's project.")
    run_name: str | None = Field(None, description="MLflow run name. Default: the run's experiment.")
    params: bool = Field(True, description="Log the resolved config as params (dotted keys).")
    samples: bool = Field(True, description="Log the sample rows to the table artifacts samples/step_<step>.json.")


def metric_name(key: str) -> str:
    """``key`` with the characters MLflow refuses replaced by ``_``."""
    return _BAD_NAME_CHARS.sub("_", key)[:_KEY_LENGTH]


def default_store(output_dir: str | os.PathLike[str]) -> str:
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def artifact_location(uri: str) -> str | None:
    """Where a new experiment of the store ``uri`` keeps its artifacts: beside the database for a SQLite store
    (the default one in the run folder included), never MLflow's own default (``./mlruns`` in the current
    folder, where nobody asked for it); None (the server's choice) for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///"))
    return (database.resolve().parent / "mlartifacts").as_uri()


class MlflowLogger:
    def __init__(self, client: Any, run_id: str, samples: bool) -> None:
        self.client = client
        self.run_id = run_id
        self.samples = samples
        self._renamed: set[str] = set()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = []
        for key, value in numbers(metrics).items():
            name = metric_name(key)
            if name != key and key not in self._renamed:
                self._renamed.add(key)
                log.warning("mlflow logger: metric %r is logged as %r (MLflow does not allow its characters).",
                            key, name)
            batch.append(Metric(name, value, stamp, int(step)))
        for start in range(0, len(batch), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[start:start + _METRICS_PER_BATCH])

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if self.client is None or not self.samples or not rows:
            return
        columns = sample_columns(rows)
        table = {c: [cell(row.get(c)) for row in rows] for c in columns}
        self.client.log_table(self.run_id, data=table, artifact_file=f"samples/step_{int(step):08d}.json")

    def finish(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.set_terminated(self.run_id)


def _log_config(client: Any, run_id: str, config: Mapping[str, Any], params: bool) -> None:
    from mlflow.entities import Param

    client.log_dict(run_id, dict(config), "config.yaml")
    if not params:
        return
    items = [Param(metric_name(k)[:_KEY_LENGTH], str(v)[:_PARAM_VALUE_LENGTH]) for k, v in flatten(config).items()]
    for start in range(0, len(items), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start:start + _PARAMS_PER_BATCH])


def build(options: MlflowOptions | None, ctx: BuildContext) -> MlflowLogger:
    options = options or MlflowOptions()
    require("mlflow", "mlflow", "The mlflow logger")
    from mlflow import MlflowClient

    run = ctx.run
    uri = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_store(run.output_dir)
    local = uri == default_store(run.output_dir)
    if local:
        for module in ("sqlalchemy", "alembic"):
            require(module, "mlflow", "The mlflow logger's local store (SQLite)")
        Path(run.output_dir).mkdir(parents=True, exist_ok=True)
    id_file = Path(run.output_dir) / _RUN_ID_FILE
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment_name = options.experiment or run.project
        found = client.get_experiment_by_name(experiment_name)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            # A local store keeps its artifacts beside it, not in the current folder (MLflow's default).
            where = artifact_location(uri)
            experiment_id = client.create_experiment(experiment_name, artifact_location=where)
        previous = read_run_id(id_file) if run.resumed else None
        if previous is not None:
            client.update_run(previous, status="RUNNING")
            run_id = previous
        else:
            run_id = client.create_run(experiment_id, run_name=options.run_name or run.experiment).info.run_id
            if run.config:
                _log_config(client, run_id, run.config, options.params)
    except Exception as exc:
        raise UserError(f"The mlflow logger could not start a run in the tracking store {uri}: {exc}",
                        "Check loggers.mlflow.tracking_uri (or MLFLOW_TRACKING_URI); leave both unset for a "
                        "local store in the run folder.") from exc
    save_run_id(id_file, run_id)
    return MlflowLogger(client, run_id, options.samples)


def read_store(uri: str, run_id: str | None = None) -> dict[str, Any]:
    """A run of an MLflow store: ``{"metrics": {name: [(step, value), ...]}, "params": {...},
    "config": dict, "samples": [{"step": s, "columns": [...], "data": [[...], ...]}, ...], "run_id": ...}``.

    ``uri`` is the store's tracking URI (:func:`default_store` of a run folder for the local one);
    ``run_id`` defaults to the newest run. Read through MLflow's own client.
    """
    import json

    import yaml

    require("mlflow", "mlflow", "Reading an MLflow store")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if run_id is None:
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise FileNotFoundError(f"No MLflow run in {uri}")
        run_id = runs[0].info.run_id
    data = client.get_run(run_id).data
    metrics = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
               for key in data.metrics}
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    config = yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml")).read_text()) \
        if "config.yaml" in artifacts else None
    samples = []
    if "samples" in artifacts:
        for item in sorted(a.path for a in client.list_artifacts(run_id, "samples")):
            table = json.loads(Path(client.download_artifacts(run_id, item)).read_text(encoding="utf-8"))
            step = int(Path(item).stem.removeprefix("step_"))
            samples.append({"step": step, "columns": table["columns"], "data": table["data"]})
    return {"run_id": run_id, "metrics": metrics, "params": dict(data.params), "config": config,
            "samples": samples}


@hookimpl
def rlx_loggers() -> list[Component]:
    return [Component(kind="logger", name="mlflow", factory=build, config_model=MlflowOptions,
                      summary="Logs to MLflow: a local store in the run folder, or a tracking server.",
                      extra={"requires": [Requirement("mlflow", "mlflow", "pip install 'rlx[mlflow]'")]})]
