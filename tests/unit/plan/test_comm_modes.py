"""`shardwise plan --link`: the data-parallel communication modes of comm/ on a network between
nodes: their bytes against the formulas comm/ sends by, the step time's response to the link and
to compression, and the flag's parsing."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import tomli_w

from shardwise.cli import main
from shardwise.plan.comm_modes import (
    CODEC_PASSES,
    SYNC_PASSES,
    Mode,
    ModeCost,
    Tensors,
    compare,
    job_mode,
    transformer_tensors,
)
from shardwise.plan.hardware import PRESETS, Hardware
from shardwise.plan.layout import PRECISIONS, Layout
from shardwise.plan.model import Transformer
from shardwise.plan.network import Network, parse_link
from shardwise.plan.search import Constraints, explain, search
from shardwise.plan.timing import node_links, step_time

FP32 = PRECISIONS["fp32"]
MODEL = Transformer(layers=4, hidden=192, heads=4, vocab=256, seq=64, tied_embeddings=False)
CPU = Hardware(
    name="cpu", memory=8 * 2**30, peak_flops=50e9, memory_bandwidth=10e9,
    intra_bandwidth=1e9, intra_latency=1e-4, inter_bandwidth=1e9, inter_latency=1e-4,
    gpus_per_node=2, utilisation=0.8, overlap=0.0, calibrated=True,
)  # fmt: skip
"""A calibrated-like CPU profile: 2 cores per machine, gloo's rings, nothing overlapped."""
DP4 = Layout(dp=4, micro_batch=4, microbatches=1)  # 2 nodes × 2 ranks on CPU


def costs(
    network: Network,
    layout: Layout = DP4,
    hardware: Hardware = CPU,
    job: Mode | None = None,
    model: Transformer = MODEL,
) -> dict[str, ModeCost]:
    linked = network.apply(hardware)
    time = step_time(model, layout, FP32, linked)
    found = compare(model, layout, FP32, linked, time, job=job)
    return {c.mode.name(): c for c in found.costs}


SLOW = Network(0.1, 2.0)  # the bench's link: 100 Mbit/s, 2 ms one way


def test_ddp_sends_a_rings_share_of_the_fp32_gradients_and_bf16_exactly_half():
    by = costs(SLOW)
    grads = MODEL.params * 4
    ring = 2 * (4 - 1) / 4 * grads
    assert by["ddp"].sent == pytest.approx(ring, rel=1e-12)
    assert by["ddp"].across == pytest.approx(ring, rel=1e-12)  # one ring hop out of each node
    assert by["bf16"].sent == by["ddp"].sent / 2
    assert by["bf16"].across == by["ddp"].across / 2


def test_int8_sends_a_quarter_plus_one_fp32_scale_per_chunk_of_each_tensor():
    by = costs(SLOW)
    tensors = transformer_tensors(MODEL)
    n, count = 4, len(tensors.shapes)
    padded = sum(n * math.ceil(math.prod(s) / n) for s in tensors.shapes)
    scale = MODEL.params / tensors.elements  # the formula's count for the built GPT's tensors
    payload = padded * scale + 4 * n * count  # int8 values, fp32 scales
    # an all-to-all and an all-gather, (n − 1)/n of the payload each (comm/compression.py)
    assert by["int8"].sent == pytest.approx(2 * (n - 1) / n * payload, rel=1e-12)
    assert by["int8"].sent / by["ddp"].sent == pytest.approx(1 / 4, rel=0.01)
    # across nodes the all-to-all carries k(n−k)/n of the payload, the all-gather's ring (n−1)/n
    assert by["int8"].across == pytest.approx((2 * 2 / 4 + 3 / 4) * payload, rel=1e-12)


