"""The parts of parallel layouts that need no process group: splitting a model into pipeline
stages, placing stages on ranks, meta-device initialisation, and the checks made before launch."""

from __future__ import annotations

import copy
import importlib.util
import itertools

import pytest
import torch
from torch import nn

from foreign_models import GatedResidualMLP
from helpers import gpt_job
from shardwise.common.errors import ConfigError
from shardwise.models.gpt import build_gpt
from shardwise.training.config.derive import derive
from shardwise.training.parallel.checks import check_layout
from shardwise.training.parallel.meta_init import materialize, supports_meta_init
from shardwise.training.parallel.pipeline import (
    balance,
    explicit_split,
    pipeline_blocks,
    stage_indices,
    stage_module,
)


def test_balance_minimises_the_most_expensive_stage():
    assert balance([1, 1, 1, 1], 2) == [0, 2]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [0, 1]  # 5 | 5
    assert balance([1, 1, 1, 1, 1, 5], 2) == [0, 5]
    assert balance([3, 3, 3], 3) == [0, 1, 2]
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0]
    for stages in range(1, 6):
        best = min(
            _largest(costs, [0, *cuts])
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        assert _largest(costs, balance(costs, stages)) == best  # as good as trying every split


def _largest(costs, starts):
    bounds = [*starts, len(costs)]
    return max(sum(costs[bounds[i] : bounds[i + 1]]) for i in range(len(starts)))


def test_explicit_split_names_the_first_block_of_each_stage():
    blocks = ["embed", "layers.0", "layers.1", "final"]
    assert explicit_split(blocks, ["layers.1"], 2) == [0, 2]
    with pytest.raises(ConfigError, match="is not one of the model's blocks"):
        explicit_split(blocks, ["layers.7"], 2)
    with pytest.raises(ConfigError, match="need 1"):
        explicit_split(blocks, [], 2)
    with pytest.raises(ConfigError, match="distinct blocks in model order"):
        explicit_split(blocks, ["final", "layers.0"], 3)


def test_stage_placement_follows_the_schedule():
    assert stage_indices("1F1B", pp_rank=1, pp=4, stages_per_rank=1) == [1]
    assert stage_indices("Interleaved1F1B", pp_rank=1, pp=4, stages_per_rank=2) == [1, 5]
    assert stage_indices("ZBVZeroBubble", pp_rank=0, pp=4, stages_per_rank=2) == [0, 7]
    assert stage_indices("DualPipeV", pp_rank=3, pp=4, stages_per_rank=2) == [3, 4]


def test_stages_keep_the_whole_models_names_and_compose_to_it():
    model = build_gpt(layers=2, heads=2, hidden=16, seq_len=8)
    blocks = pipeline_blocks(model)
    assert blocks == ["embed", "layers.0", "layers.1", "final"]
    first = stage_module(model, blocks, {"embed", "layers.0"})
    second = stage_module(model, blocks, {"layers.1", "final"})
    assert set(dict(first.named_parameters())) | set(dict(second.named_parameters())) == set(
        dict(model.named_parameters())
    )
    tokens = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(second(first(tokens)), model(tokens))


def test_a_sequential_model_splits_too():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    blocks = pipeline_blocks(model)
    head = stage_module(model, blocks, {"0", "1"})
    tail = stage_module(model, blocks, {"2"})
    x = torch.randn(3, 4)
    torch.testing.assert_close(tail(head(x)), model(x))
    assert list(dict(tail.named_parameters())) == ["2.weight", "2.bias"]


def test_a_model_that_is_not_a_sequence_is_refused():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="sequence of blocks"):
        pipeline_blocks(Branchy())


