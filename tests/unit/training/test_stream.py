"""Streamed tables (training/data/stream/): the order of an epoch, the split across ranks, the
position a resume restores, and the columns a table can be trained on. Real Parquet files on
disk; the object store and the table formats are tested in tests/integration/test_stream_*."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardwise.common.errors import ConfigError
from shardwise.training.data.stream.builtins import build_parquet
from shardwise.training.data.stream.loader import StreamLoader
from shardwise.training.data.stream.order import EpochOrder
from shardwise.training.data.stream.source import DataError

ROW_GROUPS = [[7, 13], [1], [20, 20, 5], [9], [16, 3, 6]]
"""Rows per row group of each file: uneven on purpose (100 rows in all)."""


def write_ids(root: Path, row_groups=ROW_GROUPS) -> Path:
    """Files whose rows carry their id (0 … 99, in file order) and a feature derived from it."""
    root.mkdir(parents=True, exist_ok=True)
    start = 0
    for index, groups in enumerate(row_groups):
        rows = sum(groups)
        ids = list(range(start, start + rows))
        table = pa.table({"id": ids, "x": [float(i) / 100 for i in ids]})
        writer = pq.ParquetWriter(root / f"part-{index:03d}.parquet", table.schema)
        offset = 0
        for size in groups:
            writer.write_table(table.slice(offset, size))
            offset += size
        writer.close()
        start += rows
    return root


def loader(path: Path, *, dp_rank=0, dp_size=1, global_batch=8, micro_batch=None, **args):
    train, _ = build_parquet(path=str(path), inputs="x", target="id", **args)
    return StreamLoader(
        train.open(),
        global_batch=global_batch,
        micro_batch=micro_batch or global_batch // dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=5,
    )


def ids_of(step: list) -> list[int]:
    return [int(i) for _, target in step for i in target]


@pytest.mark.parametrize("shuffle_rows", [0, 10, 1000])
def test_an_epoch_is_every_row_once_in_an_order_of_the_seed_and_epoch(shuffle_rows):
    counts = (7, 13, 1, 20, 20, 5, 9, 16, 3, 6)
    order = EpochOrder(counts, seed=1, epoch=0, shuffle_rows=shuffle_rows)
    sequence = order.sequence(0, 100)
    assert sorted(sequence.tolist()) == list(range(100))
    assert torch.equal(sequence, EpochOrder(counts, 1, 0, shuffle_rows).sequence(0, 100))
    assert not torch.equal(sequence, EpochOrder(counts, 1, 1, shuffle_rows).sequence(0, 100))
    assert not torch.equal(sequence, EpochOrder(counts, 2, 0, shuffle_rows).sequence(0, 100))
    pieces = torch.cat([order.sequence(b, min(b + 8, 100)) for b in range(0, 100, 8)])
    assert torch.equal(pieces, sequence)  # read in steps or at once: the same sequence
    fragment, row = order.locate(sequence)
    assert torch.equal(order.starts[fragment] + row, sequence)


def test_the_shuffle_buffer_mixes_fragments_within_a_window_only():
    counts = (10,) * 10
    order = EpochOrder(counts, seed=0, epoch=0, shuffle_rows=30)
    assert [len(w) for w in order.windows] == [3, 3, 3, 1]
    sequence = order.sequence(0, 100)
    for window, end in zip(order.windows, order.window_ends, strict=True):
        begin = end - 10 * len(window)
        fragments = set((sequence[begin:end] // 10).tolist())
        assert fragments == set(window)
    assert len(set((sequence[:10] // 10).tolist())) > 1  # rows of several fragments interleave


def test_global_batches_hold_the_same_samples_on_any_number_of_ranks(tmp_path):
    """12 steps of 8 from 100 rows: the last 4 rows are left out, every rank takes 12 steps,
    no row is read twice, and step k's samples are the same on 1, 2 and 4 ranks."""
    path = write_ids(tmp_path / "t")
    steps = {}
    for dp in (1, 2, 4):
        ranks = [loader(path, dp_rank=r, dp_size=dp, shuffle_rows=20) for r in range(dp)]
        assert all(r.steps_per_epoch == 12 and r.dropped_per_epoch == 4 for r in ranks)
        steps[dp] = [sorted(i for r in ranks for i in ids_of(r.next_step())) for _ in range(12)]
        for rank in ranks:
            assert rank.epoch == 1 and rank.offset == 0
    assert steps[1] == steps[2] == steps[4]
    seen = [i for step in steps[1] for i in step]
    assert len(seen) == len(set(seen)) == 96
    x = loader(path, shuffle_rows=20).next_step()[0][0]
    assert x.dtype == torch.float32 and x.shape == (8,)