def test_powersgd_sends_r_times_rows_plus_columns_per_matrix_and_vectors_whole():
    shapes = ((6, 4), (3, 2), (5,), (8, 2, 3))
    p, q, plain = Tensors(shapes).powersgd(2)
    # (6, 4): 2·(6 + 4) = 20 ≤ 24; (3, 2): 2·5 = 10 > 6 stays whole; (8, 2·3): 2·(8 + 6) = 28
    assert (p, q, plain) == (2 * 6 + 2 * 8, 2 * 4 + 2 * 6, 6 + 5)
    for rank in (1, 2, 4):
        by = costs(SLOW, job=Mode("powersgd", powersgd_rank=rank))
        tensors = transformer_tensors(MODEL)
        numbers = 0
        for shape in tensors.shapes:
            rows, cols = shape[0], math.prod(shape[1:])
            r = min(rank, rows, cols)
            whole = len(shape) < 2 or r * (rows + cols) > rows * cols
            numbers += rows * cols if whole else r * (rows + cols)
        expected = 2 * 3 / 4 * numbers * 4 * MODEL.params / tensors.elements
        assert by[f"powersgd r={rank}"].sent == pytest.approx(expected, rel=1e-12)


def test_the_standard_tensors_are_the_built_in_gpts():
    """Megatron's count (model.py) and the built-in GPT's final norm."""
    assert transformer_tensors(MODEL).elements == MODEL.params + 2 * MODEL.hidden


@pytest.mark.parametrize("every", [1, 4, 16, 64])
def test_local_sgd_and_diloco_send_the_parameters_once_every_h_steps(every):
    by = costs(SLOW, job=Mode(sync="local_sgd", sync_every=every))
    params = MODEL.params * 4
    assert by[f"local_sgd H={every}"].sent == pytest.approx(2 * 3 / 4 * params / every)
    ddp = by["ddp"]  # fp32 gradients are as large as fp32 parameters
    assert by[f"local_sgd H={every}"].sent == pytest.approx(ddp.sent / every, rel=1e-12)
    assert by[f"local_sgd H={every}"].comm == pytest.approx(ddp.comm / every, rel=1e-12)
    assert by[f"diloco H={every}"].sent == by[f"local_sgd H={every}"].sent
    assert by[f"diloco H={every} + bf16"].sent == by[f"diloco H={every}"].sent / 2


def test_hierarchical_sends_one_copy_per_node_across_and_rank_0_broadcasts_it():
    """8 ranks, 4 per node: the leaders' ring of N = 2 carries 2(N−1)/N·S across, where the
    flat ring carries 2(n−1)/n·S; rank 0, a leader, also broadcasts S inside its node."""
    layout = Layout(dp=8, micro_batch=1, microbatches=1)
    by = costs(SLOW, layout, replace(CPU, gpus_per_node=4))
    grads = MODEL.params * 4
    assert by["ddp"].across == pytest.approx(2 * 7 / 8 * grads)
    assert by["hierarchical"].across == pytest.approx(2 * 1 / 2 * grads)
    assert by["hierarchical"].sent == pytest.approx(grads + grads)
    assert by["hierarchical + bf16"].across == pytest.approx(grads / 2)  # compressed across
    assert by["hierarchical + bf16"].sent == pytest.approx(grads / 2 + grads)  # not inside
    assert by["hierarchical"].step < by["ddp"].step  # the slow link carries 1.75× less


def test_a_slower_link_makes_every_mode_slower_and_compression_faster_than_ddp():
    links = [Network(gbps, 2.0) for gbps in (10, 1, 0.1, 0.01)]
    steps = [costs(link)["ddp"].step for link in links]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    for name in ("bf16", "int8", "powersgd r=2", "hierarchical", "local_sgd H=16"):
        by_link = [costs(link)[name].step for link in links]
        assert by_link == sorted(by_link), name
    by = costs(Network(0.1, 2.0))
    for name in ("bf16", "int8", "powersgd r=2", "hierarchical + bf16", "local_sgd H=16"):
        assert by[name].step < by["ddp"].step, name
    assert by["bf16"].step < by["ddp"].step < 2 * by["bf16"].step  # half the bytes, not less
    latency = [costs(Network(0.1, ms))["ddp"].step for ms in (0, 1, 10, 100)]
    assert latency == sorted(latency) and len(set(latency)) == 4


