"""torch's batch norms in a pipeline stage (parallel/norms.py): the same outputs, running
statistics and batches counted as torch's own, in training and evaluation, for 1d, 2d and 3d
inputs and momentum=None (a cumulative average); the module keeps its name, parameters, buffers
and state-dict keys. And the checks before launch (parallel/checks.py): a module that changes a
buffer in place in forward, or a SyncBatchNorm on CPUs, is one line."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import digits_job
from shardwise.common.errors import ConfigError
from shardwise.training.config.derive import derive
from shardwise.training.parallel.checks import check_layout
from shardwise.training.parallel.norms import statistics_apart


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: nn.BatchNorm1d(4), (6, 4)),
        (lambda: nn.BatchNorm1d(4, momentum=None), (6, 4, 3)),
        (lambda: nn.BatchNorm2d(4), (3, 4, 5, 5)),
        (lambda: nn.BatchNorm3d(4, momentum=0.3, affine=False), (2, 4, 3, 3, 3)),
    ],
)
def test_a_batch_norm_with_statistics_apart_is_torchs(make, shape):
    torch.manual_seed(0)
    theirs = make()
    ours = copy.deepcopy(theirs)
    (name,) = statistics_apart(nn.Sequential(ours))
    assert name == "0" and type(ours).__name__ == type(theirs).__name__
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for _ in range(3):
        x = torch.randn(*shape) * 2 + 1
        torch.testing.assert_close(ours(x), theirs(x))
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, msg=key)
    ours.eval(), theirs.eval()
    x = torch.randn(*shape)
    torch.testing.assert_close(ours(x), theirs(x))


def test_its_forward_leaves_the_statistics_out_of_the_backward():
    """What fails torch's own in a pipeline stage (its schedule's set-up runs forwards and
    backwards out of order): the statistics changed in place between a forward and its
    backward."""
    torch.manual_seed(0)
    theirs = nn.BatchNorm1d(4)
    ours = copy.deepcopy(theirs)
    statistics_apart(nn.Sequential(ours))
    x = torch.randn(5, 4, requires_grad=True)
    pending = ours(x).square().sum()
    ours.running_mean.add_(1)  # what another micro-batch's update does
    pending.backward()
    assert x.grad is not None
    pending = theirs(x).square().sum()
    theirs.running_mean.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pending.backward()


def _zoo_job(tmp_path, model: str, **parallel):
    return digits_job(
        tmp_path,
        model={"name": f"tests.foreign_models:{model}", "args": {}},
        train={"global_batch": 16, "micro_batch": 2},
        parallel=parallel,
    )


def test_a_module_that_changes_a_buffer_in_forward_is_refused_under_a_pipeline(tmp_path, repo_cwd):
    config = _zoo_job(tmp_path, "counts_calls", pp=2)
    with pytest.raises(ConfigError, match=r"2 \(CountsCalls\) changes its buffer 'calls' in"):
        check_layout(config, derive(config, 2))
    check_layout(config, derive(_zoo_job(tmp_path, "counts_calls"), 2))  # without: fine
    normed = _zoo_job(tmp_path, "norm_blocks", pp=2)
    check_layout(normed, derive(normed, 2))  # torch's norms are not refused


def test_a_sync_batch_norm_is_refused_on_cpus(tmp_path, repo_cwd):
    config = _zoo_job(tmp_path, "sync_batch_norm")
    with pytest.raises(ConfigError, match=r"nn\.SyncBatchNorm, which torch synchronises across"):
        check_layout(config, derive(config, 2))
    check_layout(config, derive(config, 1))  # one process: nothing to synchronise