@pytest.mark.parametrize("assemble_bytes", [1, 200, 2**20])
def test_each_step_holds_its_planned_samples_in_order(tmp_path, monkeypatch, assemble_bytes):
    """Steps are gathered a run at a time (`ASSEMBLE_BYTES`: here one step, three, or the rest
    of a window): over two epochs, each rank's share of step k is the slice of the epoch's
    sorted ids of step k, in that order."""
    from shardwise.training.data.stream import loader as loader_module
    from shardwise.training.data.stream.order import rank_slice

    monkeypatch.setattr(loader_module, "ASSEMBLE_BYTES", assemble_bytes)
    path = write_ids(tmp_path / "t")
    for dp in (1, 2):
        for r in range(dp):
            rank = loader(path, dp_rank=r, dp_size=dp, shuffle_rows=20)
            for epoch in range(2):
                order = EpochOrder(rank.stream.counts, 5, epoch, 20)
                for k in range(12):
                    want = rank_slice(order.step_ids(k, 8), r, dp).tolist()
                    assert ids_of(rank.next_step()) == want, (dp, r, epoch, k)


def test_each_rank_reads_only_the_fragments_its_samples_are_in(tmp_path):
    """A window of about 40 rows over 2 ranks: sorted ids split by position, so each rank reads
    about half of the window's fragments, not all of them."""
    path = write_ids(tmp_path / "t", [[10] * 10])
    ranks = [loader(path, dp_rank=r, dp_size=2, shuffle_rows=40) for r in range(2)]
    for rank in ranks:
        rank.next_step()
    read = [rank._requested for rank in ranks]
    first_window = set(ranks[0]._order.windows[0])
    assert len(read[0] & first_window) < len(first_window)


def counted_reads(rank: StreamLoader) -> list[tuple[int, int]]:
    """(epoch, fragment) of every read `rank` makes from now on."""
    reads: list[tuple[int, int]] = []
    read = rank.stream.read_parts

    def counting(fragment: int):
        reads.append((rank.epoch, fragment))
        return read(fragment)

    rank.stream.read_parts = counting  # type: ignore[method-assign]
    return reads


@pytest.mark.parametrize("shuffle_rows", [0, 20])
def test_each_fragment_is_read_once_an_epoch_and_a_rank_holds_two_windows(tmp_path, shuffle_rows):
    """A window is gathered from once its fragments arrived and let go after its last step:
    over two epochs on 2 ranks, no fragment is read twice in an epoch, a rank never gathers
    from more than two windows (the one a step spans from and the one it spans into) and holds
    at most three more being read: two ahead, and the one the last step planned spans into."""
    path = write_ids(tmp_path / "t")
    for r in range(2):
        rank = loader(path, dp_rank=r, dp_size=2, shuffle_rows=shuffle_rows)
        reads = counted_reads(rank)
        for _ in range(24):
            rank.next_step()
            assert len(rank._arrived) <= 2 and len(rank._windows) <= 5
        assert len(reads) == len(set(reads)) and {e for e, _ in reads} == {0, 1}


