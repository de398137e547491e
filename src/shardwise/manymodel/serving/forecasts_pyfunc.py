"""The MLflow pyfunc a many-models run is registered as: the chosen model's forecasts of every
series, with their prediction intervals, looked up by series.

`predict` takes a table of series ids (the job's id columns; one row per series wanted) and,
optionally, the parameter `horizon` (1 up to the horizon the run forecast; default all of it);
it returns, for each series in the order asked, its forecast rows: the ids, the timestamp, the
step, the model chosen for it, the forecast and each level's `lo_<level>`/`hi_<level>`. A series
the run did not forecast is an error naming it.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import pandas as pd


class ChosenForecasts(mlflow.pyfunc.PythonModel):  # type: ignore[misc]
    """Artifacts: `forecasts`, the run's forecasts.parquet. Model config: `ids` (the id
    columns) and `horizon`. MLflow loads it from its code (served_forecasts.py)."""

    def load_context(self, context: Any) -> None:
        """Read the forecasts, indexed by series (ids as strings)."""
        self.ids: list[str] = list(context.model_config["ids"])
        self.horizon: int = int(context.model_config["horizon"])
        frame = pd.read_parquet(context.artifacts["forecasts"])
        frame[self.ids] = frame[self.ids].astype(str)
        self.forecasts = frame.set_index(self.ids).sort_index()

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        horizon = int((params or {}).get("horizon") or self.horizon)
        if not 1 <= horizon <= self.horizon:
            raise _refused(f"horizon {horizon}: this model forecasts 1 to {self.horizon} steps")
        missing = [c for c in self.ids if c not in model_input.columns]
        if missing:
            raise _refused(f"the input needs the series id column(s) {self.ids}; no {missing}")
        asked = model_input[self.ids].astype(str)
        keys = list(
            dict.fromkeys(
                asked.itertuples(index=False, name=None)
                if len(self.ids) > 1
                else asked[self.ids[0]]
            )
        )
        unknown = [k for k in keys if k not in self.forecasts.index]
        if unknown:
            raise _refused(f"{len(unknown)} series the run did not forecast, e.g. {unknown[0]}")
        rows = self.forecasts.loc[keys]
        return rows[rows["step"] <= horizon].reset_index()


def _refused(message: str) -> Exception:
    """A request the model cannot answer: served, a 400 whose message is this one."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    refused: Exception = MlflowException(message, error_code=INVALID_PARAMETER_VALUE)
    return refused
