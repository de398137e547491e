"""Each step's micro-batches for this data-parallel rank, read from a streamed table ahead of need.

The order of samples (order.py) is fixed by the seed and the epoch; the position (epoch, offset
into the epoch's sequence) is the whole state, as for map-style data (sampling.py): saved after a
step and restored, the run goes on with the very next sample, on any number of ranks.

Reading. A rank plans its steps two windows ahead (one where two would pass
`READ_AHEAD_BYTES`): which fragments each step needs and which rows of them. Reading threads
(`read_threads`) fetch and decode the fragments (pyarrow releases the GIL) of those windows while
the model trains on this one; each fragment is read once per epoch by the one rank (and the one
thread) that needs it.

Assembling. A reading thread copies each fragment it read to its place in its window's array
(window.py: integers as narrow as stored; the arrays of windows let go are written over), and
the steps' rows are gathered from that array a run of steps at a time (up to `ASSEMBLE_BYTES`
of int64 rows): one gather per run, already in the steps' order, and (with no transform of a
whole batch, or `next_token`) widened to int64 in one copy per run. Per step, gathering from
each fragment and reordering cost more than the one copy a fragment takes into its window
(bench/stream_read.py). A rank holds its share of three windows, about `3 · shuffle_rows / dp`
rows (two where `READ_AHEAD_BYTES` says so), and up to `SPARE_ARRAYS` arrays of windows let go.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from shardwise.common.errors import ConfigError
from shardwise.training.data.sampling import enough
from shardwise.training.data.stream.order import EpochOrder, rank_slice
from shardwise.training.data.stream.source import READ_ERRORS, data_problem
from shardwise.training.data.stream.table import Pair, Stream
from shardwise.training.data.stream.window import Spare, Window

READ_AHEAD_BYTES = 256 * 2**20
"""The most a rank reads ahead of the window it trains on (uncompressed, as the footers count
it) to read two windows ahead rather than one."""
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
        self._spare = Spare()
        self._reset()

    @property
    def steps_per_epoch(self) -> int:
        return self.stream.snapshot.rows // self.global_batch

    @property
    def dropped_per_epoch(self) -> int:
        return self.stream.snapshot.rows % self.global_batch

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        step = self.offset // self.global_batch
        try:
            self._plan_through(step)
            if step not in self._ready:
                self._assemble(step)
        except READ_ERRORS as e:  # what only reading finds, or storage that failed mid-run
            raise ConfigError(
                f"{data_problem(e)}; the run stopped before this step, its last checkpoint "
                "is whole: mend the data, then continue with --resume auto --set "
                "data.allow_changed=true"
            ) from None
        inputs, target = self._ready.pop(step)
        batches = []
        for begin in range(0, len(inputs), self.micro_batch):
            end = begin + self.micro_batch
            x, y = inputs[begin:end], None if target is None else target[begin:end]
            if not self.stream.by_rows:  # else made a run of steps at a time (`_assemble`)
                x, y = self.stream.batch(x, y)
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
        self._quiet_through = -1  # the last step planning has nothing to add for
        self._read: dict[int, Future[None]] = {}  # fragments being read into their windows
        self._requested: set[int] = set()  # every fragment this epoch asked for
        self._windows: dict[int, Window] = {}  # windows read into
        self._arrived: dict[int, Pair] = {}  # windows whose fragments (this rank's) all arrived
        self._place = np.zeros(len(self.stream.counts), dtype=np.int64)  # a fragment's first
        # row in its window's arrays (the rows of the fragments asked for before it)
        self._filled: dict[int, int] = {}  # rows asked for of each window
        self._ready: dict[int, Pair] = {}  # assembled steps
        self._window_bytes = [  # each window's bytes, uncompressed (for `_ahead`)
            sum(self.stream.blocks[f].bytes for f in window) for window in self._order.windows
        ]

    def _plan_through(self, step: int) -> None:
        """Plan, and start reading for, every step to the end of the windows ahead of the one
        that holds `step`'s samples (`_ahead`): their row groups arrive while this one trains,
        and every window up to them has all its steps planned (so it is known which of its
        fragments this rank reads, once each). Steps that end in the window the last call's
        step ended in add nothing: those return at once."""
        if step <= self._quiet_through:
            return
        last = self.steps_per_epoch - 1
        end = (min(step, last) + 1) * self.global_batch
        ends = self._order.window_ends
        current = next((i for i, e in enumerate(ends) if e >= end), len(ends) - 1)
        self._quiet_through = ends[current] // self.global_batch - 1
        window_end = ends[min(current + self._ahead(current), len(ends) - 1)]
        through = min((window_end - 1) // self.global_batch, last)
        if self._planned > through:
            return
        # every step to `through` at once (a step's ids sorted, this rank's contiguous share of
        # them, located in their fragments): the same plan as step by step, in a few tensor
        # operations per window instead of several per step
        first, steps, batch = self._planned, through - self._planned + 1, self.global_batch
        ids = self._order.sequence(first * batch, (through + 1) * batch).numpy()
        ordered = np.sort(ids.reshape(steps, batch), axis=1)  # numpy: loader.py's note below
        mine = rank_slice(ordered.T, self.dp_rank, self.dp_size).T  # type: ignore[arg-type]
        fragments, rows = self._order.locate(mine)
        for i in range(steps):
            self._plans[first + i] = (fragments[i], rows[i])
        needed, at = np.unique(fragments, return_index=True)
        for f in needed[np.argsort(at, kind="stable")].tolist():  # in the order steps need them
            if f not in self._requested:
                self._requested.add(f)
                window = self._window_of(f)
                place = self._place[f] = self._filled[window]
                self._filled[window] += self.stream.counts[f]
                self._read[f] = self._pool.submit(self._read_into, f, self._windows[window], place)
        self._planned = through + 1

    def _window_of(self, fragment: int) -> int:
        """The window `fragment` is read into (made when the first of its fragments is asked
        for)."""
        index = int(self._order.window_of[fragment])
        if index not in self._windows:
            ends = self._order.window_ends
            rows = ends[index] - (ends[index - 1] if index else 0)
            columns = self.stream.source.columns
            names = (", ".join(columns.inputs), columns.target)
            self._windows[index] = Window(rows, self.stream.dtypes, names, self._spare)
            self._filled[index] = 0
        return index

    def _read_into(self, fragment: int, window: Window, place: int) -> None:
        """Read `fragment` (on a reading thread) to rows `place` on of `window`."""
        window.put(place, self.stream.read_parts(fragment), self.stream.locate(fragment))

    def _ahead(self, current: int) -> int:
        """How many windows to read ahead of window `current`: two where their share of this
        rank fits in `READ_AHEAD_BYTES` (decoding a window takes longer than training on one
        can: with one ahead the reads fell behind, bench/stream_read.py 0.70x pyarrow's scan,
        0.86-0.94x with two), else one."""
        share = sum(self._window_bytes[current + 1 : current + 3]) / self.dp_size
        return 2 if share <= READ_AHEAD_BYTES else 1

    def _window(self, index: int) -> Pair:
        """Window `index`'s arrays, once the fragments this rank reads of it arrived: a run
        of steps is then one gather. The window is let go once its last step is assembled."""
        arrived = self._arrived.get(index)
        if arrived is not None:
            return arrived
        last_step = min((self._order.window_ends[index] - 1) // self.global_batch,
                        self.steps_per_epoch - 1)  # fmt: skip
        assert self._planned > last_step, "a window is gathered from once its steps are planned"
        for fragment in self._order.windows[index]:
            reading = self._read.pop(fragment, None)
            if reading is not None:
                reading.result()
        arrived = self._arrived[index] = self._windows[index].tensors()
        return arrived

    def _assemble(self, step: int) -> None:
        """Gather the rows of `step` and of the planned steps after it in its window, up to
        `ASSEMBLE_BYTES`, from their windows: one gather per run (one per window where its
        first step spans windows). The rows, and their order, are each step's as
        planned."""
        window_ends = self._order.window_ends
        window_end = next(e for e in window_ends if e >= (step + 1) * self.global_batch)
        last = min((window_end // self.global_batch) - 1, self._planned - 1)
        for index in [i for i in self._windows if (window_ends[i] - 1) // self.global_batch < step]:
            window = self._windows.pop(index)  # every later step is past it
            if self._arrived.pop(index, None) is not None:  # its reads are done
                self._spare.give(window)
        fragments, rows = self._plans[step]
        row_bytes = self._window(int(self._order.window_of[fragments[0]]))[0][0].numel() * 8
        count = max(1, min(last - step + 1, ASSEMBLE_BYTES // (row_bytes * len(rows))))
        plans = [self._plans.pop(s) for s in range(step, step + count)]
        where = np.concatenate([f for f, _ in plans])
        windows = self._order.window_of[where]
        found = _distinct(windows)
        for index in found:
            self._window(index)
        at = torch.from_numpy(self._place[where] + np.concatenate([r for _, r in plans]))
        inputs, target = self._gather(windows, found, at)
        if self.stream.by_rows:  # the run's samples made at once (widened), not step by step
            inputs, target = self.stream.batch(inputs, target)
        share = len(rows)
        for k in range(count):
            self._ready[step + k] = (
                inputs[k * share : (k + 1) * share],
                None if target is None else target[k * share : (k + 1) * share],
            )

    def _gather(self, windows: np.ndarray, found: list[int], at: torch.Tensor) -> Pair:
        """The rows at `at` of the windows `windows` (one per row; `found`: the distinct
        ones), as narrow as stored (`Stream.batch` widens them, after slicing where
        `next_token` does: one copy fewer)."""
        if len(found) == 1:
            inputs, target = self._arrived[found[0]]
            return _take(inputs, at), None if target is None else _take(target, at)
        pieces = [  # a run whose first step spans windows
            (torch.from_numpy(np.flatnonzero(windows == w)), self._arrived[w]) for w in found
        ]
        gathered: list[torch.Tensor | None] = []
        for side in (0, 1):
            if pieces[0][1][side] is None:
                gathered.append(None)
                continue
            out: torch.Tensor | None = None
            for positions, joined in pieces:
                values = _take(joined[side], at[positions])  # type: ignore[arg-type]
                if out is None:
                    out = values.new_empty((len(at), *values.shape[1:]))
                out[positions] = values
            gathered.append(out)
        assert gathered[0] is not None
        return gathered[0], gathered[1]


# The loader moves data with numpy, on the calling thread alone: torch's operators would run
# them on its intra-op threads, which wait on the cores the reading threads decode on (a run of
# steps gathered 5 to 7 times slower than alone; bench/stream_read.py: 0.6x pyarrow's scan with
# torch's, 0.85x with one thread).


def _distinct(windows: np.ndarray) -> list[int]:
    """The windows a run of steps reads from: nearly always one (np.unique sorts)."""
    first = int(windows[0])
    return [first] if (windows == first).all() else np.unique(windows).tolist()


def _take(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.take(values.numpy(), at.numpy(), axis=0))


def changed_message(saved: Any, now: dict[str, Any]) -> str:
    return (
        f"the training data changed since the checkpoint was written (then: {saved}; now: "
        f"{now}); a resumed run would not read the samples the run would have read. Train on "
        "the version the checkpoint names (data.args.version, snapshot_id), or set "
        "data.allow_changed = true to go on with the data as it is"
    )
