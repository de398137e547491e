"""The handwritten digits shipped with scikit-learn (1,797 8×8 images, UCI), a real dataset that
needs no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the conventional name)
from pydantic import PositiveInt
from torch.utils.data import Dataset, TensorDataset


def build_digits(
    *,
    eval_fraction: float = 0.2,
    split_seed: int = 0,
    image_size: PositiveInt = 8,
    channels: PositiveInt = 1,
) -> tuple[Dataset, Dataset]:
    """Train and held-out splits of `(image[channels, image_size, image_size] in [0, 1], label)`.

    The images are 8×8 grey; a larger `image_size` upsamples them (bilinear) and `channels`
    repeats the grey level, so image models made for 3×32×32 (ResNet) train on real images with
    nothing to download. The split is a fixed shuffle by `split_seed`, independent of the job's
    seed, so every run of a job evaluates on the same held-out images.
    """
    if not 0 < eval_fraction < 1:
        raise ValueError(f"data.args.eval_fraction must be between 0 and 1, got {eval_fraction}")
    table = _digits_table()
    images = torch.tensor(table[:, :64], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    if image_size != 8:
        size = (image_size, image_size)
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
    images = images.expand(-1, channels, -1, -1).contiguous()
    labels = torch.tensor(table[:, 64], dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    num_eval = round(len(labels) * eval_fraction)
    held_out, train = order[:num_eval], order[num_eval:]
    return (
        TensorDataset(images[train], labels[train]),
        TensorDataset(images[held_out], labels[held_out]),
    )


def _digits_table() -> np.ndarray:
    """The 1,797 × 65 table (64 pixels, then the label) that scikit-learn ships as a CSV. It is read
    directly because importing scikit-learn would cost every rank more than the example's training
    run; `load_digits` is the fallback should the file ever move."""
    spec = importlib.util.find_spec("sklearn")
    if spec and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return np.loadtxt(path, delimiter=",", dtype=np.float32)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return np.hstack([digits.data, digits.target[:, None]]).astype(np.float32)
