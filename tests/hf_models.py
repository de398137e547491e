"""Stock Hugging Face models as users build them (from a small config: nothing is downloaded),
named by import path in the tests' job files (`tests.hf_models:llama`), and the data they train on:
Llama-family decoders (rotary embeddings, RMSNorm, SwiGLU, grouped-query attention, tied or
untied embeddings), BERT for masked language modelling (labels -100 except at masked positions)
and for sequence classification, and transformers' ResNet for images. Every dropout is off, so
layouts compare with one process exactly. Importing this module imports transformers."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    ResNetConfig,
    ResNetForImageClassification,
)

from shardwise.training.data.text import build_text

DECODERS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}
VOCAB = 256  # byte-level, as the `text` data
MASK = VOCAB  # BERT's mask token: one past the bytes


def decoder(
    *,
    family: str = "llama",
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = False,
    seq_len: int = 16,
) -> PreTrainedModel:
    """A Llama-family causal LM: `kv_heads` < `heads` is grouped-query attention."""
    config_class, model_class = DECODERS[family]
    config = _decoder_config(
        config_class,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
    )
    model: PreTrainedModel = model_class(config)
    return model


def _decoder_config(
    config_class: Any, *, layers: int, hidden: int, heads: int, kv_heads: int, **extra: Any
) -> Any:
    return config_class(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **extra,
    )


def llama(**args: Any) -> PreTrainedModel:
    return decoder(family="llama", **args)


def llama_classifier(
    *, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, classes: int = 4
) -> PreTrainedModel:
    """Llama for sequence classification: its `score` head is in no pipeline plan
    transformers declares, so a pipeline traces it."""
    config = _decoder_config(
        LlamaConfig,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        num_labels=classes,
        pad_token_id=0,
    )
    model: PreTrainedModel = LlamaForSequenceClassification(config)
    return model


def _bert_config(*, layers: int, hidden: int, heads: int, seq_len: int, **extra: Any) -> Any:
    return BertConfig(
        vocab_size=VOCAB + 1,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )


def bert_mlm(
    *, layers: int = 2, hidden: int = 32, heads: int = 4, seq_len: int = 16
) -> PreTrainedModel:
    """BERT for masked language modelling; its output layer shares the word embedding."""
    model: PreTrainedModel = BertForMaskedLM(
        _bert_config(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len)
    )
    return model


def bert_classifier(
    *, layers: int = 2, hidden: int = 32, heads: int = 4, seq_len: int = 16, classes: int = 4
) -> PreTrainedModel:
    model: PreTrainedModel = BertForSequenceClassification(
        _bert_config(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, num_labels=classes)
    )
    return model


def resnet(*, width: int = 8, classes: int = 10) -> PreTrainedModel:
    """transformers' ResNet (basic blocks, BatchNorm after every convolution) for 1-channel
    digits: four stages of one block (a pipeline of four stages cuts between them), the later
    ones downsampling: 64×64 digits reach the last stage at 2×2."""
    config = ResNetConfig(
        num_channels=1,
        embedding_size=width,
        hidden_sizes=[width, width, 2 * width, 2 * width],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_labels=classes,
        downsample_in_first_stage=False,
    )
    model: PreTrainedModel = ResNetForImageClassification(config)
    return model


class Masked(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Byte windows with a fixed ~15% of positions (drawn from the window's index) replaced by
    the mask token; the target is the original byte there and -100 (ignored) elsewhere."""

    def __init__(self, windows: Any, fraction: float) -> None:
        self.windows, self.fraction = windows, fraction

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _ = self.windows[index]
        draw = torch.rand(len(tokens), generator=torch.Generator().manual_seed(index))
        masked = draw < self.fraction
        masked[int(draw.argmin())] = True  # at least one position to predict
        target = torch.where(masked, tokens, torch.full_like(tokens, -100))
        return torch.where(masked, torch.full_like(tokens, MASK), tokens), target


def masked_text(
    *, seq_len: int = 16, max_bytes: int = 20_000, fraction: float = 0.15
) -> tuple[Masked, Masked]:
    train, held_out = build_text(seq_len=seq_len, max_bytes=max_bytes)
    return Masked(train, fraction), Masked(held_out, fraction)


class Classes(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Byte windows labelled by their first byte's class (a letter, a digit, a space, other)."""

    def __init__(self, windows: Any) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _ = self.windows[index]
        first = chr(int(tokens[0]))
        label = 0 if first.isalpha() else 1 if first.isdigit() else 2 if first.isspace() else 3
        return tokens, torch.tensor(label)


def text_classes(*, seq_len: int = 16, max_bytes: int = 20_000) -> tuple[Classes, Classes]:
    train, held_out = build_text(seq_len=seq_len, max_bytes=max_bytes)
    return Classes(train), Classes(held_out)
