"""The code MLflow logs as a many-models run's model definition (MLflow's "models from code", so no
pickled object is stored): it names the pyfunc that serves the forecasts (forecasts_pyfunc.py)."""

import mlflow.models

from shardwise.manymodel.serving.forecasts_pyfunc import ChosenForecasts

mlflow.models.set_model(ChosenForecasts())
