"""Communication strategies across two simulated machines on a slow network: step time, bytes sent
and the held-out loss of each, against plain DDP measured in the same run.

Two network namespaces (tests/netns.py) are the machines, joined by a link shaped to `--mbit` in
each direction and `--delay-ms` one way; the script first measures what the link carries (a bulk
TCP transfer each way, a 64-byte TCP ping). On it, `shardwise train` runs the built-in byte-level
GPT on the `text` data, 2 ranks per node (`--nproc 2 --nnodes 2`, one torch thread per rank,
OMP_NUM_THREADS=1, gloo on the link's interface), once per mode: a name and the `--set` overrides
in MODES. The model (4 layers, width 192: 1.9 M parameters, 7.6 MB of fp32 gradients) is sized so
that at 100 Mbit/s the gradient all-reduce dominates the step: a ring over the 4 ranks carries
1.5 × the gradients across the link each way, about 0.95 s at 95 Mbit/s, while a step's compute
(4 sequences of 64 bytes per rank, 4 ranks on 2 cores) takes about 0.3 s. Measured with ddp:
1.11 s per step at 100 Mbit/s and 2 ms, 0.30 s on the unshaped link (`--mbit 0 --delay-ms 0`).

Method (../shared/DESIGN.md, "Performance method"):
- Modes are interleaved (ddp, bf16, …, ddp, bf16, …) and the whole comparison repeated; medians
  and the min–max spread are printed, and ratios against ddp are taken within each repeat.
- Step time: the trainer logs `samples/s` over each window of `tracking.log_every` steps, with
  evaluation and checkpoint time taken out. The step time of a run is global_batch / the median
  of its windows' samples/s, the first window (start-up, warm-up, PowerSGD's uncompressed first
  steps) left out. This is robust where long-minus-short is not: each run of a two-node job has
  its own rendezvous and start-up (seconds, and noisy on a loaded 2-core machine), which the
  difference of two runs would carry into a per-step figure, at twice the runs. `log_every`
  (default 16) must be a multiple of `sync_every` so that every window holds the same number of
  synchronisations. Start-up (launch to the trainer's first record) is reported separately.
- Bytes per step: the `comm/bytes_per_step` the trainer logs (what rank 0 sent for data-parallel
  synchronisation), median over the same windows; "-" where a mode does not log it.
- Loss: `eval/loss` on the held-out split after the last step, every mode after the same number
  of samples (the same steps and global batch); evaluated every `log_every` steps for the chart.
- `ddp` pins the flat every-step fp32 all-reduce (parallel.hierarchical = "auto" would turn on
  node-aware reduction for a two-node job), so `hierarchical` is compared with the flat one; the
  other modes keep the default, as a user who sets only their keys gets.
- A mode that fails or overruns `--run-timeout` is reported with its error and the rest go on.
- `--predict`: each mode's job is planned for the same run (`shardwise plan JOB --nproc 4 --link
  GBPS,DELAY_MS --json`: 2 nodes × 2 ranks, the link's measured TCP rate in Gbit/s, the shaped
  one-way delay) on this machine's calibrated profile (`shardwise plan --calibrate` first), whose
  per-core compute and memory rates are scaled by cores / ranks since the 4 ranks share the
  cores. The planner's row for the job's own mode (`job_mode`: e.g. `hierarchical + bf16`, as
  `parallel.hierarchical = "auto"` makes it on two nodes) gives the predicted step time and bytes,
  printed against the measured ones with their ratio (target: step time within ±25%). Predicted
  bytes are the steady state; the measured are averaged since the start (PowerSGD's first
  `powersgd_start_step` steps are uncompressed).

Writes to --out (default bench/out/comm_strategies/): results.json (every run's numbers, the link
measurements, the job), loss_vs_time.png (training and held-out loss against wall time, every
run), job.toml, and runs/<mode>-<repeat>/ (metrics.jsonl and each node's output).

    python bench/comm_strategies.py                           # every mode, 3 repeats (as root)
    python bench/comm_strategies.py --modes ddp,bf16 --repeats 5 --mbit 50 --delay-ms 10
    python bench/comm_strategies.py --modes ddp --repeats 1 --steps 48     # the harness alone
    python bench/comm_strategies.py --modes ddp --mbit 0 --delay-ms 0      # compute-bound
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
BIN = Path(sys.executable).parent
MODES: dict[str, list[str]] = {
    "ddp": ["parallel.hierarchical=false"],
    "bf16": ["parallel.grad_compression=bf16"],
    "powersgd": ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=4"],
    "int8": ["parallel.grad_compression=int8"],
    "hierarchical": ["parallel.hierarchical=true"],
    "local_sgd": ["train.sync=local_sgd", "train.sync_every=16"],
    "diloco": ["train.sync=diloco", "train.sync_every=16"],
    "async": ["train.sync=async", "train.max_staleness=4"],
}
BASELINE = "ddp"
JOB: dict[str, Any] = {
    "job": {"name": "comm-strategies", "seed": 0, "threads_per_rank": 1},
    "model": {"name": "gpt", "args": {"layers": 4, "heads": 4, "hidden": 192, "seq_len": 64}},
    "data": {"name": "text", "args": {"seq_len": 64, "eval_fraction": 0.05}},
    "train": {
        "steps": 64,
        "global_batch": 16,  # 4 ranks × micro-batches of 4
        "micro_batch": 4,
        "lr": 1e-3,
        "weight_decay": 0.1,
        "betas": [0.9, 0.95],
        "warmup_steps": 8,
        "precision": "fp32",
    },
    "eval": {"max_samples": 256},
    "checkpoint": {"every_steps": 0},
    "tracking": {"mlflow": False},
}
NPROC, NNODES = 2, 2


def main() -> None:
    args = parse_args()
    check_prerequisites()
    modes = {name: MODES[name] for name in args.modes}
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    job = write_job(out / "job.toml", args.steps, args.log_every)
    print(
        f"{os.cpu_count()} cores; {NNODES} nodes × {NPROC} ranks, 1 torch thread per rank, "
        f"OMP_NUM_THREADS=1; {args.steps} steps of {JOB['train']['global_batch']} sequences, "
        f"log_every {args.log_every}; modes {', '.join(modes)}; {args.repeats} repeats"
    )
    import pytest

    from netns import two_nodes

    try:
        with two_nodes(mbit=args.mbit or None, delay_ms=args.delay_ms) as nodes:
            link = measure_link(nodes, args.mbit, args.delay_ms)
            predicted = predict(job, modes, link) if args.predict else {}
            runs = run_all(nodes, job, modes, args, out / "runs")
            link["queues"] = queue_counters(nodes)
    except pytest.skip.Exception as e:  # what two_nodes raises where it cannot build the nodes
        raise SystemExit(f"comm_strategies: cannot simulate two nodes here: {e}") from None
    summary = summarize(runs, modes)
    print_table(summary)
    if predicted:
        print_predictions(summary, predicted)
    dropped = sum(q["drops"] for q in link["queues"].values())
    sent = sum(q["packets"] for q in link["queues"].values())
    print(f"\nthe link's queues dropped {dropped} of {sent} packets in all")
    results = {"job": JOB, "args": vars(args), "link": link, "predicted": predicted}
    results |= {"modes": modes, "summary": summary, "runs": runs}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(runs, out / "loss_vs_time.png")
    print(f"wrote {out / 'results.json'} and {out / 'loss_vs_time.png'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES)
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--mbit", type=float, default=100.0, help="link rate, each direction (0: unshaped)"
    )
    parser.add_argument("--delay-ms", type=float, default=2.0, help="one-way delay")
    parser.add_argument("--steps", type=int, default=JOB["train"]["steps"])
    parser.add_argument("--log-every", type=int, default=16, help="steps per timed window")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--out", default=str(REPO / "bench" / "out" / "comm_strategies"))
    parser.add_argument(
        "--predict", action="store_true", help="next to each mode, `shardwise plan --link`'s step"
    )
    args = parser.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if BASELINE not in args.modes:
        args.modes.insert(0, BASELINE)  # every ratio is against plain DDP in the same run
    if args.repeats < 1 or args.mbit < 0 or args.delay_ms < 0:
        parser.error("--repeats must be ≥ 1, --mbit and --delay-ms ≥ 0")
    if args.log_every < 1 or args.steps < 2 * args.log_every or args.steps % args.log_every:
        parser.error("--steps must be a multiple of --log-every, at least two windows of it")
    periods = [int(s.split("=")[1]) for m in args.modes for s in MODES[m] if "sync_every=" in s]
    if any(args.log_every % period for period in periods):
        parser.error(f"--log-every must be a multiple of every mode's sync_every ({periods})")
    return args


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise SystemExit("comm_strategies: needs root (it builds network namespaces); run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"comm_strategies: needs `{tool}` (iproute2) on PATH")


def write_job(path: Path, steps: int, log_every: int) -> Path:
    import tomli_w

    JOB["train"]["steps"] = steps
    JOB["tracking"]["log_every"] = log_every
    JOB["eval"]["every_steps"] = log_every
    path.write_text(tomli_w.dumps(JOB))
    return path


def measure_link(nodes: tuple[Any, Any], mbit: float, delay_ms: float) -> dict[str, Any]:
    """What the link carries: bulk TCP each way (about 1 s of data at the shaped rate) and a
    64-byte TCP ping."""
    from netns import measure_rtt, measure_transfer

    a, b = nodes
    nbytes = int(mbit * 1e6 / 8) if mbit else 200_000_000
    forward = measure_transfer(a, b, nbytes)
    backward = measure_transfer(b, a, nbytes)
    rtt_ms = measure_rtt(a, b)
    shaping = ([f"{mbit:g} Mbit/s"] if mbit else []) + ([f"{delay_ms:g} ms"] if delay_ms else [])
    shaped = f"shaped to {' and '.join(shaping)} one way" if shaping else "unshaped"
    print(
        f"link: {shaped}: measured {forward[1]:.1f} Mbit/s a→b, {backward[1]:.1f} Mbit/s b→a "
        f"({nbytes / 1e6:.1f} MB each), RTT {rtt_ms:.2f} ms (64-byte TCP ping, median of 20)"
    )
    return {
        "mbit": mbit,
        "delay_ms": delay_ms,
        "measured_mbit": [forward[1], backward[1]],
        "rtt_ms": rtt_ms,
        "interfaces": [node.interface for node in nodes],
        "kind": "tun pair and delay line" if delay_ms else "veth pair",
    }


def queue_counters(nodes: tuple[Any, Any]) -> dict[str, dict[str, int]]:
    from netns import queue_stats

    return {node.namespace: queue_stats(node) for node in nodes}


def predict(job: Path, modes: dict[str, list[str]], link: dict[str, Any]) -> dict[str, Any]:
    """Per mode, the planner's step time and bytes for its job on this link: the row of
    `shardwise plan --link --json` for the job's own mode; a line saying why where there is none
    (no calibrated profile, a mode the planner does not model, a plan that failed)."""
    from dataclasses import asdict

    import tomli_w

    from shardwise.common.errors import ConfigError
    from shardwise.training.config.load import load_config

    try:
        hardware = shared_profile()
    except ConfigError as e:
        print(f"predicted: none: {e}")
        return {}
    measured = link["measured_mbit"]
    gbps = (min(measured) if measured else link["mbit"]) / 1e3
    network = f"{gbps:.6g},{link['delay_ms']:g}"
    print(f"predicted: shardwise plan --link {network} --hardware {hardware.name} (scaled)")
    predicted: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "hardware.json"
        profile.write_text(json.dumps(asdict(hardware)))
        for name, overrides in modes.items():
            try:
                config = load_config(job, overrides)
            except ConfigError as e:
                predicted[name] = f"bad config: {e}"
                continue
            mode_job = Path(tmp) / f"{name}.toml"
            mode_job.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
            command = [str(BIN / "shardwise"), "plan", str(mode_job), "--json", "--top", "1"]
            command += ["--nproc", str(NPROC * NNODES), "--hardware", str(profile)]
            command += ["--link", network]
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
            predicted[name] = planned_mode(done)
    return predicted


def shared_profile() -> Any:
    """This machine's calibrated profile with each rank's share of the cores: its per-core
    rates (matrix multiplies, memory, the codecs) times cores / ranks, and its times (PowerSGD's
    per matrix) divided by it, since the two nodes' ranks share this machine's cores."""
    from dataclasses import replace

    from shardwise.plan.hardware import THIS_MACHINE, lookup

    profile = lookup(THIS_MACHINE)
    share = min(1.0, len(os.sched_getaffinity(0)) / (NPROC * NNODES))
    half, int8 = profile.half_codec_rate, profile.int8_codec_rate
    powersgd, matrix = profile.powersgd_codec_rate, profile.powersgd_matrix_seconds
    return replace(
        profile,
        name=f"{THIS_MACHINE}-shared",
        peak_flops=profile.peak_flops * share,
        memory_bandwidth=profile.memory_bandwidth * share,
        half_codec_rate=half and half * share,
        int8_codec_rate=int8 and int8 * share,
        powersgd_codec_rate=powersgd and powersgd * share,
        powersgd_matrix_seconds=matrix and matrix / share,
        gpus_per_node=NPROC,
    )


def planned_mode(done: subprocess.CompletedProcess[str]) -> dict[str, Any] | str:
    """The planner's row for the job's own mode, from `shardwise plan … --json`."""
    try:
        plan = json.loads(done.stdout)
        rows = plan["job_layout"]["comm_modes"]["modes"]
    except (ValueError, KeyError, TypeError):
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"plan failed: {lines[-1] if lines else done.returncode}"
    if plan["job_mode"] is None:
        return "a mode the planner does not model"
    row = next(r for r in rows if r["mode"] == plan["job_mode"])
    if row["why_not"]:
        return f"{plan['job_mode']}: {row['why_not']}"
    return {
        "planner_mode": plan["job_mode"],
        "step_s": row["step_seconds"],
        "bytes_per_step": row["bytes_per_step"],
        "inter_node_bytes_per_step": row["inter_node_bytes_per_step"],
    }


def run_all(
    nodes: tuple[Any, Any],
    job: Path,
    modes: dict[str, list[str]],
    args: argparse.Namespace,
    runs_dir: Path,
) -> dict[str, list[dict[str, Any]]]:
    """Every mode once per repeat, interleaved."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    for repeat in range(args.repeats):
        for name, overrides in modes.items():
            keep = runs_dir / f"{name}-{repeat}"
            result = train_once(nodes, job, overrides, keep, args.log_every, args.run_timeout)
            runs[name].append(result)
            if "error" in result:
                print(f"  repeat {repeat + 1}: {name:<13} failed: {result['error']}", flush=True)
                continue
            shown = f"{result['step_s'] * 1e3:8.1f} ms/step"
            shown += f", eval loss {result['eval_loss']:.4f}" if result["eval_loss"] else ""
            shown += f", start-up {result['startup_s']:.1f} s, {result['wall_s']:.0f} s in all"
            print(f"  repeat {repeat + 1}: {name:<13} {shown}", flush=True)
    return runs