def test_ddp_is_the_layouts_own_step_and_every_steps_traffic_overlaps_alike():
    """ddp is timing.py's step; every every-step mode's collectives hide behind backward as far
    as the hardware lets them (none on a calibrated CPU), a codec's work never does."""
    gpu = replace(PRESETS["h100"], gpus_per_node=2)
    for hardware in (CPU, gpu):
        linked = SLOW.apply(hardware)
        time = step_time(MODEL, DP4, FP32, linked)
        by = costs(SLOW, hardware=hardware)
        assert by["ddp"].step == pytest.approx(time.total, rel=1e-12)
        assert by["ddp"].step - by["ddp"].exposed == pytest.approx(time.total - time.exposed)
    cpu = costs(SLOW)
    for name in ("ddp", "hierarchical", "powersgd r=2"):
        assert cpu[name].exposed >= cpu[name].comm, name  # nothing hides on a calibrated CPU
    big = replace(MODEL, layers=48, hidden=1024, heads=8)
    by = costs(Network(400, 0.01), hardware=gpu, model=big)
    window = 2 / 3 * step_time(big, DP4, FP32, Network(400, 0.01).apply(gpu)).compute
    grads = big.params * 4
    assert by["ddp"].exposed == pytest.approx(max(0.0, by["ddp"].comm - window))
    assert by["hierarchical"].exposed == pytest.approx(max(0.0, by["hierarchical"].comm - window))
    codec = CODEC_PASSES["bf16"] * grads / gpu.memory_bandwidth
    assert by["bf16"].exposed == pytest.approx(max(0.0, by["bf16"].comm - window) + codec)
    local = by["local_sgd H=16"]
    assert local.exposed > local.comm  # after the optimizer step, and its own passes


def test_a_codec_costs_its_measured_rate_where_calibrated_else_its_passes():
    grads = MODEL.params * 4
    passes = costs(SLOW)
    assert passes["bf16"].exposed - passes["bf16"].comm == pytest.approx(
        CODEC_PASSES["bf16"] * grads / CPU.memory_bandwidth
    )
    measured = costs(SLOW, hardware=replace(CPU, half_codec_rate=1e8, int8_codec_rate=2e7))
    assert measured["bf16"].exposed - measured["bf16"].comm == pytest.approx(grads / 1e8)
    assert measured["int8"].exposed - measured["int8"].comm == pytest.approx(grads / 2e7)
    assert measured["hierarchical + int8"].exposed > measured["hierarchical + int8"].comm
    # DiLoCo's outer int8 every H steps: its codec's work amortised like its traffic
    diloco = measured["diloco H=16 + int8"]
    assert diloco.exposed - diloco.comm == pytest.approx(
        (SYNC_PASSES["diloco"] * grads / CPU.memory_bandwidth + grads / 2e7) / 16
    )


def test_ddp_buckets_hold_1_mib_then_25_mib_from_the_last_tensor_back():
    tensors = Tensors(((1024, 1024), (1000,), (512, 512), (64,), (2048, 4096), (8,)))
    buckets = tensors.buckets(4)
    assert [b.shapes for b in buckets] == [
        ((8,), (2048, 4096)),  # reached 1 MiB
        ((64,), (512, 512), (1000,), (1024, 1024)),  # the rest: under 25 MiB
    ]
    assert sum(b.elements for b in buckets) == tensors.elements
    assert len(transformer_tensors(MODEL).buckets(4)) == 2  # 7.6 MB of fp32 gradients


def test_every_bucket_runs_the_modes_collectives_and_pays_their_latency():
    """On a link of (nearly) unlimited bandwidth a hooked mode's time is its latencies: one
    all-reduce per bucket for bf16, three for PowerSGD (P, Q and the uncompressed rest)."""
    fast, wide = Network(1e8, 5.0), replace(CPU, intra_bandwidth=1e16)
    ring = 2 * (4 - 1) * fast.apply(wide).inter_latency  # a ring all-reduce's messages
    for buckets, model in ((2, MODEL), (3, replace(MODEL, layers=16))):
        assert len(transformer_tensors(model).buckets(4)) == buckets
        by = costs(fast, hardware=wide, model=model, job=Mode("powersgd", powersgd_rank=4))
        assert by["bf16"].comm == pytest.approx(buckets * ring, rel=0.01)
        assert by["powersgd r=4"].comm == pytest.approx(3 * buckets * ring, rel=0.01)


