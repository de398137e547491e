"""Turn the names in a job file (`model.name`, `data.name`, `train.loss`) into callables: a
built-in by its short name, or a user's function by `package.module:function`.

User contracts (also in docs/training.md):
- model builder: `build_model(**model.args) -> torch.nn.Module`; `forward(inputs) -> outputs`.
- data builder: `build_datasets(**data.args) -> (train, held_out)`, map-style datasets whose items
  are `(inputs, target)`; `held_out` may be None. The built-in `parquet`, `delta` and `iceberg`
  return streamed tables instead (data/stream/), which `check` opens before launch.
- loss: `loss(outputs, target) -> scalar tensor`, the mean over the batch's target elements;
  `outputs` is what the model's forward returned (a Hugging Face `ModelOutput`, say), which the
  built-in losses read with `model_output`.

`check` validates names and arguments before any process starts, so a typo fails in a second with
one line instead of N tracebacks. This module must not build anything at import time.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional name)
from pydantic import TypeAdapter, ValidationError
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import Dataset

from shardwise.common.errors import ConfigError
from shardwise.common.imports import import_object
from shardwise.common.job_files import accepts_bool, accepts_str, kind_of
from shardwise.models import hf_init
from shardwise.models.gpt import build_gpt
from shardwise.models.vision import build_cnn, build_mlp, build_resnet
from shardwise.training.config.schema import JobConfig
from shardwise.training.data import iterable
from shardwise.training.data.digits import build_digits
from shardwise.training.data.sampling import enough
from shardwise.training.data.stream.builtins import build_delta, build_iceberg, build_parquet
from shardwise.training.data.stream.source import READ_ERRORS, data_problem
from shardwise.training.data.stream.table import Stream, TableSource
from shardwise.training.data.text import build_text

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
T = TypeVar("T")


def model_output(outputs: Any) -> torch.Tensor:
    """The tensor a model's forward returned: itself; the `logits` of a Hugging Face
    `ModelOutput` (or of a dict); or the first tensor of a tuple (or of a dict)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(outputs, dict):
        logits = outputs.get("logits", logits)
        outputs = list(outputs.values())
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, tuple | list):
        first = next((o for o in outputs if isinstance(o, torch.Tensor)), None)
        if first is not None:
            return first
    raise TypeError(
        f"the model's forward returned {type(outputs).__name__}, which holds no tensor to "
        "compute a loss on; return a tensor, a tuple of tensors or a ModelOutput with logits"
    )


