"""A stock Hugging Face GPT-2 (`transformers.GPT2LMHeadModel`), built from a config: nothing is
downloaded. shardwise trains it as it is, under every layout:

    shardwise train examples/hf-gpt2.toml --nproc 2                            # DDP
    shardwise train examples/hf-gpt2.toml --nproc 2 --set parallel.dp_shard=2  # FSDP per block
    shardwise train examples/hf-gpt2.toml --nproc 2 --set parallel.tp=2        # tensor parallel
    shardwise train examples/hf-gpt2.toml --nproc 2 --set parallel.pp=2        # traced pipeline

Its checkpoints export to a file the same stock model loads:

    shardwise export runs/hf-gpt2/checkpoints/step_00000200 gpt2.safetensors

    from safetensors.torch import load_file
    model = build_model(n_layer=4, n_embd=128, n_head=4)
    model.load_state_dict(load_file("gpt2.safetensors"))

Needs the optional extra: pip install 'shardwise[hf]'.
"""

from __future__ import annotations

from typing import Any

from transformers import GPT2Config, GPT2LMHeadModel


def build_model(**config: Any) -> GPT2LMHeadModel:
    """GPT-2 from its config (`model.args` are GPT2Config's keys); byte-level by default, for
    shardwise's `text` data. The output layer shares the token embedding's weight, as in GPT-2."""
    defaults = {"vocab_size": 256, "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0}
    return GPT2LMHeadModel(GPT2Config(**{**defaults, **config}))