def test_powersgd_costs_its_calibrated_rate_and_time_per_matrix():
    measured = replace(CPU, powersgd_codec_rate=5e8, powersgd_matrix_seconds=1e-4)
    tensors = transformer_tensors(MODEL)
    for rank in (2, 4, 8):
        by = costs(SLOW, hardware=measured, job=Mode("powersgd", powersgd_rank=rank))
        cost = by[f"powersgd r={rank}"]
        matrices = (tensors.elements - tensors.powersgd(rank)[2]) * MODEL.params
        flops = 6 * (rank - 4) * matrices / tensors.elements / (CPU.peak_flops * CPU.utilisation)
        work = MODEL.params * 4 / 5e8 + tensors.compressed(rank) * 1e-4 + flops
        assert cost.exposed - cost.comm == pytest.approx(work, rel=1e-9)
    assert tensors.compressed(4) == 4 * 6 + 3  # q, k, v, projection and the MLP's two; embeddings


def test_async_rank_0_serves_the_parameters_and_the_slower_side_paces_the_step():
    by = costs(SLOW, job=Mode(sync="async", max_staleness=3))
    params = MODEL.params * 4
    served = by["async k=3"]
    assert served.sent == pytest.approx(3 * params)  # to each other worker
    assert served.across == pytest.approx(2 * params)  # the other node's two, each way
    linked = SLOW.apply(CPU)
    far = linked.inter_latency + params / linked.inter_bandwidth
    near = linked.intra_latency + params / linked.intra_bandwidth
    rest = by["ddp"].step - by["ddp"].exposed
    assert served.step == pytest.approx(max(rest + 2 * far, 2 * far + near))
    zero = costs(SLOW, job=Mode(sync="async", max_staleness=0))["async k=0"]
    assert zero.step == pytest.approx(rest + 2 * far + near + far)  # waits for the last push
    assert served.step > by["ddp"].step  # more bytes than a ring, on this balanced job
    zero3 = costs(SLOW, Layout(dp=4, zero=3, micro_batch=4, microbatches=1))
    assert "plain data parallelism" in zero3["async k=4"].why_not


def test_modes_that_do_not_apply_say_why():
    zero3 = Layout(dp=4, zero=3, micro_batch=4, microbatches=1)
    by = costs(SLOW, zero3)
    assert by["ddp"].applies and by["bf16"].applies  # FSDP2's reduce-scatter precision
    assert by["bf16"].sent < by["ddp"].sent
    assert "FSDP2" in by["int8"].why_not and "FSDP2" in by["hierarchical"].why_not
    assert "ZeRO 0" in by["local_sgd H=16"].why_not
    one_node = costs(SLOW, hardware=replace(CPU, gpus_per_node=4))
    assert one_node["hierarchical"].why_not == "the data-parallel ranks share one node"
    assert one_node["ddp"].across == 0
    alone = costs(SLOW, Layout(dp=1, micro_batch=16))
    assert not any(c.applies for c in alone.values())


def test_a_jobs_own_mode_is_listed_once_by_what_tells_it_apart():
    linked = SLOW.apply(CPU)
    time = step_time(MODEL, DP4, FP32, linked)
    plain = compare(MODEL, DP4, FP32, linked, time, job=Mode(sync_every=8, powersgd_rank=4))
    names = [c.mode.name() for c in plain.costs]
    assert len(names) == len(set(names)) == 13
    assert "local_sgd H=8" in names and "powersgd r=4" in names  # the job's settings
    assert plain.baseline.step == pytest.approx(time.total, rel=1e-12)
    fp16 = compare(MODEL, DP4, FP32, linked, time, job=Mode("fp16", hierarchical=True))
    assert fp16.costs[-1].mode.name() == "hierarchical + fp16"
    by = {c.mode.name(): c for c in fp16.costs}
    assert by["hierarchical + fp16"].sent == by["hierarchical + bf16"].sent