def test_meta_init_gives_the_same_values_whatever_is_materialized():
    with torch.device("meta"):
        model = build_gpt(layers=2, heads=2, hidden=16, seq_len=8)
    assert supports_meta_init(model)
    template = copy.deepcopy(model)
    whole = copy.deepcopy(model)
    materialize([whole], template, seed=7, device=torch.device("cpu"))
    blocks = pipeline_blocks(model)
    stage = stage_module(model, blocks, {"layers.1", "final"})
    materialize([stage], template, seed=7, device=torch.device("cpu"))
    for name, value in stage.named_parameters():
        assert torch.equal(value, dict(whole.named_parameters())[name]), name
    # GPT-2's init: weights normal(0, 0.02), biases zero, norms one
    assert whole.layers["0"].mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.all(whole.layers["0"].mlp.up.bias == 0)
    assert torch.all(whole.final.norm.weight == 1)
    # modules get different streams; another seed gives other values
    assert not torch.equal(whole.layers["0"].attn.q.weight, whole.layers["0"].attn.k.weight)
    again = copy.deepcopy(model)
    materialize([again], template, seed=8, device=torch.device("cpu"))
    assert not torch.equal(again.embed.tok.weight, whole.embed.tok.weight)


class _Scaled(nn.Module):
    """A parameter of its own, set in __init__ and by no initialiser (no reset_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale

    def init_weights(self, module: nn.Module) -> None:  # linear layers only, as nanoGPT's
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)


def test_a_parameter_no_initialiser_sets_is_refused_not_left_uninitialised():
    with torch.device("meta"):
        model = _Scaled()
    template = copy.deepcopy(model)
    with pytest.raises(ConfigError, match=r"nothing initialises scale .*model.init = 'full'"):
        materialize([model], template, seed=0, device=torch.device("cpu"))


def test_buffers_come_from_init_and_the_template_is_left_as_it_was(tmp_path):
    """A buffer no initialiser sets (rotary frequencies) takes the value __init__ computed,
    on every part that holds it; materializing leaves the template able to do it again."""
    from shardwise.training import job_names

    config = gpt_job(tmp_path, model={"name": "tests.foreign_models:rope_lm", "args": {}})
    template = job_names.build_with_meta_parameters(config)
    assert all(p.is_meta for p in template.parameters())
    expected = job_names.build_model(config).rotary.inv_freq
    assert torch.equal(template.rotary.inv_freq, expected)
    for _ in range(2):
        with torch.device("meta"):
            model = job_names.build_model(config)
        blocks = pipeline_blocks(model)
        first = stage_module(model, blocks, {"embed", "layers.0"})
        last = stage_module(model, blocks, {"layers.3", "final"})
        materialize([first, last], template, seed=0, device=torch.device("cpu"))
        assert torch.equal(first.rotary.inv_freq, expected)
        assert torch.equal(last.rotary.inv_freq, expected)
    assert all(p.is_meta for p in template.parameters())


def test_a_value_a_traced_stage_takes_from_further_back_is_carried_through_the_stages_between():
    """torch's tracer has every later stage take the gate from the first stage; carried through
    the stages between, each stage takes exactly what the one before returns (as the schedule
    and evaluation give it), and the stages compose to the model."""
    from shardwise.training.parallel.traced import trace_split

    torch.manual_seed(0)
    model = GatedResidualMLP(hidden=8, layers=4)
    example = torch.randn(3, 1, 8, 8)
    split = trace_split(model, example, num_stages=4, split=[])
    h = example
    for index in range(4):
        stage = split.modules[index]
        taken = [n for n in stage.graph.nodes if n.op == "placeholder"]
        if index > 0:
            assert len(taken) == len(h) == 2, index  # the hidden state and the gate
        h = stage(*h) if index > 0 else stage(h)
    torch.testing.assert_close(h, model(example))


def test_the_template_keeps_a_parameter_two_modules_were_built_with_as_one(tmp_path):
    from shardwise.training import job_names
    from shardwise.training.parallel.ties import tied_groups

    config = gpt_job(tmp_path, model={"name": "tests.foreign_models:shared_scale", "args": {}})
    template = job_names.build_with_meta_parameters(config)
    assert tied_groups(template) == [("first.scale", "second.scale")]
    assert template.first.scale is template.second.scale and template.first.scale.is_meta


def test_a_parameter_nothing_initialises_is_left_nan_where_weights_are_loaded_next():
    """A resumed run or `model.init_from` overwrites it (and cost balancing only times)."""
    with torch.device("meta"):
        model = _Scaled()
    materialize([model], copy.deepcopy(model), seed=0, device=torch.device("cpu"), strict=False)
    assert torch.isnan(model.scale).all() and not torch.isnan(model.linear.weight).any()


def gpt_layout(tmp_path, world_size, **parallel):
    config = gpt_job(
        tmp_path, model={"args": {"layers": 2, "heads": 4, "hidden": 32}}, parallel=parallel
    )
    return config, derive(config, world_size)


@pytest.mark.parametrize(
    ("world", "parallel", "message"),
    [
        (4, {"pp": 4, "pipeline_schedule": "Interleaved1F1B"}, "8 pipeline stages, but the model"),
        (3, {"tp": 3}, "does not divide the 4 attention heads"),
        (2, {"pp": 2, "pipeline_split": ["layers.9"]}, "is not one of the model's blocks"),
    ],
)
def test_impossible_layouts_fail_before_launch(tmp_path, world, parallel, message):
    config, derived = gpt_layout(tmp_path, world, **parallel)
    with pytest.raises(ConfigError, match=message):
        check_layout(config, derived)


@pytest.mark.parametrize(
    ("world", "parallel", "train", "message"),
    [
        (2, {"pp": 2, "pipeline_schedule": "1F1B"}, {"micro_batch": 16}, "at least as many"),
        (2, {"pp": 2, "pipeline_schedule": "DualPipeV"}, {"micro_batch": 8}, "DualPipeV needs"),
        (2, {"pp": 2, "pipeline_schedule": "GPipe", "stages_per_rank": 2}, {}, "one stage per"),
        (2, {"pp": 2, "pipeline_schedule": "ZBVZeroBubble", "stages_per_rank": 3}, {}, "exactly 2"),
        (2, {"num_microbatches": 2}, {}, "applies to pipeline parallelism"),
        (2, {"dp_shard": 2}, {"precision": "fp16"}, "use 'bf16'"),
        (
            2,
            {"pp": 2, "pipeline_schedule": "Interleaved1F1B"},
            {"global_batch": 10, "micro_batch": 2},
            "rounds of 2",
        ),
    ],
)
def test_pipeline_and_precision_settings_are_checked(tmp_path, world, parallel, train, message):
    config = gpt_job(tmp_path, parallel=parallel, train=train)
    with pytest.raises(ConfigError, match=message):
        derive(config, world)


def test_pipeline_micro_batches_derive_from_either_key(tmp_path):
    config = gpt_job(
        tmp_path, parallel={"pp": 2, "num_microbatches": 8}, train={"micro_batch": None}
    )
    derived = derive(config, 2)
    assert (derived.micro_batch, derived.grad_accum, derived.stages_per_rank) == (2, 8, 1)
    looped = gpt_job(tmp_path, parallel={"pp": 2, "pipeline_schedule": "Interleaved1F1B"})
    assert derive(looped, 2).stages_per_rank == 2


CONV_PLAN = "tests.foreign_models:conv_tp_plan"  # ColwiseParallel on a Conv2d


def zoo_job(tmp_path, model: str, **parallel):
    """A digits job with a model from tests/foreign_models.py (data builders run: checks trace the
    model on one micro-batch)."""
    return gpt_job(
        tmp_path,
        model={"name": f"tests.foreign_models:{model}", "args": {}},
        data={"name": "digits", "args": {}},
        train={"global_batch": 16, "micro_batch": 4},
        parallel=parallel,
    )


@pytest.mark.parametrize(
    ("model", "world", "parallel", "message"),
    [
        (
            "half_contract",
            2,
            {"pp": 2},
            r"HalfContract\.forward calls a block this stage does not hold "
            r"\(stage 0: TypeError: 'NoneType' object is not callable\).*skip blocks that are "
            r"None.*"
            r"docs/training.md, 'Pipeline parallelism'",
        ),
        (
            "names_a_missing_block",
            2,
            {"pp": 2},
            r"pipeline_blocks\(\) names 'head', which NamesAMissingBlock does not have",
        ),
        (
            "model_parallel_cnn",
            2,
            {"pp": 2},
            r"ModelParallelCNN is not a sequence of blocks .* and has no repeated layers to "
            r"split into 2 pipeline stages; name where stages begin with parallel.pipeline_split",
        ),
        (
            "model_parallel_cnn",
            2,
            {"pp": 2, "pipeline_split": ["clasifier"]},
            r"the model has no module 'clasifier'; did you mean 'classifier'\?",
        ),
        (
            "marked_cnn",
            4,
            {"pp": 4, "pipeline_schedule": "GPipe"},
            r"has 1 pipe_split\(\) markers, which make 2 stages, but .* = 4",
        ),
        (
            "model_parallel_cnn",
            2,
            {"pp": 2, "pipeline_split": ["classifier"], "pipeline_balance": "cost"},
            r"pipeline_balance = 'cost' times each block on its own",
        ),
        (
            "model_parallel_cnn",
            4,
            {"pp": 2, "tp": 2, "pipeline_split": ["classifier"], "tp_plan": CONV_PLAN},
            r"tensor parallelism cannot split a traced pipeline stage",
        ),
        (
            "bn_cnn",
            2,
            {"tp": 2, "tp_plan": CONV_PLAN},
            r"the tensor-parallel plan applies ColwiseParallel to '0', a Conv2d; ColwiseParallel "
            r"splits nn\.Linear and nn\.Embedding",
        ),
        (
            "model_parallel_cnn",
            1,
            {"activation_checkpoint": "full"},
            r"activation_checkpoint = 'full' recomputes blocks, but ModelParallelCNN has none",
        ),
    ],
    ids=[
        "half-a-contract",
        "missing-block",
        "nothing-to-split-at",
        "misspelt-split",
        "markers-vs-stages",
        "cost-balance-traced",
        "tp-traced",
        "style-on-wrong-layer",
        "recompute-without-blocks",
    ],
)
def test_models_that_cannot_take_a_layout_are_refused_before_launch(
    tmp_path, repo_cwd, model, world, parallel, message
):
    config = zoo_job(tmp_path, model, **parallel)
    with pytest.raises(ConfigError, match=message):
        check_layout(config, derive(config, world))


@pytest.mark.parametrize(
    ("model", "parallel"),
    [
        ("model_parallel_cnn", {"pp": 2, "pipeline_split": ["classifier"]}),
        ("marked_cnn", {"pp": 2}),
        ("residual_mlp", {"pp": 2, "activation_checkpoint": "full"}),
        ("bn_cnn", {"pp": 2}),
    ],
)
def test_models_that_can_take_a_layout_pass_the_checks(tmp_path, repo_cwd, model, parallel):
    config = zoo_job(tmp_path, model, **parallel)
    check_layout(config, derive(config, 2))


@pytest.mark.parametrize(
    ("model", "parallel", "line"),
    [
        (
            "residual_mlp",
            {"dp_shard": 2, "activation_checkpoint": "full"},
            "FSDP2 (ZeRO-3) shards 4 repeated Sequential layers (layers.0 … layers.3, found in "
            "the model) one at a time, then the rest of the model",
        ),
        (
            "residual_mlp",
            {"dp_shard": 2, "activation_checkpoint": "full"},
            "activation checkpointing (full) recomputes 4 repeated Sequential layers",
        ),
        (
            "model_parallel_cnn",
            {"dp_shard": 2},
            "FSDP2 (ZeRO-3) shards ModelParallelCNN as one unit, since it has no blocks",
        ),
        ("bn_cnn", {"dp_shard": 2, "reshard_after_forward": False}, "(ZeRO-2) shards 9 blocks"),
        ("bn_cnn", {}, "data parallel (DDP): every rank holds the whole model"),
    ],
)
def test_the_layout_says_what_it_applied_to_what(tmp_path, repo_cwd, model, parallel, line):
    """FSDP and recomputation without blocks are not silent no-ops: the start of every run
    says what each was applied to (repeated layers are found without the blocks contract)."""
    from shardwise.training import job_names
    from shardwise.training.parallel.apply import data_parallel_wrapper, describe
    from shardwise.training.parallel.pipeline import model_blocks

    config = zoo_job(tmp_path, model, **parallel)
    degrees = derive(config, 2).degrees
    built = job_names.build_model(config)
    lines = describe(
        built, model_blocks(built), degrees, config.parallel, data_parallel_wrapper(degrees)
    )
    assert any(line in printed for printed in lines), lines


needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install 'shardwise[hf]'; make test does)",
)


@needs_transformers
def test_a_hugging_face_model_initialises_on_the_meta_device_with_its_own_scheme(repo_cwd):
    """`model.init = "auto"` picks meta initialisation for a Hugging Face model (it crashed
    calling init_weights(module)): every module by Hugging Face's `_init_weights`, then its
    parents' (GPT-2's scaled residual projections), tied embeddings tied."""
    from shardwise.training import job_names
    from shardwise.training.parallel.meta_init import initializer

    args = {"n_layer": 4, "n_embd": 256, "n_head": 4}
    config = gpt_job(
        repo_cwd / "runs", model={"name": "examples.hf_gpt2:build_model", "args": args}
    )
    with torch.device("meta"):
        model = job_names.build_model(config)
    assert initializer(model) is not None and supports_meta_init(model)
    template = copy.deepcopy(model)
    materialize([model], template, seed=0, device=torch.device("cpu"))
    block = model.transformer.h[0]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / (2 * args["n_layer"]) ** 0.5  # by the parent GPT2Attention's init
    assert block.attn.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert torch.all(block.attn.c_attn.bias == 0) and torch.all(block.ln_1.weight == 1)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.config.use_cache is False  # no generation cache while training


@needs_transformers
def test_a_hugging_face_model_is_checked_before_launch(tmp_path, repo_cwd):
    config = gpt_job(
        tmp_path,
        model={"name": "examples.hf_gpt2:build_model", "args": {"n_embd": 32, "n_head": 4}},
        parallel={"tp": 3},
    )
    with pytest.raises(ConfigError, match="does not divide the 4 attention heads"):
        check_layout(config, derive(config, 3))


@pytest.mark.parametrize(
    ("parallel", "world", "words"),
    [
        ({}, 1, "torch.compile compiles GPT whole"),
        ({}, 2, "torch.compile compiles GPT whole inside DDP, split at its gradient buckets"),
        ({"dp_shard": 2}, 2, "one at a time (FSDP2 gathers and reduces around each block: they"),
        ({"pp": 2}, 2, "one at a time (the pipeline runs stages of blocks: they need"),
        ({"activation_checkpoint": "full"}, 1, "(activation checkpointing recomputes each block"),
        ({"backend": "aot_eager"}, 1, "torch.compile (aot_eager) compiles GPT whole"),
    ],
)
def test_train_compile_says_whether_it_compiles_the_model_whole_or_block_by_block(
    tmp_path, parallel, world, words
):
    """Whole where nothing wraps the blocks (one process, DDP), per block where a wrapper needs
    them; the start-up line says which, and names a backend other than inductor."""
    from shardwise.training import job_names
    from shardwise.training.parallel.apply import data_parallel_wrapper, describe
    from shardwise.training.parallel.compilation import whole_model
    from shardwise.training.parallel.pipeline import model_blocks

    parallel = dict(parallel)
    backend = parallel.pop("backend", "inductor")
    config = gpt_job(tmp_path, parallel=parallel, train={"compile": True})
    degrees = derive(config, world).degrees
    wrapper = data_parallel_wrapper(degrees)
    whole = whole_model(degrees, config.parallel.activation_checkpoint, wrapper)
    assert whole == (words.startswith("torch.compile") and "compiles GPT whole" in words)
    built = job_names.build_model(config)
    lines = describe(
        built,
        model_blocks(built),
        degrees,
        config.parallel,
        wrapper,
        compiled="whole" if whole else "blocks",
        backend=backend,
    )
    assert any(words in line for line in lines), lines


def test_a_users_loss_is_said_to_run_outside_the_compiled_graphs():
    from shardwise.training.parallel.compilation import describe_loss

    mine = describe_loss("mine:loss", compiled="whole", one_graph=True, builtin=False)
    assert (
        mine == "the loss (mine:loss) is the user's and runs eagerly, outside the compiled graphs"
    )
    ours = describe_loss("cross_entropy", compiled="whole", one_graph=True, builtin=True)
    assert ours == "the loss (cross_entropy) is compiled in the same graph as the model"


def test_a_model_without_markers_is_traced_once_and_one_with_them_as_marked(monkeypatch):
    """An automatic split traces the model once (torch.export's whole work); looking for
    pipe_split() markers runs its forward on the meta device instead of a trace of its own. A
    model with markers is cut where they are, whether or not the meta run could look."""
    import foreign_models
    from shardwise.training.parallel import traced

    traces = []
    real_pipeline = traced._pipeline
    monkeypatch.setattr(
        traced, "_pipeline", lambda m, e, s: traces.append(s) or real_pipeline(m, e, s)
    )
    with torch.device("meta"):
        residual, marked = foreign_models.residual_mlp(), foreign_models.marked_cnn()
    split = traced.trace_split(residual, torch.zeros(4, 64, device="meta"), num_stages=2, split=[])
    assert traces == [split.split] and split.split == ["layers.2"]
    traces.clear()
    cut = traced.trace_split(marked, torch.zeros(4, 1, 8, 8, device="meta"), num_stages=2, split=[])
    assert traces == [None] and len(cut.modules) == 2
    # off the meta device the forward would compute and draw random numbers: not run to look;
    # the automatic split's trace makes the stages asked for, so there are no markers
    traces.clear()
    split = traced.trace_split(
        foreign_models.residual_mlp(), torch.zeros(4, 64), num_stages=2, split=[]
    )
    assert traces == [["layers.2"]] and len(split.modules) == 2
    # with a marker as well, that trace makes more stages: cut at the marker
    traces.clear()
    cut = traced.trace_split(MarkedResidual(), torch.zeros(4, 64), num_stages=2, split=[])
    assert traces == [["layers.2"], None] and len(cut.modules) == 2 and cut.split == []
    held = [sorted({n.split(".")[1] for n in cut.held[s]}) for s in (0, 1)]
    assert held == [["0"], ["1", "2", "3"]]  # the layers' indices each stage holds
    # named split points are the only cuts there may be: with a marker as well, refused
    with pytest.raises(ConfigError, match=r"into 3 stages, not .* = 2: its forward has pipe_"):
        traced.trace_split(MarkedResidual(), torch.zeros(4, 64), num_stages=2, split=["layers.2"])
    # the meta run to count markers runs a copy: what a forward caches stays off the model
    with torch.device("meta"):
        model = MarkedResidual()
    traced.trace_split(model, torch.zeros(4, 64, device="meta"), num_stages=2, split=[])
    assert not hasattr(model, "ran")


class MarkedResidual(nn.Module):
    """Repeated layers, and a pipe_split() marker after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split

        self.ran = True  # a forward that caches something on its module
        for i, layer in enumerate(self.layers):
            if i == 1:
                pipe_split()
            x = x + layer(x)
        return x
