"""A stock Hugging Face Llama (`transformers.LlamaForCausalLM`: rotary embeddings, RMSNorm,
SwiGLU, grouped-query attention), built from a config: nothing is downloaded. shardwise splits it
by the plans transformers declares for it, so you write nothing:

    shardwise train examples/hf-llama.toml --nproc 2                            # DDP
    shardwise train examples/hf-llama.toml --nproc 2 --set parallel.dp_shard=2  # FSDP per layer
    shardwise train examples/hf-llama.toml --nproc 2 --set parallel.tp=2        # tensor parallel
    shardwise train examples/hf-llama.toml --nproc 2 --set parallel.pp=2        # pipeline

Mistral, Qwen2 and the other Llama-family decoders transformers builds work the same way.
Needs the optional extra: pip install 'shardwise[hf]'.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, LlamaForCausalLM


def build_model(**config: Any) -> LlamaForCausalLM:
    """Llama from its config (`model.args` are LlamaConfig's keys); byte-level by default, for
    shardwise's `text` data."""
    defaults = {"vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}
    return LlamaForCausalLM(LlamaConfig(**{**defaults, **config}))
