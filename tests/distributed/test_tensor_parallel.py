"""The built-in GPT's tensor-parallel plan issues Megatron-LM's collectives and no more (Shoeybi et
al. 2019, §3; Korthikanti et al. 2022, §4.2.2), the count the planner's time model assumes: per
block and micro-batch, an all-reduce after the attention and the MLP in forward and one before
each in backward (query, key and value share one); with sequence parallelism an all-gather and a
reduce-scatter in place of each all-reduce."""

from __future__ import annotations

import pytest

from helpers import run_distributed

pytestmark = pytest.mark.slow
COLLECTIVES = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}


def _block_collectives(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    """Collectives block 1 of a 2-block GPT issues, by pass and name."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.models.gpt import build_gpt
    from shardwise.training.parallel.tensor import apply_tensor_parallel

    torch.manual_seed(0)
    model = build_gpt(layers=2, heads=4, hidden=64, seq_len=16)
    apply_tensor_parallel(
        model, init_device_mesh("cpu", (2,)), None, sequence_parallel=sequence_parallel
    )
    with torch.no_grad():
        hidden = model.layers["0"](model.embed(torch.randint(0, 256, (2, 16))))
    hidden.requires_grad_()
    block = model.layers["1"]
    counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}

    class Collectives(TorchDispatchMode):
        phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.__name__.split(".")[0] in COLLECTIVES:
                name = func.__name__.split(".")[0]
                seen = counts[self.phase]
                seen[name] = seen.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Collectives() as mode:
        out = block(hidden)
        mode.phase = "backward"
        out.float().pow(2).mean().backward()
    return counts


@pytest.mark.parametrize(
    ("sequence_parallel", "forward", "backward"),
    [
        (False, {"all_reduce": 2}, {"all_reduce": 2}),
        (
            True,
            {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
            {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
        ),
    ],
)
def test_a_block_issues_megatrons_collectives(sequence_parallel, forward, backward):
    counts = run_distributed(_block_collectives, 2, sequence_parallel)
    assert counts[0] == {"forward": forward, "backward": backward}