def test_consecutive_row_groups_of_a_file_are_read_as_one_block(tmp_path):
    """One request per block, not per row group: a block holds at most a quarter of a shuffle
    window's rows (so a window mixes several) and never spans files; without shuffling, whole
    files. A block's rows are the table's, in order."""
    path = write_ids(tmp_path / "t")
    train, _ = build_parquet(path=str(path), inputs="x", target="id", shuffle_rows=100)
    stream = train.open()
    assert [(b.file, b.first, b.groups) for b in stream.blocks] == [
        (0, 0, 2), (1, 0, 1), (2, 0, 1), (2, 1, 2), (3, 0, 1), (4, 0, 3)
    ]  # fmt: skip
    assert stream.counts == (20, 1, 20, 25, 9, 25)
    assert stream.read(3)[1].tolist() == list(range(41, 66))
    train, _ = build_parquet(path=str(path), inputs="x", target="id", shuffle_rows=0)
    assert [b.groups for b in train.open().blocks] == [len(g) for g in ROW_GROUPS]


def test_the_position_resumes_with_the_very_next_sample_on_any_number_of_ranks(tmp_path):
    path = write_ids(tmp_path / "t")
    straight = loader(path, shuffle_rows=20)
    want = [ids_of(straight.next_step()) for _ in range(30)]  # into the third epoch
    first = loader(path, shuffle_rows=20)
    for _ in range(17):
        first.next_step()
    state = first.state_dict()
    assert state["epoch"] == 1 and state["offset"] == 5 * 8
    resumed = loader(path, shuffle_rows=20)
    resumed.load_state_dict(state)
    assert [ids_of(resumed.next_step()) for _ in range(13)] == want[17:]
    halves = [loader(path, dp_rank=r, dp_size=2, shuffle_rows=20) for r in range(2)]
    for half in halves:
        half.load_state_dict(state)
    again = [
        sorted(ids_of(halves[0].next_step()) + ids_of(halves[1].next_step())) for _ in range(13)
    ]
    assert again == [sorted(step) for step in want[17:]]


def test_a_resume_on_changed_data_is_refused_unless_allowed(tmp_path):
    path = write_ids(tmp_path / "t")
    state = loader(path).state_dict()
    assert state["version"]["kind"] == "parquet" and state["version"]["files"] == 5
    write_ids(tmp_path / "t", [[5]] * 6)  # another file, and the others rewritten
    with pytest.raises(ConfigError, match="the training data changed since the checkpoint"):
        loader(path).load_state_dict(state)
    allowed = loader(path)
    allowed.allow_changed = True
    allowed.load_state_dict(state)


def test_every_batch_is_contiguous_for_a_copy_to_the_gpu_that_does_not_wait(tmp_path):
    """`next_token` cuts each row into two overlapping views. A view copied to a GPU goes
    through an unpinned contiguous copy, and a copy from unpinned memory waits for the device:
    on an H100 the streamed GPT example's step was 1.07x the in-memory one's. The loader's
    micro-batches (and so what it pins) are contiguous."""
    tokens = pa.array([[i, i + 1, i + 2, i + 3] for i in range(32)], pa.list_(pa.int16(), 4))
    pq.write_table(pa.table({"tokens": tokens}), tmp_path / "a.parquet")
    train, _ = build_parquet(path=str(tmp_path), inputs="tokens", transform="next_token")
    stream = StreamLoader(train.open(), global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=5)
    for _ in range(4):
        for x, y in stream.next_step():
            assert x.is_contiguous() and y.is_contiguous()
            assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (4, 3)


