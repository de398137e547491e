"""Training one model across processes, GPUs and machines: the job file (config/), the
launchers, the trainer, the parallel layouts, communication, checkpoints, faults and tracking."""
