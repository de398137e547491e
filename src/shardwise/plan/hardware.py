"""Hardware the planner plans for: device memory, dense 16-bit peak FLOP/s, memory bandwidth, and
the links between devices (inside a node and across nodes), as presets, from a TOML file, or
calibrated on this machine (calibrate.py).

Preset sources: memory as `nvidia-smi` reports it; peak dense BF16/FP16 tensor FLOP/s and HBM
bandwidth from NVIDIA's data sheets (A100: 312 TFLOP/s, 1.56/2.04 TB/s; H100 SXM and H200:
989 TFLOP/s, 3.35/4.8 TB/s; L40S: 362 TFLOP/s, 864 GB/s); NVLink per GPU per direction (A100 300
GB/s, H100/H200 450 GB/s; L40S has PCIe Gen4 x16, 32 GB/s); one 200 Gb/s (A100 nodes) or 400 Gb/s
(H100/H200 nodes) InfiniBand port per GPU, 100 Gb/s Ethernet per GPU for L40S nodes. Latencies
are typical NCCL figures (a few µs in a node, ~10 µs across), assumptions rather than data-sheet
values. Every value can be overridden.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from shardwise.common.devices import DATASHEET_TFLOPS, profile_path
from shardwise.common.errors import ConfigError
from shardwise.plan.bounds import Bound

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory: float
    """Bytes per device."""
    peak_flops: float
    """Dense 16-bit matrix-multiply FLOP/s per device (fp32 on a CPU profile)."""
    memory_bandwidth: float
    """Bytes/s between a device and its memory (element-wise work, the optimizer step)."""
    intra_bandwidth: float
    """Bytes/s per device, one direction, to another device of the same node."""
    intra_latency: float
    inter_bandwidth: float
    """Bytes/s per device, one direction, to a device on another node."""
    inter_latency: float
    gpus_per_node: int = 8
    utilisation: float = 0.5
    """Fraction of `peak_flops` a large layer's forward and backward achieve (Megatron-LM reached
    44–52% of A100 peak); smaller layers reach less, by `layer_overhead`. Calibrated profiles
    measure both."""
    layer_overhead: float = 0.0
    """Seconds one transformer layer's forward and backward take per micro-batch beyond its FLOPs
    at `utilisation` × peak: t = F / (utilisation · peak) + layer_overhead. It is what makes a
    small model, or a small micro-batch, reach far less of the peak than a large one (kernel
    launches, normalisations, activations, attention's softmax). 0: a flat rate (what a given
    `--utilisation` means)."""
    overlap: float = 1.0
    """How much of the data-parallel communication can hide behind the backward pass: 1 on
    GPUs (NCCL runs on its own streams), 0 where the same cores compute and communicate."""
    all_gather_latency: float | None = None
    all_gather_bandwidth: float | None = None
    """All-gathers' own α and β, where measured (calibrated profiles: gloo's collectives differ
    from one another); None: the ring model on the link's all-reduce α and β, as with NCCL."""
    reduce_scatter_latency: float | None = None
    reduce_scatter_bandwidth: float | None = None
    tensor_parallel_efficiency: float = 1.0
    """The rate a tensor-parallel layer's compute reaches, relative to the whole layer's: its
    matrices are 1/tp as wide, and its host dispatches every op through DTensor. 1 on GPUs (the
    host runs ahead of the kernels, and `utilisation` already reflects Megatron's tensor-parallel
    runs); calibrated profiles measure it, collectives excluded."""
    runtime_memory: float = 0.0
    """Bytes a training process holds beyond its tensors once every kernel has run: library code
    paged in, kernel and communication workspaces. Calibrated profiles measure it; presets
    leave it (with the CUDA context) to the search's headroom."""
    half_codec_rate: float | None = None
    """Bytes of fp32 gradients per second one rank puts through comm/'s bf16 codec and error
    feedback (the casts both ways, what was lost kept), collectives aside. Calibrated profiles
    measure it (a CPU core casts far slower than it copies); None: memory bandwidth over the
    passes `comm_modes.CODEC_PASSES` counts."""
    int8_codec_rate: float | None = None
    """Likewise through the int8 codec (quantising per chunk, summing, quantising again)."""
    powersgd_codec_rate: float | None = None
    """Bytes of fp32 gradients per second through comm/powersgd.py's own work at rank
    POWERSGD_RANK, beside a cost per matrix:"""
    powersgd_matrix_seconds: float | None = None
    """seconds of that work per compressed matrix, whatever its size (a few dozen small
    operations). None (either): memory bandwidth over `comm_modes.CODEC_PASSES` and the FLOPs."""
    dispatch_seconds: float | None = None
    """Seconds the host takes per operator it dispatches in an eager step (Python, torch's
    dispatcher and the kernel launch), measured on a GPU by running a block too small to keep it
    busy; where known, a step takes at least its operators' count × this (timing.host_time).
    None: not measured (the layer overhead stands in for the host's work)."""
    calibrated: bool = False
    device: str = ""
    """The device a calibrated profile measured: the GPU's name as torch reports it, or `cpu`
    (its figures are per core). A run on that device takes its peak from the profile."""