def train_once(
    nodes: tuple[Any, Any],
    job: Path,
    overrides: list[str],
    keep: Path,
    log_every: int,
    timeout: float,
) -> dict[str, Any]:
    """One two-node run of `job` with `overrides`; its metrics and both nodes' output are kept in
    `keep`, everything else (checkpoints) is deleted."""
    if keep.exists():
        shutil.rmtree(keep)
    keep.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=keep.parent) as tmp:
        run_dir = Path(tmp) / "run"
        sets = [arg for s in [*overrides, f"job.run_dir={run_dir}"] for arg in ("--set", s)]
        endpoint = f"{nodes[0].addr}:{nodes[0].free_port()}"  # the rendezvous, on node a
        began = time.time()
        with contextlib.ExitStack() as logs:
            started = []
            for node in nodes:
                log = logs.enter_context((keep / f"{node.namespace[-1]}.log").open("w"))
                started.append(start_node(node, job, endpoint, sets, log))
            timed_out = wait_all(started, began + timeout)
        wall = time.time() - began
        for node in nodes:  # anything a failed or overrun run left behind
            node.kill_everything()
        if (run_dir / "metrics.jsonl").exists():
            shutil.copy(run_dir / "metrics.jsonl", keep / "metrics.jsonl")
    codes = [p.returncode for p in started]
    if timed_out or any(codes):
        why = f"overran {timeout:.0f} s" if timed_out else f"exit codes {codes}"
        return {"error": f"{why}; {last_error(keep)}", "wall_s": wall}
    try:
        return {**read_run(keep / "metrics.jsonl", log_every, began), "wall_s": wall}
    except (OSError, ValueError, KeyError) as e:
        return {"error": f"unreadable metrics: {e}", "wall_s": wall}


