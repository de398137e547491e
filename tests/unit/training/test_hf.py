"""What transformers declares about a model, read by shardwise so a user writes nothing: the
pipeline plan (`base_model_pp_plan`), and the refusals before launch where a model declares
nothing usable. Models are built on the meta device (tests/hf_models.py): no process starts."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import gpt_job
from shardwise.common.errors import ConfigError
from shardwise.training import job_names
from shardwise.training.config.derive import derive
from shardwise.training.parallel.checks import check_layout
from shardwise.training.parallel.pipeline import (
    has_blocks,
    has_submodule,
    model_blocks,
    pipeline_blocks,
    stage_module,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install 'shardwise[hf]'; make test does)",
)
TEXT = {"name": "text", "args": {"seq_len": 16, "max_bytes": 4_000}}
CLASSES = {"name": "tests.hf_models:text_classes", "args": {"seq_len": 16, "max_bytes": 4_000}}


def hf_job(tmp_path, model: str, *, data=TEXT, args=None, **parallel):
    return gpt_job(
        tmp_path,
        model={"name": f"tests.hf_models:{model}", "args": args or {}},
        data=data,
        train={"global_batch": 8, "micro_batch": 2},
        parallel=parallel,
    )


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_llama_family_decoder_pipelines_by_the_plan_transformers_declares(
    tmp_path, repo_cwd, family
):
    """Its blocks are the embedding, each decoder layer, the norm and the head; a stage passes
    the others through and runs the model's own forward: the stages, run one after another on
    the meta device, give the whole model's logits."""
    config = hf_job(tmp_path, "decoder", args={"family": family, "layers": 3})
    model = job_names.build_on_meta(config)
    blocks = pipeline_blocks(model)
    assert blocks == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "lm_head",
    ]
    assert has_blocks(model)
    # FSDP and recomputation still work per decoder layer
    assert model_blocks(model) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    first = stage_module(model, blocks, set(blocks[:2]))
    last = stage_module(model, blocks, set(blocks[2:]))
    assert has_submodule(first, "model.layers.0") and not has_submodule(first, "model.layers.1")
    assert not any(n.startswith("model.layers.1.") for n, _ in first.named_parameters())
    # on fake tensors, where transformers skips the checks that read values
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad():
        tokens = fake.from_tensor(torch.zeros(2, 16, dtype=torch.long, device="meta"))
        hidden = first(tokens)
        assert hidden.shape == (2, 16, 32)
        assert last(hidden).shape == model(tokens).logits.shape == (2, 16, 256)
    args = {"family": family, "layers": 3}  # … and so the jobs pass the checks
    for parallel in ({"pp": 2}, {"pp": 2, "pipeline_schedule": "Interleaved1F1B"}):
        job = hf_job(tmp_path, "decoder", args=args, **parallel)
        check_layout(job, derive(job, 2))


def test_a_model_whose_head_the_plan_does_not_name_is_traced(tmp_path, repo_cwd):
    """Llama for sequence classification: its `score` head is in no declared plan, so it
    would run on every stage: the model is traced instead."""
    model = job_names.build_on_meta(hf_job(tmp_path, "llama_classifier", data=CLASSES))
    assert not has_blocks(model)


def test_a_traced_forward_whose_stages_do_not_run_is_refused_before_launch(tmp_path, repo_cwd):
    """torch's tracer cuts Llama's forward into stages the first of which waits for an input
    nothing sends (pytorch/pytorch#184361): tracing succeeds, so the stages are run, on fake
    tensors, and the job is refused in one line naming the two ways out."""
    config = hf_job(tmp_path, "llama_classifier", data=CLASSES, pp=2)
    with pytest.raises(
        ConfigError,
        match=r"LlamaForSequenceClassification's forward, traced and cut into 2 pipeline "
        r"stages, does not run \(stage 0: RuntimeError: Expected positional argument.*"
        r"parallel.pipeline_split.*pipeline_blocks\(\)",
    ):
        check_layout(config, derive(config, 2))
    named = hf_job(
        tmp_path, "llama_classifier", data=CLASSES, pp=2, pipeline_split=["model.layers.1"]
    )
    with pytest.raises(ConfigError, match=r"name other boundaries in parallel.pipeline_split"):
        check_layout(named, derive(named, 2))


def test_a_declared_plan_is_not_balanced_by_measured_cost(tmp_path, repo_cwd):
    config = hf_job(tmp_path, "llama", pp=2, pipeline_balance="cost")
    with pytest.raises(ConfigError, match=r"'cost' times each block on its own.*'params'"):
        check_layout(config, derive(config, 2))


@pytest.mark.parametrize(
    ("model", "data"),
    [
        ("bert_mlm", {"name": "tests.hf_models:masked_text", "args": {}}),
        ("resnet", {"name": "digits", "args": {}}),
    ],
)
def test_models_that_declare_no_plan_are_traced_and_their_stages_run(
    tmp_path, repo_cwd, model, data
):
    config = hf_job(tmp_path, model, data=data, pp=2)
    assert not has_blocks(job_names.build_on_meta(config))
    check_layout(config, derive(config, 2))


