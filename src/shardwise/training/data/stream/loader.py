"""Each step's micro-batches for this data-parallel rank, read from a streamed table ahead of need.

The order of samples (order.py) is fixed by the seed and the epoch; the position (epoch, offset
into the epoch's sequence) is the whole state, as for map-style data (sampling.py): saved after a
step and restored, the run goes on with the very next sample, on any number of ranks.

Reading. A rank plans its steps a window ahead: which fragments each step needs and which rows of
them. Reading threads (`read_threads`) fetch and decode the fragments (pyarrow releases the GIL)
of this window and the next while the model trains; each fragment is read once per epoch by the
one rank (and the one thread) that needs it, and kept decoded until the last step that uses it.
A rank holds its share of two windows: about `2 · shuffle_rows / dp` rows.

Assembling. The steps' rows are gathered from the fragments a run of steps at a time (up to
`ASSEMBLE_BYTES` of int64 rows, within one window): a handful of tensor operations per run instead
of several per step. Each operation lets go of the interpreter lock, which the reading threads
(fsspec's requests are Python) then hold for a while: per step, that waiting was most of a
step's cost in bench/stream_read.py.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from shardwise.common.errors import ConfigError
from shardwise.training.data.sampling import enough
from shardwise.training.data.stream.columns import widened
from shardwise.training.data.stream.order import EpochOrder, rank_slice
from shardwise.training.data.stream.table import Pair, Stream

ASSEMBLE_BYTES = 1 * 2**20
"""The most a run of assembled steps holds (its rows as int64 or float32): one step of long
token sequences, dozens of short ones."""


class StreamLoader:
    """Yields, for each optimizer step, this rank's list of micro-batches `(inputs, target)`."""

    def __init__(
        self,
        stream: Stream,
        *,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        pin_memory: bool = False,
        allow_changed: bool = False,
    ) -> None:
        enough(stream.snapshot.rows, global_batch, "the training data")
        self.stream = stream
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.pin_memory = pin_memory
        self.allow_changed = allow_changed
        self.epoch = 0
        self.offset = 0
        self._pool = ThreadPoolExecutor(
            stream.source.read_threads, thread_name_prefix="shardwise-read"
        )
        self._reset()

    @property
    def steps_per_epoch(self) -> int:
        return self.stream.snapshot.rows // self.global_batch

    @property
    def dropped_per_epoch(self) -> int:
        return self.stream.snapshot.rows % self.global_batch

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        step = self.offset // self.global_batch
        self._plan_through(step)
        if step not in self._ready:
            self._assemble(step)
        inputs, target = self._ready.pop(step)
        batches = []
        for begin in range(0, len(inputs), self.micro_batch):
            end = begin + self.micro_batch
            x, y = self.stream.batch(
                inputs[begin:end], None if target is None else target[begin:end]
            )
            assert y is not None
            batches.append((x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y))
        self._advance()
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "version": self.stream.snapshot.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("version")
        if saved != self.stream.snapshot.version and not self.allow_changed:
            raise ConfigError(changed_message(saved, self.stream.snapshot.version))
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        if self.offset + self.global_batch > self.stream.snapshot.rows:  # the batch changed
            self.epoch, self.offset = self.epoch + 1, 0
        self._reset()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _advance(self) -> None:
        self.offset += self.global_batch
        if self.offset + self.global_batch > self.stream.snapshot.rows:
            self.epoch, self.offset = self.epoch + 1, 0
            self._reset()

    def _reset(self) -> None:
        """Start planning (and reading) afresh at the current position."""
        self._order = EpochOrder(
            self.stream.counts, self.seed, self.epoch, self.stream.source.shuffle_rows
        )
        # per planned step: the fragment and the row in it of each of this rank's samples
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._planned = self.offset // self.global_batch  # the next step to plan
        self._last_use: dict[int, int] = {}
        self._read: dict[int, Future[Pair]] = {}
        self._ready: dict[int, Pair] = {}  # assembled steps

    def _plan_through(self, step: int) -> None:
        """Plan, and start reading for, every step to the end of the window after the one that
        holds `step`'s samples: the next window's row groups arrive while this one trains, and
        each fragment planned has its every use in this epoch known (its last use frees it)."""
        last = self.steps_per_epoch - 1
        end = (min(step, last) + 1) * self.global_batch
        ends = self._order.window_ends
        current = next((i for i, e in enumerate(ends) if e >= end), len(ends) - 1)
        window_end = ends[min(current + 1, len(ends) - 1)]
        through = min((window_end - 1) // self.global_batch, last)
        if self._planned > through:
            return
        # every step to `through` at once (a step's ids sorted, this rank's contiguous share of
        # them, located in their fragments): the same plan as step by step, in a few tensor
        # operations per window instead of several per step
        first, steps, batch = self._planned, through - self._planned + 1, self.global_batch
        ids = self._order.sequence(first * batch, (through + 1) * batch).view(steps, batch)
        mine = rank_slice(ids.sort(dim=1).values.T, self.dp_rank, self.dp_size).T.contiguous()
        fragments, rows = (t.view(steps, -1).numpy() for t in self._order.locate(mine.view(-1)))
        for i in range(steps):
            self._plans[first + i] = (fragments[i], rows[i])
            cuts = np.flatnonzero(np.diff(fragments[i])) + 1  # sorted ids: grouped by fragment
            for f in fragments[i][[0, *cuts.tolist()]].tolist():
                self._last_use[f] = first + i
                self._fetch(f)
        self._planned = through + 1

    def _assemble(self, step: int) -> None:
        """Gather the rows of `step` and of the planned steps after it in its window, up to
        `ASSEMBLE_BYTES`, from their fragments (waiting for the reads): per fragment one gather
        of all its rows these steps use, then one to put them in the steps' order. The rows, and
        their order, are each step's as planned."""
        window_end = next(e for e in self._order.window_ends if e >= (step + 1) * self.global_batch)
        last = min((window_end // self.global_batch) - 1, self._planned - 1)
        fragments, rows = self._plans[step]
        row_bytes = self._read[int(fragments[0])].result()[0][0].numel() * 8  # int64, or less
        count = max(1, min(last - step + 1, ASSEMBLE_BYTES // (row_bytes * len(rows))))
        plans = [self._plans.pop(s) for s in range(step, step + count)]
        where = np.concatenate([f for f, _ in plans])
        which = np.concatenate([r for _, r in plans])
        order = np.argsort(where, kind="stable")  # grouped by fragment, each group in step order
        used, begins = np.unique(where[order], return_index=True)
        bounds = [*begins.tolist(), len(order)]
        parts = [self._read[int(f)].result() for f in used]
        picks = [torch.from_numpy(which[order[a:b]]) for a, b in itertools.pairwise(bounds)]
        back = torch.from_numpy(np.argsort(order, kind="stable"))  # to the steps' order
        inputs = widened(
            torch.cat([p[0].index_select(0, r) for p, r in zip(parts, picks, strict=True)])
        )
        inputs = inputs.index_select(0, back)
        target = None
        if parts[0][1] is not None:
            target = torch.cat([p[1].index_select(0, r) for p, r in zip(parts, picks, strict=True)])  # type: ignore[union-attr]
            target = widened(target).index_select(0, back)
        share = len(rows)
        for k in range(count):
            self._ready[step + k] = (
                inputs[k * share : (k + 1) * share],
                None if target is None else target[k * share : (k + 1) * share],
            )
        for f in used.tolist():  # read no more: free it
            if self._last_use[f] < step + count:
                self._read.pop(f, None)

    def _fetch(self, fragment: int) -> None:
        if fragment not in self._read:
            self._read[fragment] = self._pool.submit(self.stream.read, fragment)


def changed_message(saved: Any, now: dict[str, Any]) -> str:
    return (
        f"the training data changed since the checkpoint was written (then: {saved}; now: "
        f"{now}); a resumed run would not read the samples the run would have read. Train on "
        "the version the checkpoint names (data.args.version, snapshot_id), or set "
        "data.allow_changed = true to go on with the data as it is"
    )