def start_node(
    node: Any, job: Path, endpoint: str, sets: list[str], log: IO[str]
) -> subprocess.Popen[bytes]:
    """`shardwise train` on `node` as on a machine of a two-node job: its own agent and ranks,
    gloo on the link's interface."""
    command = node.command(
        *("env", f"GLOO_SOCKET_IFNAME={node.interface}", str(BIN / "shardwise"), "train"),
        *(str(job), "--nproc", str(NPROC), "--nnodes", str(NNODES)),
        *("--rdzv-endpoint", endpoint, "--local-addr", node.addr, *sets),
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )


def wait_all(processes: list[subprocess.Popen[bytes]], deadline: float) -> bool:
    """Wait for every process until `deadline` (wall clock); kill those left. Whether any was."""
    overran = False
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            overran = True
            process.kill()
            process.wait()
    return overran


def last_error(keep: Path) -> str:
    """The last error either node printed: shardwise's one-line error or a Python exception."""
    error = re.compile(r"^(shardwise: error|[\w.]*(Error|Exception|Failed):)")
    for log in sorted(keep.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        errors = [line.strip() for line in lines if error.match(line.strip())]
        if errors:
            return f"{log.name}: {errors[-1][:300]}"
    return "no error printed (see the runs' logs)"


def read_run(metrics: Path, log_every: int, began: float) -> dict[str, Any]:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    start = next(r["time"] for r in records if r.get("event") == "start")
    windows = [r for r in records if "samples/s" in r and r["step"] > log_every]
    if not windows:
        raise ValueError("no steady-state window logged")
    step_s = JOB["train"]["global_batch"] / statistics.median(r["samples/s"] for r in windows)
    sent = [r["comm/bytes_per_step"] for r in windows if "comm/bytes_per_step" in r]
    inter = [
        r["comm/inter_node_bytes_per_step"]
        for r in windows
        if "comm/inter_node_bytes_per_step" in r
    ]
    evals = [r for r in records if "eval/loss" in r]
    return {
        "step_s": step_s,
        "window_step_s": [JOB["train"]["global_batch"] / r["samples/s"] for r in windows],
        "bytes_per_step": statistics.median(sent) if sent else None,
        "inter_node_bytes_per_step": statistics.median(inter) if inter else None,
        "eval_loss": evals[-1]["eval/loss"] if evals else None,
        "startup_s": start - began,
        "train_curve": [(r["time"] - start, r["loss"]) for r in records if "loss" in r],
        "eval_curve": [(r["time"] - start, r["eval/loss"]) for r in evals],
    }


def summarize(runs: dict[str, list[dict[str, Any]]], modes: dict[str, list[str]]) -> dict[str, Any]:
    """Per mode: medians and spreads, and ratios against ddp taken within each repeat."""
    base = runs[BASELINE]
    summary: dict[str, Any] = {}
    for name in modes:
        done = [r for r in runs[name] if "error" in r]
        ok = [r for r in runs[name] if "error" not in r]
        row: dict[str, Any] = {"runs": len(ok), "failures": [r["error"] for r in done]}
        if ok:
            steps = [r["step_s"] for r in ok]
            row |= {"step_s": statistics.median(steps), "step_spread": [min(steps), max(steps)]}
            row["startup_s"] = statistics.median(r["startup_s"] for r in ok)
            row["bytes_per_step"] = median_of([r["bytes_per_step"] for r in ok])
            row["eval_loss"] = median_of([r["eval_loss"] for r in ok])
            pairs = [
                (m, b)
                for m, b in zip(runs[name], base, strict=True)
                if "error" not in m and "error" not in b
            ]
            row["speed_vs_ddp"] = median_of([b["step_s"] / m["step_s"] for m, b in pairs])
            row["bytes_vs_ddp"] = median_of(
                [ratio(m["bytes_per_step"], b["bytes_per_step"]) for m, b in pairs]
            )
            row["loss_vs_ddp_pct"] = median_of(
                [pct(m["eval_loss"], b["eval_loss"]) for m, b in pairs]
            )
        summary[name] = row
    return summary


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def pct(a: float | None, b: float | None) -> float | None:
    return (a / b - 1) * 100 if a is not None and b else None


def median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def print_table(summary: dict[str, Any]) -> None:
    def fmt(value: float | None, spec: str, suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    head = (
        f"{'mode':<13} {'step (median, spread)':>26} {'speed':>7} {'bytes/step':>11} {'bytes':>7}"
    )
    head += f" {'eval loss':>9} {'loss':>8} {'start-up':>8}"
    print(f"\nagainst {BASELINE}: speed = its step time / the mode's (> 1: faster);")
    print("bytes and loss = the mode's / its (loss: held-out, after the last step)")
    print(head)
    for name, row in summary.items():
        if not row["runs"]:
            print(f"{name:<13} failed: {row['failures'][0]}")
            continue
        low, high = (s * 1e3 for s in row["step_spread"])
        step = f"{row['step_s'] * 1e3:.1f} ms ({low:.0f}-{high:.0f})"
        bytes_ = fmt(row["bytes_per_step"] and row["bytes_per_step"] / 1e6, ".2f", " MB")
        line = f"{name:<13} {step:>26} {fmt(row['speed_vs_ddp'], '.2f', '×'):>7} {bytes_:>11}"
        line += f" {fmt(row['bytes_vs_ddp'], '.3f'):>7} {fmt(row['eval_loss'], '.4f'):>9}"
        line += f" {fmt(row['loss_vs_ddp_pct'], '+.1f', '%'):>8} {row['startup_s']:>7.1f}s"
        if row["failures"]:
            line += f"  ({len(row['failures'])} failed: {row['failures'][0]})"
        print(line)


def print_predictions(summary: dict[str, Any], predicted: dict[str, Any]) -> None:
    """Predicted against measured step time and bytes per mode, and how many are within ±25%."""
    print("\npredicted by `shardwise plan --link` (the planner's row for the job's own mode):")
    print(
        f"{'mode':<13} {'planner mode':<28} {'predicted':>10} {'measured':>10} {'ratio':>6} "
        f"{'bytes pred.':>11} {'measured':>10}"
    )
    close = []
    for name, guess in predicted.items():
        row = summary.get(name, {})
        if isinstance(guess, str):
            print(f"{name:<13} {guess[:90]}")
            continue
        step = row.get("step_s")
        ratio = guess["step_s"] / step if step else None
        if ratio is not None:
            close.append(abs(ratio - 1) <= 0.25)
        measured = "-" if step is None else f"{step * 1e3:.0f} ms"
        shown = "-" if ratio is None else f"{ratio:.2f}"
        sent = row.get("bytes_per_step")
        sent_shown = "-" if sent is None else f"{sent / 1e6:.2f} MB"
        print(
            f"{name:<13} {guess['planner_mode']:<28} {guess['step_s'] * 1e3:>7.0f} ms "
            f"{measured:>10} {shown:>6} {guess['bytes_per_step'] / 1e6:>8.2f} MB {sent_shown:>10}"
        )
    print(f"ratio = predicted / measured step time; {sum(close)} of {len(close)} within ±25%")


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (name, results) in enumerate(runs.items()):
        colour = f"C{index % 10}"
        for repeat, result in enumerate(r for r in results if "error" not in r):
            label = name if repeat == 0 else None
            for ax, key in ((train_ax, "train_curve"), (eval_ax, "eval_curve")):
                if result[key]:
                    x, y = zip(*result[key], strict=True)
                    ax.plot(x, y, color=colour, alpha=0.8, marker=".", label=label)
    for ax, what in ((train_ax, "training loss (window mean)"), (eval_ax, "held-out loss")):
        ax.set_xlabel("wall time since the trainer started (s)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    train_ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
