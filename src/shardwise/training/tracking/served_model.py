"""The code MLflow logs as a trained model's definition (MLflow's "models from code", so no
pickled object is stored): it names the pyfunc that rebuilds the model (trained_pyfunc.py)."""

import mlflow.models

from shardwise.training.tracking.trained_pyfunc import TrainedModel

mlflow.models.set_model(TrainedModel())
