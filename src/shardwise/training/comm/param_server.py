"""Asynchronous updates with bounded staleness: a parameter server on rank 0, workers that do not
wait for each other, on `torch.distributed` point-to-point messages (gloo or NCCL).

Why a server rank and not Ray actors: the trainer's workers already are a process group (the
launcher, restarts and checkpoints are built on it), and point-to-point messages need nothing
else running; a server thread in rank 0 holds the master parameters and the optimizer.

The protocol is stale-synchronous (SSP, Ho et al. 2013), with the bound `train.max_staleness`
(k):
- every step each worker pushes its gradient (of its share of the global batch, computed on the
  parameter version it holds) tagged with its clock c (the steps it has pushed before) and that
  version b;
- the server applies update c (the optimizer, at step c's learning rate) as soon as every
  worker's c-th gradient is in: their mean, summed in worker order. Version c + 1 results;
- a worker then pulls the newest version, waiting only while it is older than c + 1 − k: a fast
  worker runs up to k steps ahead of the slowest on stale parameters instead of waiting.
A gradient is therefore never more than k versions old when applied: nothing is rejected or
down-weighted; the bound is kept by making the fastest wait. k = 0 is synchronous training:
every update is the mean of gradients all computed on the version it updates (DDP, summed in
another order). The staleness c − b of every applied gradient is counted
(`async/staleness_mean`, `async/staleness_max`, and `async/staleness_<s>` for each s ≤ k).

Which version each pull got is the only thing timing decides. Rank 0 records every pull as one
line of `<run_dir>/async_order.jsonl`; a run with `train.async_replay` set to such a file serves
each pull exactly the version recorded (the server keeps the last k + 1 versions), so it
replays the run bit for bit. At the last step every worker waits for the final version, so all
ranks end with the same model. The trade-off: steps no longer wait for the slowest rank, and
gradients up to k updates old move the model less well than fresh ones.

Traffic: each worker sends its gradient and receives the parameters every step; rank 0 (server)
sends the parameters to every other worker: (n − 1)·P per step, more than a ring all-reduce's
2(n − 1)/n·P. A server is a bottleneck by design; its gain is not waiting.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.training.comm.base import Sync, start_together, views

HEADER, GRADIENT, PARAMETERS = 1, 2, 3  # message tags
BYE = -1


class Server:
    """Rank 0's master copy: parameters, optimizer, the rounds being gathered, the pulls that
    wait. Remote workers reach it through a thread (`serve`); rank 0's own worker calls it."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        workers: int,
        staleness: int,
        group: dist.ProcessGroup,
        record: Path,
        replay: dict[tuple[int, int], int] | None,
    ) -> None:
        self.workers, self.staleness, self.group = workers, staleness, group
        self.params = [p.detach().clone() for p in params]
        self.sizes = [p.numel() for p in self.params]
        self.optimizer = _like(optimizer, self.params)
        self.scheduler = scheduler
        self.version = 0
        self.rounds: dict[int, dict[int, torch.Tensor]] = {}
        self.waiting: list[tuple[int, int, bool]] = []  # (worker, clock, last step) pulls
        self.staleness_counts: Counter[int] = Counter()
        self.replay = replay
        self.history: dict[int, torch.Tensor] = {0: self.flat()}
        self.record = record.open("a", buffering=1)
        self.cond = threading.Condition()
        self.threads: list[threading.Thread] = []
        self.remaining = 0
        self.failure: RuntimeError | None = None
        """Set when a remote worker's messages fail (it is gone): every wait ends with it."""
        self.sent = 0.0

    def flat(self) -> torch.Tensor:
        return torch.cat([p.flatten() for p in self.params])

    # -- updates -------------------------------------------------------------------------------

    def push(self, worker: int, clock: int, base: int, grad: torch.Tensor) -> None:
        with self.cond:
            self.rounds.setdefault(clock, {})[worker] = grad
            self.staleness_counts[clock - base] += 1
            while len(self.rounds.get(self.version, {})) == self.workers:
                self._apply(self.rounds.pop(self.version))
            self.cond.notify_all()

    @torch.no_grad()
    def _apply(self, grads: dict[int, torch.Tensor]) -> None:
        total = grads[0].clone()
        for w in range(1, self.workers):
            total += grads[w]
        total /= self.workers
        for p, grad in zip(self.params, views(total, self.params), strict=True):
            p.grad = grad
        for i, group in enumerate(self.optimizer.param_groups):  # step `version`'s rate
            group["lr"] = self.scheduler.base_lrs[i] * self.scheduler.lr_lambdas[i](self.version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.replay is not None:
            self.history[self.version] = self.flat()
            for old in [v for v in self.history if v < self.version - self.staleness - 1]:
                del self.history[old]

    # -- pulls ---------------------------------------------------------------------------------

    def _servable(self, worker: int, clock: int, last: bool) -> int | None:
        """The version to give a worker that pushed its `clock`-th gradient, or None while it
        must wait."""
        if self.replay is not None:
            wanted = self.replay[(worker, clock)]
            return wanted if self.version >= wanted else None
        needed = clock + 1 if last else clock + 1 - self.staleness
        return self.version if self.version >= needed else None

    def _parameters(self, version: int) -> torch.Tensor:
        return self.history[version] if self.replay is not None else self.flat()

    def pull(self, worker: int, clock: int, last: bool) -> tuple[torch.Tensor, int]:
        """Rank 0's own worker: wait for its version, then take it."""
        with self.cond:
            while (version := self._servable(worker, clock, last)) is None:
                if self.failure is not None:
                    raise self.failure
                self.cond.wait()
            self._log(worker, clock, version)
            return self._parameters(version).clone(), version

    def _log(self, worker: int, clock: int, version: int) -> None:
        self.record.write(json.dumps({"worker": worker, "clock": clock, "version": version}) + "\n")

    # -- the threads serving the other workers ------------------------------------------------
    # gloo completes a receive only inside `wait()` (polling `is_completed()` never sees it), so
    # a thread per remote worker blocks receiving its pushes and another sends the parameters
    # each pull may have. A receive from one worker, not from any: gloo fails it as soon as that
    # worker's connection closes, where a receive from any source waited on (a killed worker's
    # survivors sat in rank 0's pull until their patience after SIGTERM ran out, 10 s).

    def start(self) -> None:
        if self.workers > 1:
            self.remaining = self.workers - 1
            self.threads = [
                threading.Thread(
                    target=self._receive, args=(w,), name=f"shardwise-server-in-{w}", daemon=True
                )
                for w in range(1, self.workers)
            ]
            self.threads.append(
                threading.Thread(target=self._send, name="shardwise-server-out", daemon=True)
            )
            for thread in self.threads:
                thread.start()

    def _receive(self, worker: int) -> None:
        try:
            while True:
                header = torch.zeros(4, dtype=torch.int64)
                dist.recv(header, src=worker, group=self.group, tag=HEADER)
                _, clock, base, last = header.tolist()
                if clock == BYE:
                    with self.cond:
                        self.remaining -= 1
                        self.cond.notify_all()
                    return
                grad = torch.empty(sum(self.sizes))  # messages travel through host memory (gloo)
                dist.recv(grad, src=worker, group=self.group, tag=GRADIENT)
                with self.cond:
                    self.waiting.append((worker, clock, bool(last)))
                self.push(worker, clock, base, grad.to(self.params[0].device))
        except RuntimeError as e:  # the worker is gone: rank 0's pull fails with gloo's words
            with self.cond:
                self.failure = RuntimeError(f"the parameter server lost worker {worker}: {e}")
                self.cond.notify_all()

    def _send(self) -> None:
        while True:
            with self.cond:
                while (
                    not (answers := self._answers())
                    and (self.remaining or self.waiting)
                    and self.failure is None
                ):
                    self.cond.wait()
                if self.failure is not None or not (answers or self.remaining or self.waiting):
                    return
            for w, flat, version in answers:
                message = torch.cat([flat, torch.tensor([float(version)])])
                dist.send(message, dst=w, group=self.group, tag=PARAMETERS)
                self.sent += flat.numel() * 4

    def _answers(self) -> list[tuple[int, torch.Tensor, int]]:
        """The waiting remote workers that may now have their parameters (under the lock)."""
        answers = []
        for w, c, last in list(self.waiting):
            version = self._servable(w, c, last)
            if version is not None:
                self.waiting.remove((w, c, last))
                self._log(w, c, version)
                answers.append((w, self._parameters(version).cpu(), version))
        return answers

    def close(self) -> None:
        for thread in self.threads:
            thread.join()
        self.record.close()


class AsyncSync(Sync):
    """A worker's side: push the gradient, pull a version, train on it."""

    name = "async"
    meets_every_step = False

    def __init__(
        self,
        parts: list[nn.Module],
        group: dist.ProcessGroup,
        *,
        optimizers: list[torch.optim.Optimizer],
        scheduler: Any,
        staleness: int,
        steps: int,
        record: Path,
        replay: Path | None,
    ) -> None:
        super().__init__(parts, group)
        (self.part,) = parts
        self.params = [p for p in self.part.parameters() if p.requires_grad]
        self.steps, self.staleness = steps, staleness
        self.rank = dist.get_rank(group)
        start_together(self.params, group)
        self.p2p = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
        self.base = 0  # the version this worker's parameters are
        self.closed = False
        self._server_mark = 0.0  # the server's bytes sent as of the last metrics
        self.server: Server | None = None
        if self.rank == 0:
            self.server = Server(
                self.params,
                optimizers[0],
                scheduler,
                workers=self.ranks,
                staleness=staleness,
                group=self.p2p,
                record=record,
                replay=_read_replay(replay) if replay else None,
            )
            self.server.start()

    def micro_batch(
        self, part: nn.Module, *, last: bool, step: int
    ) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # gradients stay local until pushed

    @torch.no_grad()
    def apply(
        self,
        optimizers: list[torch.optim.Optimizer],
        scaler: Any,
        step: int,
        *,
        skip: torch.Tensor | None,
    ) -> None:
        """Push this step's gradient (zeros when it is not finite: the update is then the other
        workers' alone, scaled as usual), pull the parameters the protocol allows."""
        clock, last = step - 1, step == self.steps
        grad = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in self.params]
        )
        if skip is not None:
            grad = torch.where(skip == 0, grad, 0.0)
        if self.server is not None:
            self.server.push(0, clock, self.base, grad)
            flat, version = self.server.pull(0, clock, last)
        else:
            header = torch.tensor([self.rank, clock, self.base, int(last)], dtype=torch.int64)
            dist.send(header, dst=0, group=self.p2p, tag=HEADER)
            dist.send(grad.cpu(), dst=0, group=self.p2p, tag=GRADIENT)  # gloo: host memory
            message = torch.empty(grad.numel() + 1)
            dist.recv(message, src=0, group=self.p2p, tag=PARAMETERS)
            flat, version = message[:-1].to(grad.device), int(message[-1])
            self.traffic.sent += grad.numel() * 4
        self.base = version
        for p, value in zip(self.params, views(flat, self.params), strict=True):
            p.copy_(value)
        self.traffic.steps += 1
        self.traffic.uncompressed += 2 * (self.ranks - 1) / self.ranks * self._full
        if last:
            self.close()

    def close(self) -> None:
        """Remote workers say goodbye; rank 0 waits for its server's threads to finish."""
        if self.closed:
            return
        self.closed = True
        if self.server is not None:
            self.server.close()
        elif self.ranks > 1:
            bye = torch.tensor([self.rank, BYE, 0, 0], dtype=torch.int64)
            dist.send(bye, dst=0, group=self.p2p, tag=HEADER)

    def metrics(self) -> dict[str, float]:
        """Rank 0's server sends for everyone: its bytes per step over the window (as the
        base's), and since start."""
        out = super().metrics()
        if self.server is not None:
            steps = max(self.traffic.window_steps, 1)
            sent = (self.server.sent - self._server_mark) / steps
            self._server_mark = self.server.sent
            out["comm/bytes_per_step"] = sent
            overall = self.server.sent / max(self.traffic.steps, 1)
            out["comm/bytes_per_step_since_start"] = overall
            full = self.traffic.window_uncompressed / steps
            out["comm/compression_ratio"] = full / sent if sent else 1.0
            full = self.traffic.uncompressed / max(self.traffic.steps, 1)
            out["comm/compression_ratio_since_start"] = full / overall if overall else 1.0
            counts = self.server.staleness_counts
            total = sum(counts.values())
            if total:
                out["async/staleness_mean"] = sum(s * n for s, n in counts.items()) / total
                out["async/staleness_max"] = float(max(counts))
                out.update({f"async/staleness_{s}": float(n) for s, n in sorted(counts.items())})
        return out

    def consensus(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """The server's parameters (broadcast from rank 0: every rank writes the same)."""
        device = self.params[0].device
        flat = (
            self.server.flat()
            if self.server is not None
            else torch.empty(self._numel(), device=device)
        )
        dist.broadcast(flat, src=dist.get_process_group_ranks(self.group)[0], group=self.group)
        names = [n for n, p in self.part.named_parameters() if p.requires_grad]
        out = dict(model_state)
        for name, value in zip(names, views(flat, self.params), strict=True):
            if name in out:
                out[name] = value.clone()
        return out

    def _numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def state_dict(self, rank: int) -> dict[str, Any]:
        """This worker's parameters and version; on rank 0 also the server's version, optimizer
        state and (in `consensus`) parameters. Saved where every rank has pushed the same number
        of gradients, so no round is half gathered."""
        mine: dict[str, Any] = {f"model.{i}": p.detach().clone() for i, p in enumerate(self.params)}
        mine["version"] = torch.tensor(self.base)
        if self.server is not None:
            server = self.server
            with server.cond:
                mine["server.version"] = torch.tensor(server.version)
                for i, p in enumerate(server.params):
                    mine[f"server.param.{i}"] = p.detach().clone()
                    for key, value in server.optimizer.state.get(p, {}).items():
                        if isinstance(value, torch.Tensor):
                            mine[f"server.optim.{i}.{key}"] = value.clone()
        return {f"rank{rank}": mine}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        mine = state.get(f"rank{rank}", {})
        for i, p in enumerate(self.params):
            if f"model.{i}" in mine:
                p.copy_(mine[f"model.{i}"])
        if "version" in mine:
            self.base = int(mine["version"])
        if self.server is not None and "server.version" in mine:
            server = self.server
            with server.cond:
                server.version = int(mine["server.version"])
                for i, master in enumerate(server.params):
                    master.copy_(mine[f"server.param.{i}"])
                    kept = server.optimizer.state.get(master, {})
                    for key in list(kept):
                        if f"server.optim.{i}.{key}" in mine:
                            kept[key] = mine[f"server.optim.{i}.{key}"].clone()
                server.history = {server.version: server.flat()}


def _like(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """A new optimizer of the same kind and groups over `params` (copies, in the same order),
    with its state made (zeros), so a checkpoint has every key before the first update."""
    position = {
        id(p): i for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"])
    }
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [params[position[id(q)]] for q in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    kind: Any = type(optimizer)
    made: torch.optim.Optimizer = kind(groups, lr=optimizer.defaults["lr"])  # options: in groups
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in made.param_groups]
    for g in made.param_groups:
        g["lr"] = 0.0
    made.step()
    for g, lr in zip(made.param_groups, lrs, strict=True):
        g["lr"] = lr
    for state in made.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.zero_()
    made.zero_grad(set_to_none=True)
    return made


def _read_replay(path: Path) -> dict[tuple[int, int], int]:
    order: dict[tuple[int, int], int] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            event = json.loads(line)
            order[(int(event["worker"]), int(event["clock"]))] = int(event["version"])
    return order