def cross_entropy(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension; works for (batch, classes) and (batch, seq, vocab)."""
    return F.cross_entropy(model_output(outputs).flatten(0, -2).float(), target.flatten())


def mse(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model_output(outputs).float().reshape(target.shape), target.float())


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "gpt": build_gpt,
    "resnet": build_resnet,
}
DATASETS: dict[str, Callable[..., Any]] = {
    "digits": build_digits,
    "text": build_text,
    "parquet": build_parquet,
    "delta": build_delta,
    "iceberg": build_iceberg,
}
LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def check(config: JobConfig) -> None:
    """Resolve every name in the config and check builder arguments, without building anything."""
    model_builder = resolve(config.model.name, MODELS, "model.name")
    model = _check_args("model", model_builder, config.model.args)
    data = _check_args("data", resolve(config.data.name, DATASETS, "data.name"), config.data.args)
    resolve(config.train.loss, LOSSES, "train.loss")
    if config.data.name in STREAMED:
        open_streams(config)
    if config.parallel.tp_plan:
        resolve(config.parallel.tp_plan, {}, "parallel.tp_plan")
    if config.train.compile and config.train.compile_backend != "inductor":
        _check_compile_backend(config.train.compile_backend)
    if config.model.name == "gpt" and config.data.name == "text":
        model_len = model.get("seq_len", 128)
        data_len = data.get("seq_len", 128)
        if data_len > model_len:
            raise ConfigError(
                f"data.args.seq_len ({data_len}) is longer than model.args.seq_len ({model_len}); "
                "the GPT cannot see past its position table, so make them equal"
            )


def _check_compile_backend(backend: str) -> None:
    import torch._dynamo  # 1.8 s to import: only for a backend other than the default

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(
            f"train.compile_backend = {backend!r} is not a torch.compile backend; use one of: "
            f"{', '.join(torch._dynamo.list_backends())}, or to debug, aot_eager or eager"
        )


def build_model(config: JobConfig) -> nn.Module:
    model = _call("model", resolve(config.model.name, MODELS, "model.name"), config.model.args)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model builder {config.model.name} returned {type(model).__name__}; "
            "it must return a torch.nn.Module"
        )
    hf_init.prepare(model)
    return model


def build_on_meta(config: JobConfig) -> nn.Module:
    """The job's model on the meta device, for what needs its structure and shapes only (the
    launcher's checks, the planner). Initialisers are skipped on its tensors: they hold no values,
    so skipping changes nothing (nor does a meta initialiser draw from the random generator), and
    torch runs some of them (normal_) in Python through torch._dynamo, whose import every
    launcher would then pay."""
    with torch.device("meta"), _NoInitOnMeta():
        return build_model(config)


def build_with_meta_parameters(config: JobConfig) -> nn.Module:
    """The job's model with its parameters on the meta device and its buffers as its
    `__init__` computed them, on the CPU: the values a model initialised on the meta device
    takes its buffers from (a rotary embedding's frequencies, a causal mask), which no
    initialiser may set again. Each parameter moves to the meta device as it is registered, so
    the build holds one at a time (uninitialised: its module's initialisers then skip it)."""

    moved: dict[int, tuple[Any, nn.Parameter]] = {}  # the original kept: its id stays unique

    def to_meta(_module: nn.Module, _name: str, param: Any) -> Any:
        if param is None or param.is_meta:
            return None  # kept as it is: a tied parameter registered again stays one
        if id(param) not in moved:  # one parameter registered in two modules stays one too
            meta = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
            moved[id(param)] = (param, meta)
        return moved[id(param)][1]

    hook = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        with _NoInitOnMeta(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.job.seed)  # a buffer drawn at random: the same on every rank
            return build_model(config)
    finally:
        hook.remove()


class _NoInitOnMeta(TorchFunctionMode):
    """torch.nn.init's initialisers and Tensor's in-place random fills return a meta tensor as it
    is."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _INITIALISERS:  # nn.init's pass their tensor by keyword
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


_INITIALISERS = frozenset(
    [
        *(getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")),
        *(
            getattr(torch.Tensor, n)
            for n in (
                "normal_",
                "uniform_",
                "bernoulli_",
                "exponential_",
                "geometric_",
                "log_normal_",
                "cauchy_",
                "random_",
            )
        ),
    ]
)


POSITION = ("dp_rank", "dp_size")
"""Keyword arguments a data builder may take to shard its data (an IterableDataset's) itself."""


def takes_position(config: JobConfig) -> bool:
    builder = resolve(config.data.name, DATASETS, "data.name")
    return set(POSITION) <= set(inspect.signature(builder).parameters)


def build_datasets(
    config: JobConfig, *, dp_rank: int = 0, dp_size: int = 1
) -> tuple[Dataset, Dataset | None]:
    """The builder's `(train, held_out)`; a builder that takes `dp_rank` and `dp_size` gets this
    rank's data-parallel position."""
    builder = resolve(config.data.name, DATASETS, "data.name")
    args = dict(config.data.args)
    if takes_position(config):
        args.update(dp_rank=dp_rank, dp_size=dp_size)
    built = _call("data", builder, args)
    if not (isinstance(built, tuple) and len(built) == 2):
        raise ConfigError(
            f"data builder {config.data.name} returned {type(built).__name__}; "
            "it must return a tuple (train_dataset, held_out_dataset_or_None)"
        )
    return built[0], built[1]


STREAMED = ("parquet", "delta", "iceberg")


def open_streams(config: JobConfig) -> tuple[Stream, Stream | None]:
    """A streamed job's training and held-out tables, listed, pinned and checked: every column
    there and convertible, the first rows readable, enough rows for a step. A `ConfigError`
    names what is wrong (unreachable storage within seconds, not a hang)."""
    train, held_out = build_datasets(config)
    assert isinstance(train, TableSource)
    opened = _reading(train.open)
    _reading(lambda: opened.head(1))
    held = _reading(held_out.open) if isinstance(held_out, TableSource) else None
    if held is not None:
        _reading(lambda: held.head(1))
    enough(opened.snapshot.rows, config.train.global_batch, f"data: {opened.snapshot.where}")
    return opened, held


def stream_version(config: JobConfig) -> dict[str, Any]:
    """What identifies the version of the data a streamed job reads now."""
    train, _ = build_datasets(config)
    assert isinstance(train, TableSource)
    return _reading(train.listed).version


def first_inputs(config: JobConfig, count: int) -> Any:
    """The inputs of the training data's first `count` samples, batched as the model takes them:
    a logged model's input example (a map-style set's first items, an IterableDataset's, a
    streamed table's first rows)."""
    train, _ = build_datasets(config)
    if isinstance(train, TableSource):
        items: list[Any] = _reading(lambda: train.open().head(count))
    elif isinstance(train, torch.utils.data.IterableDataset):
        items = iterable.head(train, count)
    else:
        items = [train[i] for i in range(min(count, len(train)))]  # type: ignore[arg-type]
    return torch.utils.data.default_collate([item[0] for item in items])


def _reading(call: Callable[[], T]) -> T:
    """`call()`, reading a streamed table: what the data is wrong about, as one line."""
    try:
        return call()
    except READ_ERRORS as e:
        raise ConfigError(data_problem(e)) from None


def build_loss(config: JobConfig) -> LossFn:
    loss: LossFn = resolve(config.train.loss, LOSSES, "train.loss")
    return loss


def resolve(name: str, builtins: dict[str, Any], key: str) -> Any:
    """A built-in by name, or `package.module:attr` imported relative to the working directory."""
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, list(builtins), n=1)
        if close:
            hint = f"; did you mean '{close[0]}'?"
        else:
            hint = f"; built-ins: {', '.join(builtins)}" if builtins else ""
        kind = "neither a built-in nor an import path" if builtins else "not an import path"
        raise ConfigError(f"{key} = '{name}' is {kind} like 'package.module:function'{hint}")
    return import_object(name, key)


def _check_args(section: str, builder: Callable[..., Any], args: dict[str, Any]) -> dict[str, Any]:
    """The builder's arguments, checked against its signature and annotations (constraints
    such as `PositiveInt` included) and converted to the annotated types."""
    signature = inspect.signature(builder)
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in args:
        if key not in params and not takes_any:
            close = difflib.get_close_matches(key, list(params), n=1)
            hint = (
                f"did you mean '{section}.args.{close[0]}'?"
                if close
                else (f"it takes: {', '.join(params) or 'no arguments'}")
            )
            raise ConfigError(f"unknown key '{section}.args.{key}'; {hint}")
    missing = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and n not in args
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        and not (section == "data" and n in POSITION)  # given by the trainer, per rank
    ]
    if missing:
        raise ConfigError(f"missing key '{section}.args.{missing[0]}' (the builder requires it)")
    try:
        hints = typing.get_type_hints(builder, include_extras=True)
    except (NameError, TypeError):
        return args  # annotations we cannot resolve: the builder checks its own arguments
    checked = dict(args)
    for key, value in args.items():
        if key in hints:
            if isinstance(value, bool) and not accepts_bool(hints[key]):
                raise ConfigError(
                    f"{section}.args.{key}: expected a number, not {str(value).lower()}"
                )
            if isinstance(value, str) and not accepts_str(hints[key]):
                raise ConfigError(
                    f"{section}.args.{key}: expected {kind_of(hints[key])}, not the string "
                    f"{value!r}: write it without quotes"
                )
            try:  # the builder gets the value as annotated (12.0 for an int: 12)
                checked[key] = TypeAdapter(hints[key]).validate_python(value, strict=False)
            except ValidationError as e:
                reason = e.errors()[0]["msg"].lower()
                raise ConfigError(f"{section}.args.{key}: {reason} (got {value!r})") from None
    return checked


def _call(section: str, builder: Callable[..., Any], args: dict[str, Any]) -> Any:
    args = _check_args(section, builder, args)
    try:
        return builder(**args)
    except ValueError as e:  # builders raise ValueError for bad arguments (see the style guide)
        raise ConfigError(f"{section}: {e}") from e