_RATE = Bound(0, 1e18, above=True, means="bytes/s")
_LATENCY = Bound(0, 60, means="seconds")
FIELDS: dict[str, Bound] = {
    "memory": Bound(0, 1e18, above=True, means="bytes per device"),
    "peak_flops": Bound(0, 1e21, above=True, means="FLOP/s per device"),
    "memory_bandwidth": _RATE,
    "intra_bandwidth": _RATE,
    "intra_latency": _LATENCY,
    "inter_bandwidth": _RATE,
    "inter_latency": _LATENCY,
    "gpus_per_node": Bound(1, 4096, whole=True, means="devices, or calibrated cores, per node"),
    "utilisation": Bound(0, 1, above=True, means="the fraction of peak a step achieves, e.g. 0.5"),
    "layer_overhead": Bound(0, 60, means="seconds per layer and micro-batch"),
    "overlap": Bound(0, 1, means="the fraction of data-parallel traffic that can hide"),
    "all_gather_latency": _LATENCY,
    "all_gather_bandwidth": _RATE,
    "reduce_scatter_latency": _LATENCY,
    "reduce_scatter_bandwidth": _RATE,
    "tensor_parallel_efficiency": Bound(0, 1, above=True, means="a fraction"),
    "runtime_memory": Bound(0, 1e18, means="bytes"),
    "half_codec_rate": _RATE,
    "int8_codec_rate": _RATE,
    "powersgd_codec_rate": _RATE,
    "powersgd_matrix_seconds": _LATENCY,
    "dispatch_seconds": _LATENCY,
}
"""The range of each numeric field of `Hardware` (a file's, or a calibrated profile's)."""


HOPPER_UTILISATION, LAYER_OVERHEAD = 0.557, 1.35e-3
"""The curve fitted (least squares, seconds per step) to one H200's measured steps in issue 17:
the built-in GPT (vocabulary 256, sequence 1024, micro-batch 16, bf16 autocast, one process) at
86M, 304M and 1.2B parameters, 38.3, 99.9 and 289.3 ms per step; the fit predicts them within 5%
(a flat 50% predicted 0.58×, 0.76× and 0.98× of them). H100 has H200's compute and is given its
curve; A100 and L40S keep Megatron-LM's 50% for large layers with the same overhead per layer —
assumptions, not measurements: `shardwise plan --calibrate` on the GPU measures both."""


def _gpu(
    name: str,
    mib: int,
    tflops: float,
    hbm: float,
    nvlink: float,
    network: float,
    *,
    utilisation: float = 0.5,
) -> Hardware:
    return Hardware(
        name=name,
        memory=mib * 2**20,
        peak_flops=tflops * 1e12,
        memory_bandwidth=hbm * 1e9,
        intra_bandwidth=nvlink * 1e9,
        intra_latency=5e-6,
        inter_bandwidth=network * 1e9,
        inter_latency=10e-6,
        utilisation=utilisation,
        layer_overhead=LAYER_OVERHEAD,
    )


PRESETS: dict[str, Hardware] = {
    "a100-40gb": _gpu("a100-40gb", 40_960, DATASHEET_TFLOPS["a100"], 1_555, 300, 25),
    "a100-80gb": _gpu("a100-80gb", 81_920, DATASHEET_TFLOPS["a100"], 2_039, 300, 25),
    "h100": _gpu(
        "h100", 81_559, DATASHEET_TFLOPS["h100"], 3_350, 450, 50, utilisation=HOPPER_UTILISATION
    ),
    "h200": _gpu(
        "h200", 143_771, DATASHEET_TFLOPS["h200"], 4_800, 450, 50, utilisation=HOPPER_UTILISATION
    ),
    "l40s": _gpu("l40s", 46_068, DATASHEET_TFLOPS["l40s"], 864, 32, 12.5),
}
ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "h100-80gb": "h100"}
THIS_MACHINE = "this-machine"
POWERSGD_RANK = 4
"""The rank calibration times PowerSGD's work at (`powersgd_codec_rate`)."""