def test_list_columns_become_tensors_and_next_token_shifts_sequences(tmp_path):
    tokens = pa.array([[i, i + 1, i + 2, i + 3] for i in range(16)], pa.list_(pa.int32(), 4))
    pixels = pa.array([[float(i)] * 6 for i in range(16)])  # a plain list of one length
    pq.write_table(
        pa.table({"tokens": tokens, "pixels": pixels, "y": range(16)}), tmp_path / "a.parquet"
    )
    train, _ = build_parquet(path=str(tmp_path), inputs="tokens", transform="next_token")
    stream = train.open()
    x, y = stream.head(2)[1]
    assert x.tolist() == [1, 2, 3] and y.tolist() == [2, 3, 4] and x.dtype == torch.int64
    # a fragment keeps the stored width (a step gathers a quarter of the bytes of int64's)
    assert stream.read(0)[0].dtype == torch.int32
    train, _ = build_parquet(path=str(tmp_path / "a.parquet"), inputs="pixels", target="y")
    x, y = train.open().head(1)[0]
    assert x.shape == (6,) and x.dtype == torch.float32 and y.dtype == torch.int64


@pytest.mark.parametrize(
    ("table", "inputs", "message"),
    [
        (pa.table({"x": [1.0, 2.0], "y": [0, 1]}), "z", r"has no column 'z' \(it has: x, y\)"),
        (pa.table({"x": ["a", "b"], "y": [0, 1]}), "x", "column 'x' is of type string"),
        (pa.table({"x": [[1.0], [2.0, 3.0]], "y": [0, 1]}), "x", "lists of different lengths"),
        (pa.table({"x": [1.0, None], "y": [0, 1]}), "x", "column 'x' has 1 missing value in"),
    ],
    ids=["missing", "string", "ragged", "nulls"],
)
def test_a_column_that_cannot_be_a_tensor_is_named(tmp_path, table, inputs, message):
    pq.write_table(table, tmp_path / "a.parquet")
    train, _ = build_parquet(path=str(tmp_path), inputs=inputs, target="y")
    with pytest.raises(DataError, match=message):
        train.open().head(1)


def test_an_empty_or_absent_table_is_named(tmp_path):
    pq.write_table(
        pa.table({"x": pa.array([], pa.float32()), "y": pa.array([], pa.int64())}),
        tmp_path / "a.parquet",
    )
    with pytest.raises(DataError, match="the table is empty"):
        build_parquet(path=str(tmp_path), inputs="x", target="y")[0].open()
    with pytest.raises(DataError, match="no such file or directory"):
        build_parquet(path=str(tmp_path / "nothing"), inputs="x", target="y")[0].open()
    (tmp_path / "b").mkdir()
    with pytest.raises(DataError, match="no Parquet files there"):
        build_parquet(path=str(tmp_path / "b"), inputs="x", target="y")[0].open()


