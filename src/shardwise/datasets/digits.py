"""The handwritten digits shipped with scikit-learn (1,797 8×8 images, UCI), a real dataset that
needs no download."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset


def build_digits(*, eval_fraction: float = 0.2, split_seed: int = 0) -> tuple[Dataset, Dataset]:
    """Train and held-out splits of `(image[1, 8, 8] in [0, 1], label)`.

    The split is a fixed shuffle by `split_seed`, independent of the job's seed, so every run of
    a job evaluates on the same held-out images.
    """
    from sklearn.datasets import load_digits

    if not 0 < eval_fraction < 1:
        raise ValueError(f"data.args.eval_fraction must be between 0 and 1, got {eval_fraction}")
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    num_eval = round(len(labels) * eval_fraction)
    held_out, train = order[:num_eval], order[num_eval:]
    return (
        TensorDataset(images[train], labels[train]),
        TensorDataset(images[held_out], labels[held_out]),
    )