def test_a_jobs_auto_hierarchical_is_on_where_its_ranks_span_nodes():
    auto = Mode("bf16")
    assert job_mode(auto, auto=True, layout=DP4, hardware=CPU).hierarchical
    one_node = replace(CPU, gpus_per_node=4)
    assert not job_mode(auto, auto=True, layout=DP4, hardware=one_node).hierarchical
    one_each = replace(CPU, gpus_per_node=1)
    assert not job_mode(auto, auto=True, layout=DP4, hardware=one_each).hierarchical
    assert not job_mode(auto, auto=False, layout=DP4, hardware=CPU).hierarchical


def test_the_link_is_the_networks_rate_and_adds_its_latency_to_the_librarys():
    linked = Network(0.1, 2.0).apply(CPU)
    assert linked.inter_bandwidth == 0.1e9 / 8
    assert linked.inter_latency == pytest.approx(CPU.intra_latency + 2e-3)
    assert Network(0.1).apply(CPU).inter_latency == CPU.inter_latency
    assert Network(1e5).apply(CPU).inter_bandwidth == CPU.intra_bandwidth  # the node's limit
    measured = replace(CPU, all_gather_bandwidth=2e9, all_gather_latency=5e-5)
    assert node_links(measured)[1].gather == node_links(measured)[0].gather  # same machine
    slow_gather = node_links(Network(0.1, 2.0).apply(measured))[1].gather
    assert slow_gather is not None and slow_gather.bandwidth == 0.1e9 / 8
    assert slow_gather.latency == pytest.approx(CPU.intra_latency + 2e-3)


def test_the_link_slows_the_layouts_that_cross_nodes_in_the_ranking():
    plans = [
        search(MODEL, link.apply(CPU), FP32, devices=4, global_batch=16).evaluate(DP4)
        for link in (Network(10), Network(0.1))
    ]
    assert plans[1].time.total > plans[0].time.total
    piped = search(
        MODEL, SLOW.apply(CPU), FP32, devices=4, global_batch=16, fixed=Constraints(pp=2, dp=2)
    )
    assert piped.best is not None and piped.best.time.dominant() == "pipeline comm"
    assert "fewer stages, or stages whose ranks share a node" in explain(piped)[1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("100", Network(100)), ("0.1,2", Network(0.1, 2.0)), (" 25 , 0 ", Network(25, 0.0))],
)
def test_link_reads_gbps_and_an_optional_latency(text, expected):
    assert parse_link(text) == expected


