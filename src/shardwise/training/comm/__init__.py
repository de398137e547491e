"""How data-parallel ranks keep their models in agreement: one `Sync` object per run, chosen from
the config by `build`, called by `trainer.step.train_step`. Each mode is its own module:

- `base`: every step, the data-parallel wrapper (DDP, FSDP2) all-reduces gradients in backward;
- `compression`: DDP comm hooks that send bf16/fp16, int8 or PowerSGD factors instead of fp32,
  with error feedback, over a flat or node-aware (`hierarchical`) reduction;
- `local_sgd`: ranks train alone and average parameters every H steps; DiLoCo adds an outer
  Nesterov optimizer over the averaged change;
- `param_server`: asynchronous updates through a parameter server with bounded staleness.
"""
