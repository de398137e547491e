"""`shardwise plan`: which layout fits, how fast a step runs, how long a run takes — from a model's
shape, a parameter count or a job file, on preset or calibrated hardware. Pure arithmetic apart
from `calibrate` (which measures this machine) and `model.from_job` (which builds the job's model
on the meta device)."""