class UnknownHardware(ConfigError):
    """A hardware name, file or profile that cannot be used; the message says why."""


def lookup(name: str) -> Hardware:
    """A preset, `this-machine` (the calibrated profile), or a TOML/JSON file of fields."""
    key = ALIASES.get(name.lower(), name.lower())
    if key in PRESETS:
        return PRESETS[key]
    if key == THIS_MACHINE:
        path = profile_path()
        if not path.exists():
            raise UnknownHardware(
                f"--hardware this-machine: no calibrated profile at {path}; run "
                "`shardwise plan --calibrate` first (about a minute)"
            )
        where = f"the calibrated profile {path}"
        again = "; run `shardwise plan --calibrate` again"
        return from_mapping(_read(path, where, again), name=THIS_MACHINE, where=where)
    path = Path(name)
    if path.suffix in (".toml", ".json"):
        where = f"--hardware {name}"
        if not path.exists():
            raise UnknownHardware(f"{where}: no such file")
        data = _read(path, where, "")
        return from_mapping(data, name=data.get("name", path.stem), where=where)
    nearest = difflib.get_close_matches(key, [*PRESETS, THIS_MACHINE], n=1, cutoff=0)[0]
    raise UnknownHardware(
        f"--hardware {name}: unknown; did you mean '{nearest}'? Known: "
        f"{', '.join([*PRESETS, THIS_MACHINE])}, or a .toml file of fields "
        f"({', '.join(f.name for f in fields(Hardware) if f.name != 'name')})"
    )


def _read(path: Path, where: str, again: str) -> dict[str, Any]:
    """A TOML or JSON file's table of fields; UnknownHardware if it is not one."""
    kind = "TOML" if path.suffix == ".toml" else "JSON"
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if kind == "TOML" else json.loads(text)
    except OSError as e:
        raise UnknownHardware(f"{where}: cannot read it ({e.strerror}){again}") from None
    except (ValueError, RecursionError) as e:  # undecodable bytes, bad TOML or JSON, deep nesting
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UnknownHardware(f"{where}: not a {kind} file ({reason}){again}") from None
    if not isinstance(data, dict):
        raise UnknownHardware(f"{where}: must be a table of fields, not {type(data).__name__}")
    return data


def from_mapping(data: dict[str, Any], *, name: object, where: str = "") -> Hardware:
    """Hardware from fields, each checked against `FIELDS`; `base = "<preset>"` starts from a
    preset and changes the rest. `where` names the source in messages."""
    where = where or f"hardware {name}"
    if not isinstance(name, str) or not name:
        raise UnknownHardware(f'{where}: name = {name!r} must be a string, e.g. name = "my-gpu"')
    data = dict(data)
    base_name = data.pop("base", "")
    data.pop("name", None)
    known = {f.name for f in fields(Hardware)} - {"name"}
    unknown = sorted(set(data) - known, key=str)
    if unknown:
        raise UnknownHardware(f"{where}: unknown field {unknown[0]!r}; fields: {sorted(known)}")
    if base_name and (not isinstance(base_name, str) or base_name not in PRESETS):
        raise UnknownHardware(f"{where}: base {base_name!r} is not one of {', '.join(PRESETS)}")
    for key, value in data.items():
        data[key] = _checked(key, value, where)
    base = asdict(PRESETS[base_name]) if base_name else {}
    values = {**base, **data, "name": name}
    defaults = {f.name for f in fields(Hardware) if f.default is not MISSING}
    missing = sorted(known - set(values) - defaults)
    if missing:
        raise UnknownHardware(f"{where}: missing {', '.join(missing)} (or set base)")
    return Hardware(**values)


_NOT_NUMBERS = {
    "calibrated": (bool, "must be true or false"),
    "device": (str, 'must be a name, e.g. "cpu"'),
}


def _checked(key: str, value: Any, where: str) -> Any:
    """A field's value as the profile holds it, or UnknownHardware naming what is wrong."""
    if key in _NOT_NUMBERS:
        kind, rule = _NOT_NUMBERS[key]
        if not isinstance(value, kind):
            raise UnknownHardware(f"{where}: {key} = {value!r} {rule}")
        return value
    optional = {f.name for f in fields(Hardware) if f.default is None}
    if value is None and key in optional:
        return value
    return FIELDS[key].check(value, f"{where}: {key} =")


def with_overrides(hardware: Hardware, **overrides: float | int | None) -> Hardware:
    values: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    return replace(hardware, **values)


def save_profile(hardware: Hardware, path: Path | None = None) -> Path:
    path = path or profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in asdict(hardware).items() if k != "name"}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
