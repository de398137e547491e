"""The code MLflow logs as a trained model's definition (MLflow's "models from code", so no
pickled object is stored): it names the pyfunc that rebuilds the model (served.py)."""

import mlflow.models

from shardwise.training.tracking.served import TrainedModel

mlflow.models.set_model(TrainedModel())
