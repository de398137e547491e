"""Evaluation's sums per batch: a masked language model's ignored positions (-100) count for
nothing, so the loss is the mean over the predicted tokens and the accuracy is theirs, however
the held-out set falls into batches and ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from shardwise.training.job_names import cross_entropy, mse
from shardwise.training.trainer.step import batch_sums


def test_ignored_positions_count_for_nothing_in_loss_or_accuracy():
    torch.manual_seed(0)
    logits = torch.randn(6, 5, 7)
    target = torch.randint(0, 7, (6, 5))
    target[torch.rand(6, 5) < 0.7] = -100
    target[0] = -100  # a sample with nothing to predict
    whole = batch_sums(cross_entropy, logits, target)
    # split into batches of 2, as ranks and batches would: the same sums
    parts = sum(batch_sums(cross_entropy, logits[i : i + 2], target[i : i + 2]) for i in (0, 2, 4))
    torch.testing.assert_close(parts, whole)
    kept = target != -100
    want_loss = F.cross_entropy(logits[kept], target[kept], reduction="sum")
    torch.testing.assert_close(whole[0], want_loss.double(), rtol=1e-5, atol=0)
    assert int(whole[2]) == int(kept.sum()) == int(whole[3])
    assert int(whole[1]) == int((logits.argmax(-1) == target)[kept].sum())
    # a batch of only ignored positions adds nothing (its mean loss is nan)
    assert torch.equal(batch_sums(cross_entropy, logits[:1], target[:1]), torch.zeros(4).double())


def test_every_target_counts_where_none_is_ignored_and_regression_has_no_accuracy():
    logits, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    sums = batch_sums(cross_entropy, logits, labels)
    assert int(sums[2]) == int(sums[3]) == 4
    values, target = torch.randn(4, 1), torch.randn(4)
    sums = batch_sums(mse, values, target)
    assert int(sums[2]) == 4 and int(sums[3]) == 0
    torch.testing.assert_close(sums[0], 4 * F.mse_loss(values.squeeze(1), target).double())
