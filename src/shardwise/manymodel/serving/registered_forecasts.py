"""A many-models run registered in MLflow's Model Registry (`tracking.registered_model`): one pyfunc
(forecasts_pyfunc.py) holding the chosen forecasts of every series with their intervals, logged into
the run's MLflow run and registered as the name's next version, tagged with the run's overall
metrics. Serving it answers "what is the forecast of these series" by lookup."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from shardwise.common.model_registry import (
    Destination,
    Registered,
    check_reachable,
    log_pyfunc,
    pinned,
)
from shardwise.manymodel.config import ManyModelsConfig

EXAMPLE_SERIES = 2


def register_forecasts(
    config: ManyModelsConfig,
    run_dir: Path,
    ids: list[str],
    *,
    run_id: str | None,
    metrics: dict[str, float],
) -> Registered:
    """Log `run_dir`'s chosen forecasts as a pyfunc and register them under
    `tracking.registered_model`; a `RegistryError` when the store cannot take them."""
    check_reachable(config.tracking_uri)  # before the work: a registry that is down costs seconds
    import mlflow.pyfunc
    from mlflow.models import infer_signature

    from shardwise.manymodel.serving import forecasts_pyfunc

    artifacts = {"forecasts": str(run_dir / "forecasts.parquet")}
    settings = {"ids": ids, "horizon": config.backtest.horizon}
    example = pd.read_parquet(artifacts["forecasts"], columns=ids).astype(str)
    example = example.drop_duplicates().head(EXAMPLE_SERIES).reset_index(drop=True)
    model = forecasts_pyfunc.ChosenForecasts()
    model.load_context(mlflow.pyfunc.PythonModelContext(artifacts, settings))
    signature = infer_signature(
        example, model.predict(None, example), params={"horizon": config.backtest.horizon}
    )
    destination = Destination(
        uri=config.tracking_uri,
        experiment=config.tracking.experiment or config.job.name,
        run_name=config.job.name,
        run_id=run_id,
        registered_name=config.tracking.registered_model,
        tags={k: f"{v:.6g}" for k, v in sorted(metrics.items())},
    )
    return log_pyfunc(
        destination,
        python_model=str(Path(forecasts_pyfunc.__file__).with_name("served_forecasts.py")),
        artifacts=artifacts,
        model_config=settings,
        signature=signature,
        input_example=example,
        pip_requirements=pinned(["pandas", "pyarrow", "shardwise"]),
    )