def test_a_llama_family_decoder_splits_by_the_tensor_parallel_plan_transformers_declares(
    tmp_path, repo_cwd
):
    """transformers' style names become torch's styles: query, key, value and the MLP's input
    projections by columns, the attention and MLP outputs by rows, the embedding by vocabulary
    rows and the output layer by columns gathered; every decoder layer matched."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from shardwise.training.parallel.tensor import tensor_parallel_plan

    model = job_names.build_on_meta(hf_job(tmp_path, "llama", args={"layers": 3}))
    plan = tensor_parallel_plan(model, None, tp=2, sequence_parallel=False)
    assert len(plan) == 3 * 7 + 2
    for layer in range(3):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
            assert type(plan[f"model.layers.{layer}.{name}"]) is ColwiseParallel
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert type(plan[f"model.layers.{layer}.{name}"]) is RowwiseParallel
    assert plan["model.embed_tokens"].input_layouts == (Replicate(),)
    assert plan["lm_head"].output_layouts == (Replicate(),)
    ok = hf_job(tmp_path, "llama", tp=2)
    check_layout(ok, derive(ok, 2))
    with pytest.raises(ConfigError, match="sequence_parallel is not available with the"):
        tensor_parallel_plan(model, None, tp=2, sequence_parallel=True)


@pytest.mark.parametrize(
    ("args", "tp", "message"),
    [
        ({"heads": 4, "kv_heads": 2}, 4, "does not divide the 2 key/value heads"),
        ({"heads": 6, "kv_heads": 6, "hidden": 48}, 4, "does not divide the 6 attention heads"),
    ],
)
def test_tp_that_does_not_divide_the_heads_transformers_counts_is_refused(
    tmp_path, repo_cwd, args, tp, message
):
    """transformers keeps the head counts in `config` (`num_attention_heads`,
    `num_key_value_heads`), not in attributes of the attention modules."""
    config = hf_job(tmp_path, "llama", args=args, tp=tp)
    with pytest.raises(ConfigError, match=message):
        check_layout(config, derive(config, tp))


def test_bert_splits_by_shardwises_plan_for_encoders_and_a_resnet_is_refused(tmp_path, repo_cwd):
    """transformers declares no plan for BERT: shardwise splits its layers Megatron-style; its
    ResNet's layers are convolutions, which no style of torch's splits: refused in one line."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from shardwise.training.parallel.apply import describe
    from shardwise.training.parallel.tensor import tensor_parallel_plan

    masked = {"name": "tests.hf_models:masked_text", "args": {}}
    config = hf_job(tmp_path, "bert_mlm", data=masked, tp=2)
    model = job_names.build_on_meta(config)
    plan = tensor_parallel_plan(model, None, tp=2, sequence_parallel=False)
    layer = "bert.encoder.layer.1"
    for name in ("attention.self.query", "attention.self.key", "attention.self.value"):
        assert type(plan[f"{layer}.{name}"]) is ColwiseParallel
    assert type(plan[f"{layer}.intermediate.dense"]) is ColwiseParallel
    assert type(plan[f"{layer}.attention.output.dense"]) is RowwiseParallel
    assert type(plan[f"{layer}.output.dense"]) is RowwiseParallel
    assert len(plan) == 2 * 6
    check_layout(config, derive(config, 2))
    derived = derive(config, 2)
    lines = describe(model, [], derived.degrees, config.parallel, "none")
    assert "shardwise's plan for BERT-style encoders" in lines[0]
    resnet = hf_job(tmp_path, "resnet", data={"name": "digits", "args": {}}, tp=2)
    with pytest.raises(
        ConfigError, match=r"ResNetForImageClassification declares none.*parallel.tp_plan"
    ):
        check_layout(resnet, derive(resnet, 2))


@pytest.mark.parametrize(
    "family", ["Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Olmo2", "Gemma2", "Cohere"]
)
def test_a_declared_plan_is_used_only_where_its_stages_compose_to_the_model(family):
    """Gemma 2 caps its logits and Cohere scales them outside any block the plan declares:
    every stage runs the model's forward, so they would be applied on every stage. Such models
    are not split by their declared plan (they are traced); those that are split compose to the
    whole model's logits, with real weights."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model_class = getattr(transformers, f"{family}ForCausalLM")
    with torch.device("meta"):
        meta = model_class(config)
    torch.manual_seed(0)
    model = model_class(config)
    for built in (meta, model):
        built.config.use_cache = False
    blocks = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    declared = has_blocks(meta)
    assert has_blocks(model) == declared
    assert declared == (family not in ("Gemma2", "Cohere"))
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        first = stage_module(model, blocks, set(blocks[:2]))
        staged = stage_module(model, blocks, set(blocks[2:]))(first(tokens))
        composes = torch.allclose(staged, model(tokens).logits, atol=1e-5)
    assert composes or not declared