def refused(capsys, args: list[str]) -> str:
    assert main(["plan", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("shardwise: error: ") and err.count("\n") == 1, err
    return err.removeprefix("shardwise: error: ").rstrip("\n")


BASE = ["--params", "1e8", "--gpus", "16", "--gpus-per-node", "8", "--hardware", "h100"]


@pytest.mark.parametrize(
    "value",
    ["abc", "0", "-1", "nan", "inf", "-inf", "1e400", "", ",", "1,", ",2", "1,2,3", "1,-1",
     "1,nan", "1,inf", "1;2", "0x10", "1,2ms", "2e6", "1,1e9"],
)  # fmt: skip
def test_a_bad_link_is_one_line_naming_the_flag_and_what_it_takes(capsys, value):
    line = refused(capsys, [*BASE, f"--link={value}"])
    assert line.startswith("--link ") and ": must be a number above 0 and at most" in line
    assert "optionally followed by a comma and a number from 0 to 60,000" in line


def test_link_and_inter_gbs_are_one_or_the_other(capsys):
    line = refused(capsys, [*BASE, "--link", "100", "--inter-gbs", "12"])
    assert line.startswith("--link and --inter-gbs both set the network between nodes")


def test_the_report_compares_every_mode_on_the_chosen_layout(capsys):
    args = [*BASE, "--dp", "16", "--zero", "0", "--precision", "fp32", "--link", "100,0.01"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "fastest sync (--link)" in out
    assert "data-parallel communication of the fastest layout, dp16" in out
    assert "16 ranks on 2 node(s) × 8" in out and "100 Gbit/s each direction, 0.01 ms" in out
    for name in ("ddp", "bf16", "int8", "powersgd r=2", "hierarchical + int8", "diloco H=16"):
        assert f"│ {name} " in out, name
    assert "overlap: every every-step mode's collectives hide behind backward" in out


def test_json_has_each_modes_bytes_and_times_with_ddp_as_the_layouts_step(capsys):
    args = [*BASE, "--zero", "0", "--tp", "1", "--pp", "1", "--link", "10,0.05", "--json"]
    assert main(["plan", *args, "--top", "3", "--precision", "bf16-autocast"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["link"]["gbps"] == 10 and plan["link"]["latency_ms"] == 0.05
    assert plan["link"]["bandwidth_bytes_per_s"] == 10e9 / 8
    for candidate in plan["ranked"]:
        found = candidate["comm_modes"]
        assert (found["nodes"], found["ranks_per_node"]) == (2, 8)
        rows = {r["mode"]: r for r in found["modes"]}
        assert rows["ddp"]["step_seconds"] == pytest.approx(candidate["step_seconds"])
        assert rows["ddp"]["step_vs_ddp"] == 1.0
        assert rows["bf16"]["bytes_vs_ddp"] == pytest.approx(0.5)  # of fp32 gradients
        assert rows["local_sgd H=16"]["bytes_per_step"] > 0
    assert plan["job_mode"] is None
    assert main(["plan", *args, "--top", "1", "--precision", "bf16"]) == 0
    rows = {
        r["mode"]: r
        for r in json.loads(capsys.readouterr().out)["ranked"][0]["comm_modes"]["modes"]
    }
    assert rows["bf16"]["bytes_vs_ddp"] == 1.0  # gradients already 16-bit


def test_a_jobs_own_mode_is_among_them_with_its_rank_and_period(tmp_path, repo_cwd, capsys):
    raw = {
        "job": {"name": "link", "run_dir": str(tmp_path / "run")},
        "model": {"name": "gpt", "args": {"layers": 2, "heads": 2, "hidden": 64, "seq_len": 32}},
        "data": {"name": "text", "args": {"seq_len": 32}},
        "train": {"steps": 10, "global_batch": 16, "micro_batch": 4, "precision": "fp32"},
        "parallel": {"grad_compression": "powersgd", "powersgd_rank": 4},
    }
    job = tmp_path / "job.toml"
    job.write_text(tomli_w.dumps(raw))
    args = [str(job), "--nproc", "4", "--gpus-per-node", "2", "--hardware", "l40s"]
    assert main(["plan", *args, "--link", "0.1,2", "--json", "--top", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["job_mode"] == "hierarchical + powersgd r=4"  # "auto": 2 nodes × 2 ranks
    rows = {r["mode"]: r for r in plan["job_layout"]["comm_modes"]["modes"]}
    assert rows["hierarchical + powersgd r=4"]["step_seconds"] < rows["ddp"]["step_seconds"]
    assert "local_sgd H=16" in rows
    assert main(["plan", *args, "--link", "0.1,2"]) == 0
    assert "hierarchical + powersgd r=4 (the job's)" in capsys.readouterr().out


def test_powersgd_time_per_matrix_is_never_zero_however_noisy_the_calibration():
    """A loaded machine made the line through two widths cross zero (the whole suite, issue 58's
    session: `powersgd_matrix_seconds` 0.0, and test_cli_plan failed); the smallest width then
    bounds it."""
    from shardwise.plan.calibrate import split_powersgd_costs

    clean = [
        (4_000_000, 12, 12e-4 + 4e6 / 1e9),
        (64_000, 12, 12e-4 + 64e3 / 1e9),
        (4_000, 12, 13e-4),
    ]
    rate, per_matrix = split_powersgd_costs(clean)
    assert rate == pytest.approx(1e9) and per_matrix == pytest.approx(1e-4)
    noisy = [(4_000_000, 12, 8e-3), (64_000, 12, 1e-4), (4_000, 12, 6e-4)]
    rate, per_matrix = split_powersgd_costs(noisy)
    assert 0 < rate < 1e18 and per_matrix == pytest.approx(6e-4 / 12)
