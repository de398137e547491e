import pytest
import torch
from torch.utils.data import TensorDataset

from shardwise.training.data.sampling import GlobalBatchSampler, StepLoader, chunk, eval_loader


def sampler(rank=0, size=1, n=100, batch=16, seed=0):
    return GlobalBatchSampler(n, global_batch=batch, dp_rank=rank, dp_size=size, seed=seed)


def test_ranks_are_disjoint_and_cover_the_epoch():
    plans = [sampler(rank=r, size=4).epoch_plan() for r in range(4)]
    steps = len(plans[0])
    assert steps == 100 // 16
    seen = [i for plan in plans for step in plan for i in step]
    assert len(seen) == len(set(seen)) == steps * 16  # disjoint
    # the remainder (100 % 16 = 4 samples) is all that is skipped this epoch
    assert len(set(range(100)) - set(seen)) == 4


def test_order_does_not_depend_on_the_number_of_ranks():
    one = sampler(size=1).epoch_plan()
    four = [sampler(rank=r, size=4).epoch_plan() for r in range(4)]
    for step in range(len(one)):
        assert one[step] == [i for r in range(4) for i in four[r][step]]


def test_deterministic_per_seed_and_reshuffled_per_epoch():
    assert sampler(seed=1).epoch_plan() == sampler(seed=1).epoch_plan()
    assert sampler(seed=1).epoch_plan() != sampler(seed=2).epoch_plan()
    s = sampler()
    first = s.epoch_plan()
    for _ in range(len(first)):
        s.advance()
    assert s.epoch == 1 and s.offset == 0
    assert s.epoch_plan() != first


def test_remainder_differs_between_epochs():
    s = sampler()
    skipped = []
    for _ in range(3):
        plan = s.epoch_plan()
        skipped.append(set(range(100)) - {i for step in plan for i in step})
        for _ in plan:
            s.advance()
    assert skipped[0] != skipped[1] or skipped[1] != skipped[2]


def test_resume_mid_epoch_continues_with_the_next_sample():
    data = TensorDataset(torch.arange(100).float(), torch.arange(100))
    straight = StepLoader(data, sampler(), micro_batch=8, num_workers=0)
    expected = [straight.next_step() for _ in range(15)]  # crosses into epoch 2
    first = StepLoader(data, sampler(), micro_batch=8, num_workers=0)
    for _ in range(4):
        first.next_step()
    resumed = StepLoader(data, sampler(), micro_batch=8, num_workers=0)
    resumed.load_state_dict(first.state_dict())
    for step in expected[4:]:
        got = resumed.next_step()
        assert len(got) == 2  # 16 samples per step in micro-batches of 8
        for (_, y_got), (_, y_exp) in zip(got, step, strict=True):
            assert torch.equal(y_got, y_exp)


def test_loader_with_workers_reads_the_same_batches():
    data = TensorDataset(torch.arange(100).float(), torch.arange(100))
    plain = StepLoader(data, sampler(), micro_batch=8, num_workers=0)
    workers = StepLoader(data, sampler(), micro_batch=8, num_workers=2)
    for _ in range(3):
        a, b = plain.next_step(), workers.next_step()
        assert all(torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))


def test_resume_with_a_larger_global_batch_skips_to_the_next_epoch():
    s = sampler(batch=16)
    for _ in range(5):
        s.advance()  # offset 80
    bigger = sampler(batch=32)
    bigger.load_state_dict(s.state_dict())  # 80 + 32 > 100: this epoch has no full batch left
    assert bigger.state_dict() == {"epoch": 1, "offset": 0}


def test_eval_split_covers_everything_exactly_once():
    data = TensorDataset(torch.arange(37))
    seen = []
    for rank in range(3):
        for (batch,) in eval_loader(data, dp_rank=rank, dp_size=3, batch=5, max_samples=None):
            seen += batch.tolist()
    assert sorted(seen) == list(range(37))
    capped = eval_loader(data, dp_rank=0, dp_size=1, batch=5, max_samples=12)
    assert sum(len(b[0]) for b in capped) == 12


@pytest.mark.parametrize(("total", "ranks"), [(64, 3), (64, 4), (7, 3), (5, 5), (100, 7)])
def test_chunks_cover_the_batch_once_and_differ_by_at_most_one(total, ranks):
    """Live recovery's replicas split a step's samples whatever their number: contiguous, in
    rank order, none twice, sizes within one; where the number divides the batch, the equal
    slices data parallelism always read."""
    spans = [chunk(total, r, ranks) for r in range(ranks)]
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(spans[i][1] == spans[i + 1][0] for i in range(ranks - 1))
    sizes = [end - first for first, end in spans]
    assert max(sizes) - min(sizes) <= 1
    if total % ranks == 0:
        assert spans == [(r * total // ranks, (r + 1) * total // ranks) for r in range(ranks)]


def test_a_loader_moved_to_another_share_reads_the_steps_samples_split_anew():
    """Three replicas read a step of 10 as 3, 3 and 4 samples; after one is lost, the two left
    read the next step as 5 and 5; together always the step's samples, once each."""
    data = TensorDataset(torch.arange(40).float(), torch.arange(40))
    loaders = [
        StepLoader(
            data,
            GlobalBatchSampler(40, global_batch=10, dp_rank=r, dp_size=3, seed=0),
            micro_batch=2,
            num_workers=0,
        )
        for r in range(3)
    ]
    first = [torch.cat([mb[1] for mb in loader.next_step()]) for loader in loaders]
    assert [len(t) for t in first] == [3, 3, 4]
    assert sorted(torch.cat(first).tolist()) == sorted(set(torch.cat(first).tolist()))
    for rank, loader in enumerate(loaders[:2]):
        loader.place(rank, 2)
    second = [torch.cat([mb[1] for mb in loader.next_step()]) for loader in loaders[:2]]
    assert [len(t) for t in second] == [5, 5]
    both = torch.cat(first + second).tolist()
    assert len(set(both)) == 20  # two steps, no sample twice
