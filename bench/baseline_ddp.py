"""The baseline for bench/ddp_overhead.py: the DDP loop a PyTorch user writes by hand, on the same
model, data, optimizer, schedule and clipping as examples/digits.toml (or text-gpt), using the
standard idioms (DataLoader + DistributedSampler). Run under torchrun:

    torchrun --standalone --nproc-per-node 2 bench/baseline_ddp.py \
        --job examples/digits.toml --steps 500
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from shardwise.training import job_names
from shardwise.training.config.derive import derive
from shardwise.training.config.load import load_config
from shardwise.training.trainer.optim import build_optimizer, lr_factor


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train_loop()
    # DDP's reducer holds the process group: free it first, or gloo's teardown can abort the
    # process ("terminate called without an active exception") at exit.
    gc.collect()
    dist.destroy_process_group()


def train_loop() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = load_config(args.job, [*args.overrides, f"train.steps={args.steps}"])
    derived = derive(config, world)
    train = config.train

    torch.manual_seed(config.job.seed)
    model = DistributedDataParallel(job_names.build_model(config))
    train_set, _ = job_names.build_datasets(config)
    sampler = DistributedSampler(train_set, shuffle=True, seed=config.job.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=derived.micro_batch, sampler=sampler, drop_last=True)
    # The same parameter groups as shardwise (no weight decay on biases and norms), so both
    # do the same optimizer work.
    optimizer = build_optimizer(model, train, lr=derived.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(k + 1, train))
    loss_fn = job_names.build_loss(config)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(len(loader) // derived.grad_accum):
            for i in range(derived.grad_accum):
                inputs, target = next(batches)
                last = i == derived.grad_accum - 1
                with model.no_sync() if not last else torch.enable_grad():
                    loss = loss_fn(model(inputs), target) / derived.grad_accum
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % config.tracking.log_every == 0 and rank == 0:
                print(f"step {step} loss {loss.item() * derived.grad_accum:.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1


if __name__ == "__main__":
    main()