def write_parts(root: Path, tables: list[pa.Table], *, statistics: bool = True) -> Path:
    """One file per table, two row groups each where it has rows enough."""
    root.mkdir(parents=True, exist_ok=True)
    for index, table in enumerate(tables):
        pq.write_table(
            table,
            root / f"part-{index:03d}.parquet",
            row_group_size=max(len(table) // 2, 1),
            write_statistics=statistics,
        )
    return root


def good(start: int, rows: int = 8) -> pa.Table:
    return pa.table({"x": [float(i) for i in range(start, start + rows)], "y": range(rows)})


def test_missing_values_anywhere_are_found_before_anything_is_read(tmp_path, monkeypatch):
    """From the footers' statistics: the third file's second row group holds a null."""
    bad = pa.table({"x": [1.0, 2.0, 3.0, 4.0, 5.0, None, 7.0, 8.0], "y": range(8)})
    path = write_parts(tmp_path, [good(0), good(8), bad, good(24)])
    train, _ = build_parquet(path=str(path), inputs="x", target="y")
    reads = []
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", lambda *a, **k: reads.append(a))
    with pytest.raises(
        DataError,
        match=r"column 'x' has 1 missing value in .*part-002.parquet \(row group 1\); fill",
    ):
        train.open()
    assert not reads


def test_every_files_column_types_are_checked_before_anything_is_read(tmp_path):
    strings = pa.table({"x": ["1.0", "n/a"] * 4, "y": range(8)})
    path = write_parts(tmp_path / "a", [good(0), good(8), strings])
    train, _ = build_parquet(path=str(path), inputs="x", target="y")
    with pytest.raises(DataError, match=r"column 'x' is of type string in .*part-002.parquet"):
        train.open()
    integers = pa.table({"x": list(range(8)), "y": range(8)})
    path = write_parts(tmp_path / "b", [good(0), integers])
    train, _ = build_parquet(path=str(path), inputs="x", target="y")
    with pytest.raises(DataError, match=r"column 'x' holds int64 in .*part-001.parquet.*double"):
        train.open()


def read_every_block(stream) -> None:
    for index in range(len(stream.blocks)):
        stream.read(index)


def test_what_only_reading_finds_names_the_file_row_group_and_row(tmp_path):
    """Without statistics a null shows when its row group is read; lists of different lengths
    only ever do."""
    bad = pa.table({"x": [1.0, 2.0, 3.0, 4.0, 5.0, None, 7.0, 8.0], "y": range(8)})
    path = write_parts(tmp_path / "a", [good(0), bad], statistics=False)
    stream = build_parquet(path=str(path), inputs="x", target="y")[0].open()
    with pytest.raises(DataError, match=r"part-001.parquet, row group 1, row 1 first"):
        read_every_block(stream)
    lists = [[1.0, 2.0]] * 6 + [[1.0], [2.0, 3.0]]
    ragged = pa.table({"x": lists, "y": range(8)})
    even = pa.table({"x": [[1.0, 2.0]] * 8, "y": range(8)})
    path = write_parts(tmp_path / "b", [even, ragged])
    stream = build_parquet(path=str(path), inputs="x", target="y")[0].open()
    with pytest.raises(
        DataError,
        match=r"lists of different lengths \(1 to 2; .*part-001.parquet, row group 1, "
        r"row 2 first\)",
    ):
        read_every_block(stream)


def test_lists_of_one_length_per_file_but_another_elsewhere_are_named(tmp_path):
    """Each row group's lists are of one length, but not the table's: named where it changes,
    within a block (row group 1 of a file) and across files (a window gathers rows of both)."""
    two, three = [[1.0, 2.0]] * 4, [[1.0, 2.0, 3.0]] * 4
    within = pa.table({"x": two + three, "y": range(8)})
    path = write_parts(tmp_path / "a", [within])
    stream = build_parquet(path=str(path), inputs="x", target="y")[0].open()
    with pytest.raises(
        DataError,
        match=r"lists of .*length.*part-000.parquet, row group 1, row 0",
    ):
        read_every_block(stream)
    files = [pa.table({"x": two * 2, "y": range(8)}), pa.table({"x": three * 2, "y": range(8)})]
    path = write_parts(tmp_path / "b", files)
    train, _ = build_parquet(path=str(path), inputs="x", target="y", shuffle_rows=16)
    rank = StreamLoader(train.open(), global_batch=4, micro_batch=4, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ConfigError) as raised:  # one window of both files: its first step
        rank.next_step()
    message = str(raised.value)
    assert "\n" not in message and "lists of length" in message and "part-00" in message


def test_integers_of_different_widths_per_file_are_gathered_whole(tmp_path):
    """int16 in one file, int32 in another: a window holds both as int32, values whole."""
    narrow = pa.table({"x": pa.array([[i, i + 1] for i in range(8)], pa.list_(pa.int16()))})
    wide = pa.table({"x": pa.array([[70000 + i, i] for i in range(8)], pa.list_(pa.int32()))})
    path = write_parts(tmp_path, [narrow, wide])
    train, _ = build_parquet(path=str(path), inputs="x", transform="next_token", shuffle_rows=16)
    rank = StreamLoader(train.open(), global_batch=16, micro_batch=16, dp_rank=0, dp_size=1, seed=0)
    ((x, y),) = rank.next_step()
    assert x.dtype == torch.int64
    assert sorted(zip(x[:, 0].tolist(), y[:, 0].tolist(), strict=True)) == sorted(
        [(i, i + 1) for i in range(8)] + [(70000 + i, i) for i in range(8)]
    )
