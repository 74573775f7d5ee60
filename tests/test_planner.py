"""The parallelism planner (docs/strategies/planner.md): memory, time and traffic terms on the meta device
and by hand, rejection reasons, and ``polytrain plan`` as a user runs it (the published Llama-3 layouts:
test_planner_published.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from polytrain.core.errors import ConfigError
from polytrain.parallel.hardware import Hardware
from polytrain.parallel.planner import Layout, Training, estimate, hardware, plan_module, profiler
from polytrain.parallel.planner import timing as T
from polytrain.parallel.planner.estimate import checkpointed, stage_memories
from polytrain.parallel.planner.model_profile import ChildProfile, ModelProfile

pytestmark = pytest.mark.torch_api

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))



def _gpt() -> torch.nn.Module:
    from gpt_module import CharGPT

    with torch.device("meta"):
        return CharGPT(d_model=128, n_head=4, n_layer=4, block_size=32)


def test_state_bytes_follow_each_axis() -> None:
    """Params + grads + AdamW state per rank: whole on one rank, 1/4 under dp_shard 4, planned layers
    1/2 under tp 2 (the rest whole), as benchmarks/composition_memory.py's ideal computes them."""
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    prof = profiler(module, x, x)
    total = sum(p.numel() for p in module.parameters())
    train = Training(global_batch=8, precision="32", optimizer="adamw")
    hw = hardware("cpu", 1, 8)

    def state(lay: Layout) -> int:
        m = estimate(lay, train, prof(lay.tp), hw).memory
        return m["params"] + m["optimizer"]

    assert state(Layout()) == 3 * 4 * total
    assert state(Layout(dp_shard=4)) == 3 * 4 * total // 4
    planned = sum(c.tp_params for c in prof(1).children)
    assert planned == sum(p.numel() for n, p in module.named_parameters() if ".attn." in n or ".mlp." in n)
    assert state(Layout(tp=2)) == 3 * 4 * (total - planned // 2)
    sgd = Training(global_batch=8, precision="bf16-true", optimizer="sgd")
    assert estimate(Layout(), sgd, prof(1), hw).memory["optimizer"] == 0
    assert estimate(Layout(), sgd, prof(1), hw).memory["params"] == 2 * total


def test_activation_checkpointing_keeps_block_inputs_only() -> None:
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    prof = profiler(module, x, x)(1)
    train = Training(global_batch=4, precision="32")
    hw = hardware("cpu", 1, 8)
    full = estimate(Layout(), train, prof, hw)
    ckpt = estimate(Layout(activation_checkpointing=True), train, prof, hw)
    assert ckpt.memory["activations"] < full.memory["activations"]
    assert ckpt.time["compute"] > full.time["compute"]  # the blocks' forward runs twice
    op = estimate(Layout(activation_checkpointing="op"), train, prof, hw)
    assert ckpt.memory["activations"] < op.memory["activations"] < full.memory["activations"]
    assert full.time["compute"] < op.time["compute"] < ckpt.time["compute"]
    # every: 2 (as the strategy counts: every 2nd of the repeated blocks, over the whole model)
    assert [c.kind for c in prof.children] == ["Embeddings", "Block", "Block", "Block", "Block", "LayerNorm",
                                               "Linear"]
    assert checkpointed(prof.children, 2) == [False, False, True, False, True, False, False]
    half = estimate(Layout(activation_checkpointing=True, checkpoint_every=2), train, prof, hw)
    assert ckpt.memory["activations"] < half.memory["activations"] < full.memory["activations"]
    assert half.layout.label() == "single +AC(every 2)"
    assert half.layout.checkpointing_config() == {"mode": "full", "every": 2}
    assert (ckpt.layout.checkpointing_config() is True
            and op.layout.checkpointing_config() == {"mode": "op", "every": 1})


def test_op_checkpointing_profile_replays_the_strategys_selection() -> None:
    """Per block of the GPT example (qkv, proj, fc, fc2: 4 Linear layers, one attention): per-op
    checkpointing keeps qkv's and fc's outputs and every output of the attention kernel, and
    recomputes proj and fc2 (their matmul FLOPs) and the cheap ops (no FLOPs counted)."""
    d, s = 128, 32
    block = next(c for c in profiler(_gpt(), torch.zeros(1, s, dtype=torch.long))(1).children
                 if c.kind == "Block")
    qkv, fc = s * 3 * d * 4, s * 4 * d * 4  # fp32 outputs of the kept matmuls
    attention = s * d * 4 + 4 * s * 4  # the output, and a float per head and position
    assert 0 <= block.op_kept_bytes - (qkv + fc + attention) <= 64  # + the flash kernel's RNG seed and offset
    proj, fc2 = 2 * s * d * d, 2 * s * 4 * d * d
    assert block.op_recompute_matmul_flops == block.op_recompute_flops == proj + fc2


def test_op_checkpointing_time_by_hand() -> None:
    """A per-op checkpointed child's backward adds what it recomputes: its recomputed FLOPs (matmuls at
    the fp8 rate under float8) and half its TP collectives under sequence parallelism (the all-gathers)."""
    c = ChildProfile(name="b", kind="Block", params=1000, tp_params=800, saved_bytes=0, input_bytes=0,
                     output_bytes=100, flops=4_000_000_000, tp_allreduce_bytes=200, sequence_parallel=True,
                     op_recompute_flops=1_000_000_000, op_recompute_matmul_flops=600_000_000)
    hw = Hardware(nodes=1, devices_per_node=8, memory_bytes=1, peak_flops=1e12, efficiency=0.5, intra_bw=1e9,
                  inter_bw=1e8, intra_latency=1e-5, inter_latency=1e-4, fp8_peak_flops=2e12)
    kw = dict(tp=2, fsdp=1, replicate=1, cp=1, param_bytes=2, master_bytes=4, hw=hw)
    plain = T.unit_times((c,), [False], 2, **kw)
    op = T.unit_times((c,), [True], 2, **kw, op_checkpointing=True)
    tf = plain.fwd[0] - 2 * 4e9 / 5e11
    assert op.bwd[0] - plain.bwd[0] == pytest.approx(2 * 1e9 / 5e11 + tf / 2)
    f8 = T.unit_times((c,), [True], 2, **kw, op_checkpointing=True, features=T.Features(float8=(True,)))
    f8_plain = T.unit_times((c,), [False], 2, **kw, features=T.Features(float8=(True,)))
    f8_tf = f8_plain.fwd[0] - 2 * (4e9 / 5e11)
    assert f8.bwd[0] - f8_plain.bwd[0] == pytest.approx(2 * (0.4e9 / 5e11 + 0.6e9 / 1e12) + f8_tf / 2)


def test_ring_bubble_and_in_flight_arithmetic() -> None:
    # 8 GB gathered over 4 ranks at 50 GB/s, 15 us a step: 3/4 of the bytes, 3 steps
    assert T.ring_time(8e9, 4, 50e9, 15e-6) == pytest.approx(8e9 * 3 / 4 / 50e9 + 3 * 15e-6)
    assert T.ring_time(8e9, 1, 50e9, 15e-6) == 0.0
    assert T.bubble_fraction(4, 8) == pytest.approx(3 / 11)  # 1F1B: (p-1)/(m+p-1)
    assert T.bubble_fraction(8, 8, 2) == pytest.approx(7 / 23)  # interleaved, v=2: (p-1)/(vm+p-1)
    assert T.in_flight(4, 8, 0, "1f1b", 1) == [4] and T.in_flight(4, 8, 3, "1f1b", 1) == [1]
    # interleaved p=4, m=8, v=2, rounds of 4: rank 0 runs min(1*4 + 2*3 + 1, 16) = 11 forwards before its
    # first backward, 4 on its first stage, 4 on its second, 3 more on its first; the last rank 4 + 1
    assert T.in_flight(4, 8, 0, "interleaved_1f1b", 2) == [7, 4]
    assert T.in_flight(4, 8, 3, "interleaved_1f1b", 2) == [4, 1]
    assert T.interleaved_rounds_ok(4, 10) and not T.interleaved_rounds_ok(4, 9)  # torch: m % (m // p) == 0


def test_unit_times_by_hand() -> None:
    """One child: 4 GFLOP forward a sample, 1000 parameters of which 800 split by TP, two row-parallel
    outputs of 100 bytes a sample (200 bytes all-reduced), on a made-up node of 8."""
    c = ChildProfile(name="b", kind="Block", params=1000, tp_params=800, saved_bytes=0, input_bytes=0,
                     output_bytes=100, flops=4_000_000_000, tp_allreduce_bytes=200)
    hw = Hardware(nodes=2, devices_per_node=8, memory_bytes=1, peak_flops=1e12, efficiency=0.5, intra_bw=1e9,
                  inter_bw=1e8, intra_latency=1e-5, inter_latency=1e-4)
    assert T.tp_collectives(c) == 2
    u = T.unit_times((c,), [False], 2, tp=2, fsdp=4, replicate=1, cp=1, param_bytes=2, master_bytes=4, hw=hw)
    f = 2 * 4e9 / 5e11
    t = 2 * 200 * 2 * (1 / 2) / 1e9 + 2 * 2 * 1 * 1e-5  # bytes x 2(t-1)/t / bw + 2 collectives x 2(t-1) steps
    assert (u.fwd[0] == pytest.approx(f + t) and u.bwd[0] == pytest.approx(2 * f + t)
            and u.tp == pytest.approx(2 * t))
    local = 800 / 2 + 200  # this rank's TP shard of the split part, all of the rest
    assert u.gather[0] == pytest.approx(local * 2 * 3 / 4 / 1e9 + 3 * 1e-5)  # tp x fsdp = 8: inside the node
    assert u.reduce[0] == pytest.approx(local * 4 * 3 / 4 / 1e9 + 3 * 1e-5)
    wide = T.unit_times((c,), [True], 2, tp=2, fsdp=8, replicate=1, cp=1, param_bytes=2, master_bytes=4,
                        hw=hw)
    assert wide.gather[0] == pytest.approx(local * 2 * 7 / 8 / 1e8 + 7 * 1e-4)  # 16 ranks: across nodes
    assert wide.bwd[0] == pytest.approx(3 * f + 2 * t)  # checkpointed: the forward and its collectives again


def test_ddp_pays_a_latency_per_bucket() -> None:
    mib = 1024**2  # units in forward order; backward fills the 1 MiB first bucket, then 25 MiB ones
    assert T.ddp_buckets([10 * mib, 30 * mib, mib / 2]) == [1, 2, 0]
    c = ChildProfile(name="b", kind="Block", params=1000, tp_params=0, saved_bytes=0, input_bytes=0,
                     output_bytes=100, flops=0, tp_allreduce_bytes=0)
    hw = hardware("cpu", 1, 8)
    u = T.unit_times((c, c), [False, False], 1, tp=1, fsdp=1, replicate=4, cp=1, param_bytes=4,
                     master_bytes=4, hw=hw, ddp=True)
    ring = 2 * 4000 * 3 / 4 / hw.intra_bw  # all-reduce bytes of one unit's 4000-byte gradient
    assert u.reduce == pytest.approx([ring + 2 * 3 * hw.intra_latency, ring])  # one bucket, closed at unit 0


def test_interleaved_ranks_hold_every_p_th_stage() -> None:
    from polytrain.parallel.planner.estimate import rank_chunks, stages

    prof = profiler(_gpt(), torch.zeros(1, 32, dtype=torch.long))(1)
    cuts = stages(prof, 4)
    assert rank_chunks(prof, 2, 2) == [[cuts[0], cuts[2]], [cuts[1], cuts[3]]]
    assert rank_chunks(prof, 2) == [[c] for c in stages(prof, 2)]


def test_pipeline_schedule_is_checked() -> None:
    with pytest.raises(ConfigError, match="1f1b runs one stage per rank"):
        Training(global_batch=8, pp_schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ConfigError, match="unknown to the planner"):
        Training(global_batch=8, pp_schedule="zbv")
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    train = Training(global_batch=16, precision="32", pp_schedule="interleaved_1f1b", stages_per_rank=2)
    plan = plan_module(module, x, hardware("cpu", 1, 8), train, target=x)
    assert any("x 2 stages per rank exceeds the" in r.reason
               for r in plan.rejected)  # 4 ranks x 2 > 7 children
    assert all(e.layout.pp * 2 <= 7 for e in plan.ranked)


def test_fsdp_gathers_hide_behind_the_neighbouring_unit_only() -> None:
    u = T.Units(fwd=[1.0, 1.0, 1.0], bwd=[2.0, 2.0, 2.0], gather=[0.5, 2.0, 0.5], reduce=[1.0, 1.0, 1.0])
    # forward: g0 + max(f0, g1) + max(f1, g2) + max(f2, 0) = 0.5 + 2 + 1 + 1
    assert T.forward_with_gathers(u) == pytest.approx(4.5)
    # backward: g2 + max(b2, g1) + max(b1, g0 + r2) + max(b0, r1) + r0 = 0.5 + 2 + 2 + 2 + 1
    assert T.backward_with_collectives(u) == pytest.approx(7.5)
    t = T.stage_time(u, pp=1, stage=0, n_microbatches=1, stages_per_rank=1, p2p=0.0)
    assert t["compute"] == pytest.approx(9.0) and t["dp"] == pytest.approx(4.5 + 7.5 - 9.0)


def test_pipeline_gathers_m_plus_one_times_and_reduces_once() -> None:
    u = T.Units(fwd=[1.0], bwd=[2.0], gather=[0.5], reduce=[1.0])
    t = T.stage_time(u, pp=2, stage=0, n_microbatches=4, stages_per_rank=1, p2p=0.01)
    # 2 warm-up forwards and 3 backwards gather (0.5 exposed each), one reduce-scatter at the end
    assert t["dp"] == pytest.approx(2 * 0.5 + 3 * 0.5 + 1.0)
    assert t["compute"] == pytest.approx(12.0)
    assert t["bubble"] == pytest.approx(12.0 * 1 / 4)  # (p-1)/m of the work: 1/5 of the pipelined time
    assert t["pp"] == pytest.approx(4 * 0.01)


def test_without_resharding_after_forward_a_unit_gathers_once_a_step() -> None:
    """FSDP's reshard_after_forward=False (the default under a pipeline, as torchtitan sets it): the first
    forward gathers, nothing gathers again; every unit stays gathered (memory) until its backward."""
    u = T.Units(fwd=[1.0, 1.0], bwd=[2.0, 2.0], gather=[0.5, 3.0], reduce=[1.0, 1.0])
    kept = T.stage_time(u, pp=1, stage=0, n_microbatches=1, stages_per_rank=1, p2p=0.0,
                        reshard_after_forward=False)
    # forward 0.5 + max(1, 3) + 1; backward, no gathers: max(2, r1=1) + max(2, 0) + r0 = 5; work 6
    assert kept["dp"] == pytest.approx(4.5 + 5.0 - 6.0)
    piped = T.stage_time(u, pp=2, stage=0, n_microbatches=4, stages_per_rank=1, p2p=0.0,
                         reshard_after_forward=False)
    assert piped["dp"] == pytest.approx((0.5 + 3.0 + 1.0 - 2.0) + 2.0)  # one forward's exposed gathers,
    # the reduces
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    prof = profiler(module, x, x)(1)
    hw = hardware("cpu", 1, 8)
    lay = Layout(dp_shard=4)
    default = estimate(lay, Training(global_batch=8, precision="32"), prof, hw)
    kept_est = estimate(lay, Training(global_batch=8, precision="32", reshard_after_forward=False), prof, hw)
    assert kept_est.memory["fsdp_buffers"] > default.memory["fsdp_buffers"]
    assert kept_est.traffic["dp_shard"] < default.traffic["dp_shard"]
    piped_default = estimate(Layout(dp_shard=4, pp=2, n_microbatches=2),
                             Training(global_batch=8, precision="32"), prof, hw)
    piped_reshard = estimate(Layout(dp_shard=4, pp=2, n_microbatches=2),
                             Training(global_batch=8, precision="32", reshard_after_forward=True), prof, hw)
    assert piped_default.traffic["dp_shard"] < piped_reshard.traffic["dp_shard"]  # m + 1 gathers against 1


def test_pipeline_sends_and_traffic_per_axis_by_hand() -> None:
    """A stage sends its output forward and its input's gradient back (neither at the model's ends); the
    bytes a rank sends per step, by axis, as the time equations move them."""
    from polytrain.parallel.planner import volume

    kids = tuple(ChildProfile(name=str(i), kind="B", params=1000, tp_params=800, saved_bytes=0, input_bytes=0,
                              output_bytes=10 * (i + 1), flops=1, tp_allreduce_bytes=200) for i in range(3))
    assert T.boundary_sends(kids, [(0, 2)]) == [20] and T.boundary_sends(kids, [(2, 3)]) == [20]
    assert T.boundary_sends(kids, [(0, 1), (2, 3)]) == [10, 20]  # interleaved: stages 0 and 2 of 3
    assert T.boundary_sends(kids, [(1, 2)]) == [20, 10]
    sent = volume.stage_traffic(kids[:1], [False], T.Features(), micro=2, n_microbatches=4, tp=2, dp_shard=4,
                                dp_replicate=2, pp=2, cp=1, boundary_bytes=20, param_bytes=2, master_bytes=4,
                                op=False)
    local = 800 / 2 + 200
    assert sent == pytest.approx({
        "tp": 4 * 2 * 200 * 2 * (1 / 2) * 2,  # m x mb x payload x 2(t-1)/t, forward and backward
        "dp_shard": 5 * local * 2 * 3 / 4 + local * 4 * 3 / 4,  # m + 1 gathers under a pipeline, one reduce
        "dp_replicate": 2 * local / 4 * 4 * 1 / 2,  # the shard's all-reduce
        "pp": 4 * 2 * 20})
    checkpointed = volume.stage_traffic(kids[:1], [True], T.Features(), micro=2, n_microbatches=4, tp=2,
                                        dp_shard=1, dp_replicate=1, pp=1, cp=1, boundary_bytes=0,
                                        param_bytes=2, master_bytes=4, op=False)
    assert checkpointed == pytest.approx({"tp": 4 * 2 * 200 * 3})  # the recompute's collectives too


def test_free_compute_exposes_every_collective() -> None:
    """With compute (nearly) free, FSDP's exposed time is the serial sum of its rings: every unit
    gathered twice in the compute dtype and reduced once in fp32, ``units x 3`` latencies a ring step."""
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    prof = profiler(module, x, x)(1)
    hw = hardware("cpu", 1, 8, peak_flops=1e30)
    est = estimate(Layout(dp_shard=4), Training(global_batch=8, precision="32"), prof, hw)
    units = [c for c in prof.children if c.params]
    serial = sum(T.ring_time(c.params * 4, 4, hw.intra_bw, hw.intra_latency) for c in units) * 3
    assert est.time["dp"] == pytest.approx(serial, rel=1e-6)


def test_same_inputs_same_plan() -> None:
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    hw, train = hardware("cpu", 1, 8), Training(global_batch=32, precision="32")
    first = [e.layout for e in plan_module(module, x, hw, train, target=x).ranked]
    assert first == [e.layout for e in plan_module(module, x, hw, train, target=x).ranked]


def test_plan_cli_prints_the_ranked_table() -> None:
    cmd = [sys.executable, "-m", "polytrain", "plan", "-c",
           os.path.join(ROOT, "examples/gpt/config_composed.yaml"),
           "--hardware", "cpu", "--nodes", "1", "--devices-per-node", "8", "--top", "5"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "sets of degrees fit" in out.stdout and "best:" in out.stdout
    assert "layers of the Sequential" in out.stdout  # pp beyond the children, with its reason
    assert "1F1B: 1 micro-batches are fewer than the pp=2 stages" in out.stdout  # torch's Schedule1F1B
    # refuses it
    assert "attention cpu" in out.stdout  # torch's pick on CPU (flash, math under dropout), the default
    assert "pipeline schedule 1f1b" in out.stdout  # the config's (the strategy's default)


def test_plans_cost_the_configs_pipeline_schedule() -> None:
    """The schedule and FSDP resharding the run will use are the ones costed; a schedule the planner does not
    model is refused unless there is no pipeline."""
    from polytrain.core.errors import ConfigError
    from polytrain.trainer.launch.planned import schedule_settings

    assert schedule_settings({}) == {"pp_schedule": "1f1b", "stages_per_rank": 1,
                                     "reshard_after_forward": None}
    assert (schedule_settings({"schedule": "interleaved_1f1b", "stages_per_rank": 2,
                               "reshard_after_forward": False})
            == {"pp_schedule": "interleaved_1f1b", "stages_per_rank": 2, "reshard_after_forward": False})
    assert schedule_settings({"schedule": "gpipe", "pp": 1}) == {"reshard_after_forward": None}
    with pytest.raises(ConfigError, match=r"not schedule='zero_bubble'; choose one of them, or pin pp: 1"):
        schedule_settings({"schedule": "zero_bubble", "pp": "auto"})
    cmd = [sys.executable, "-m", "polytrain", "plan", "-c",
           os.path.join(ROOT, "examples/gpt/config_composed.yaml"),
           "--hardware", "cpu", "--devices-per-node", "8", "--top", "3",
           "trainer.strategy.schedule=interleaved_1f1b", "trainer.strategy.stages_per_rank=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "pipeline schedule interleaved_1f1b" in out.stdout


def test_profile_counts_linear_matmul_flops() -> None:
    """A Llama block of dim 64 (4 heads of 16, 2 kv heads, hidden 176) on 16 tokens: its Linear weights hold
    64x64 + 2 x 64x32 + 64x64 + 3 x 64x176 = 46080 parameters, so 2 x 16 x 46080 matmul FLOPs; attention's
    SDPA and the norms are the rest. Under tp 2 each rank holds and computes half of them, and its
    collectives are sequence-parallel."""
    from planner_llama import Llama, LlamaShape

    with torch.device("meta"):
        module = Llama(LlamaShape(64, 2, 4, 2, 1.0, 16, vocab=128))
    x = torch.zeros(1, 16, dtype=torch.long)
    prof = profiler(module, x, x)
    block, head = prof(1).children[1], prof(1).children[-1]
    assert block.linear_params == 46080 and block.linear_flops == 2 * 16 * 46080 < block.flops
    assert block.tp_linear_flops == block.linear_flops and not block.sequence_parallel
    assert head.linear_flops == 2 * 16 * 64 * 128  # the head is one Linear (the loss's FLOPs come on top)
    half = prof(2).children[1]
    assert half.linear_params == 46080 // 2 and half.tp_linear_flops == 16 * 46080 and half.sequence_parallel
    assert prof(1).children[0].linear_flops == 0  # an embedding is not a matmul


def test_float8_runs_linear_matmuls_at_the_fp8_peak() -> None:
    """10 GFLOP forward a sample, 8 of them Linear matmuls (6 in split layers): bf16 at 1e12 x 0.5, fp8 at
    2e12 x 0.5."""
    c = ChildProfile(name="b", kind="Block", params=1000, tp_params=800, saved_bytes=0, input_bytes=0,
                     output_bytes=100, flops=10_000_000_000, tp_allreduce_bytes=200,
                     linear_flops=8_000_000_000, tp_linear_flops=6_000_000_000, linear_params=500,
                     sequence_parallel=True)
    hw = Hardware(nodes=1, devices_per_node=8, memory_bytes=1, peak_flops=1e12, efficiency=0.5, intra_bw=1e9,
                  inter_bw=1e8, intra_latency=1e-5, inter_latency=1e-4, fp8_peak_flops=2e12)
    assert T.compute_time(c, 2, 1, hw, False) == pytest.approx((2 * 10e9 / 5e11, 2 * 6e9 / 5e11))
    assert T.compute_time(c, 2, 1, hw, True) == pytest.approx((2 * (2e9 / 5e11 + 8e9 / 1e12), 2 * 6e9 / 1e12))
    # FSDP 4 (tp 2: 600 local parameters, 500 of them float8 Linear weights): the gather moves those at 1 byte
    links = (T.link(hw, 8), T.link(hw, 8))
    g, r = T.fsdp_times(c, 2, 4, 1, 2, 4, links, False, fp8_gather=True)
    assert g == pytest.approx((100 * 2 + 500 * 1) * 3 / 4 / 1e9 + 3 * 1e-5)
    assert r == pytest.approx(600 * 4 * 3 / 4 / 1e9 + 3 * 1e-5)  # gradients are reduced as before


def test_float8_and_async_tp_collectives_by_hand() -> None:
    """tp 2, 2 samples of 200 all-reduced bytes (2 collectives: output 100): the wire time is 2 x 200 x
    2(1/2) / 1e9. Float8 gathers (each pass's half of the bytes) in 1 byte: x 3/4. Async TP hides the
    wire time behind the split matmuls' (t-1)/t and exposes one step's latency per collective
    (2 k = 4)."""
    c = ChildProfile(name="b", kind="Block", params=1000, tp_params=800, saved_bytes=0, input_bytes=0,
                     output_bytes=100, flops=0, tp_allreduce_bytes=200, sequence_parallel=True)
    hw = Hardware(nodes=1, devices_per_node=8, memory_bytes=1, peak_flops=1e12, intra_bw=1e9,
                  intra_latency=1e-5)
    wire, steps = 2 * 200 * 2 * (1 / 2) / 1e9, 2 * 2 * 1 * 1e-5
    assert T.tp_time(c, 2, 2, hw, False, False, 0.0) == pytest.approx((wire + steps, wire + steps))
    assert (T.tp_time(c, 2, 2, hw, True, False, 0.0)
            == pytest.approx((0.75 * wire + steps, 0.75 * wire + steps)))
    matmul = 2 * wire  # hides (t-1)/t of it = wire: nothing of the bytes left
    assert T.tp_time(c, 2, 2, hw, False, True, matmul) == pytest.approx((4 * 1e-5, 4 * 1e-5))
    assert T.tp_time(c, 2, 2, hw, False, True, wire) == pytest.approx((wire / 2 + 4e-5, wire / 2 + 4e-5))
    assert T.tp_time(c, 2, 2, hw, True, True, wire) == pytest.approx((wire / 4 + 4e-5, wire / 4 + 4e-5))
    plain = ChildProfile(**{**c.__dict__, "sequence_parallel": False})  # no reduce-scatter to fuse:
    # no overlap
    assert T.tp_time(plain, 2, 2, hw, True, True, matmul) == pytest.approx((wire + steps, wire + steps))


def test_float8_needs_fp8_hardware_and_keeps_the_head_in_bf16() -> None:
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    with pytest.raises(ConfigError, match="needs float8=True"):
        Training(global_batch=8, fsdp_float8_all_gather=True)
    with pytest.raises(ConfigError, match="no fp8 peak"):
        plan_module(module, x, hardware("a100", 1, 8), Training(global_batch=8, float8=True), target=x)
    prof = profiler(module, x, x)(1)
    with pytest.raises(ConfigError, match="no fp8 peak"):
        estimate(Layout(), Training(global_batch=8, float8=True), prof, hardware("cpu", 1, 8))
    hw = hardware("h100", 1, 8)
    bf16 = estimate(Layout(), Training(global_batch=8), prof, hw).time["compute"]
    fp8 = estimate(Layout(), Training(global_batch=8, float8=True), prof, hw).time["compute"]
    rate, rate8 = hw.peak_flops * hw.efficiency, hw.fp8_peak_flops * hw.efficiency
    saved = sum(c.linear_flops for c in prof.children[:-1]) * 8 * 3 * (1 / rate - 1 / rate8)  # fwd + 2 bwd
    # Each float8 Linear's casts, memory-bound: forward its input and weight (2 + 2 + 1 bytes an element),
    # backward its output's gradient (5) and the transposed copies of that gradient, the input and the
    # weight (3 each); a micro-batch of 8 samples
    bandwidth = hw.memory_bandwidth * hw.memory_efficiency
    cast_bytes = sum(8 * (8 * c.linear_inputs + c.linear_params) + 8 * 8 * c.linear_outputs
                     for c in prof.children[:-1])
    assert all(c.linear_inputs > 0 and c.linear_outputs > 0 for c in prof.children if c.kind == "Block")
    assert bf16 - fp8 == pytest.approx(saved - cast_bytes / bandwidth)


def test_1f1b_rejects_fewer_microbatches_than_stages() -> None:
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    plan = plan_module(module, x, hardware("cpu", 1, 8), Training(global_batch=16, precision="32"), target=x)
    assert all(e.layout.n_microbatches >= e.layout.pp for e in plan.ranked if e.layout.pp > 1)
    assert any(r.reason == "1F1B: 2 micro-batches are fewer than the pp=4 stages" for r in plan.rejected)


def test_attention_defaults_to_the_flash_kernel() -> None:
    """torch runs SDPA's flash kernel on CUDA (bf16) and on CPU (fp32 too): the default counts what it saves
    (no s x s matrix); ``math`` stays selectable and saves more."""
    module = _gpt()
    x = torch.zeros(1, 32, dtype=torch.long)
    saved = {k: sum(c.saved_bytes for c in profiler(module, x, x, k)(1).children) for k in ("flash", "math")}
    assert sum(c.saved_bytes for c in profiler(module, x, x)(1).children) == saved["flash"] < saved["math"]


def test_a_tied_embedding_and_head_count_once_and_no_pipeline_splits_them() -> None:
    """GPT-2's head shares its embedding's weight: stored once, so counted once (as the pipeline strategy
    weighs children); a layout putting the two on different pipeline ranks is rejected in the
    strategy's words, not ranked to fail at start."""
    module = _gpt()
    untied = sum(c.params for c in profiler(module, torch.zeros(1, 32, dtype=torch.long))(1).children)
    module.net[6].weight = module.net[0].tok.weight  # (43, 128) both
    x = torch.zeros(1, 32, dtype=torch.long)
    prof = profiler(module, x, x)(1)
    assert prof.params == sum(p.numel() for p in module.parameters()) == untied - 43 * 128
    assert prof.ties == ((0, 6),)
    hw, train = hardware("cpu", 1, 8), Training(global_batch=32, precision="32")
    plan = plan_module(module, x, hw, train, target=x)
    assert plan.ranked and all(e.layout.pp == 1 for e in plan.ranked)
    pipelined = [r for r in plan.rejected if r.layout.pp > 1]
    assert pipelined and any("tied weights cannot span pipeline ranks" in r.reason for r in pipelined)
    assert ("children 0 (pp rank 0) and 6 (pp rank 1) share a parameter"
            in " ".join(r.reason for r in pipelined))


BUILT_LATE = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule


class BuiltLate(TrainModule):
    """Its layers come from configure_model, as a large model's do (on the meta device under fsdp)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.width = width

    def configure_model(self):
        if hasattr(self, "net"):
            return
        self.net = nn.Sequential(nn.Linear(self.width, self.width), nn.ReLU(), nn.Linear(self.width, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = TensorDataset(torch.randn(16, self.width), torch.randint(0, 4, (16,)))
        return DataLoader(data, batch_size=4)
'''


def test_a_module_built_in_configure_model_is_planned_on_what_it_builds(tmp_path, monkeypatch) -> None:
    """The planner configures a copy on the meta device: the layers and the SGD that configure_optimizers
    builds from them are what it plans; the user's module is left to its own fit."""
    from polytrain.trainer.launch.planned import as_built

    (tmp_path / "built_late.py").write_text(BUILT_LATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from built_late import BuiltLate

    module = BuiltLate()
    built = as_built(module)
    assert not hasattr(module, "net") and built.net[0].weight.is_meta
    (tmp_path / "cfg.yaml").write_text("module: {_target_: built_late.BuiltLate, width: 16}\n"
                                       "trainer: {accelerator: cpu, devices: 2, strategy: ddp}\n")
    cmd = [sys.executable, "-m", "polytrain", "plan", "-c", str(tmp_path / "cfg.yaml"), "--nodes", "1",
           "--devices-per-node", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    header = out.stdout.splitlines()[0]
    assert "plan for BuiltLate (340 parameters)" in header and "optimizer sgd," in header, header
    assert "best:" in out.stdout


class _Attention(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv, self.dropout = torch.nn.Linear(32, 96), dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(*x.shape[:2], 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout,
                                                               is_causal=True)
        return out.transpose(1, 2).reshape(x.shape)


class _AttentionModule(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(_Attention(dropout))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_cpu_kernel_is_flash_without_dropout_and_math_with_it(dropout: float) -> None:
    """On CPU torch runs SDPA's flash kernel, but its math kernel under dropout (the s x s scores, their
    softmax and the dropout mask are saved): the ``cpu`` trace counts what a real CPU step saves."""
    from polytrain.parallel.planner.model_profile import _SavedCounter

    torch.manual_seed(0)
    module, batch = _AttentionModule(dropout), 4
    x = torch.randn(batch, 128, 32)
    counter = _SavedCounter({p.untyped_storage()._cdata for p in module.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        module.net(x).sum()
    measured = counter.total - x.numel() * 4  # the input: held by the batch anyway, counted apart
    predicted = {kind: (batch * profiler(module, x[:1], attention=kind)(1).children[0].saved_bytes
                        - x.numel() * 4)
                 for kind in ("cpu", "flash")}
    assert predicted["cpu"] == pytest.approx(measured, rel=0.05), (predicted, measured)  # meta: +4 %
    # under dropout
    if dropout:  # the flash trace would miss the s x s matrices
        assert predicted["flash"] < 0.5 * measured


def test_the_memory_is_the_peak_over_the_steps_phases() -> None:
    """Beyond the state, activations and FSDP's buffers, the busiest phase's transients: in backward, what a
    child's backward allocates at its peak beside its largest parameter's fresh gradient (none under FSDP:
    its unsharded gradients are its buffers), and beside its recompute when it is checkpointed (not the
    loss's backward: no block is recomputed then); at the optimizer step, Adam's temporaries once the
    activations are freed (every parameter at once, foreach, or the largest one)."""
    def child(saved: int, backward: int, largest_param: int, kind: str = "Block") -> ChildProfile:
        return ChildProfile(name="b", kind=kind, params=1000, tp_params=0, saved_bytes=saved,
                            input_bytes=0, output_bytes=0, flops=0, tp_allreduce_bytes=0,
                            backward_bytes=backward, largest_param=largest_param)

    big_activations = ModelProfile(tp=1, children=(child(5000, 3000, 600), child(5000, 1000, 900)), seq_len=1,
                                   param_bytes=4)
    sgd = Training(global_batch=4, precision="32", optimizer="sgd")
    [memory] = stage_memories(Layout(), sgd, big_activations)
    assert memory["activations"] == 4 * 10000
    assert memory["transients"] == 4 * 3000 + 900 * 4  # a micro-batch of 4; the fresh fp32 gradient
    [sharded] = stage_memories(Layout(dp_shard=2), Training(global_batch=8, precision="32", optimizer="sgd"),
                               big_activations)
    assert sharded["transients"] == 4 * 3000  # FSDP: in its buffers
    small_activations = ModelProfile(tp=1, children=(child(10, 10, 600), child(10, 10, 900)), seq_len=1,
                                     param_bytes=4)
    adamw = Training(global_batch=4, precision="32", optimizer="adamw")
    [adam] = stage_memories(Layout(), adamw, small_activations)
    assert adam["transients"] == 2000 * 4 - adam["activations"]  # sqrt(exp_avg_sq), all at once
    one_by_one = Training(global_batch=4, precision="32", optimizer="adamw", foreach=False)
    assert stage_memories(Layout(), one_by_one, small_activations)[0]["transients"] == 4 * 10 + 900 * 4

    # Two checkpointed blocks (each brings back its 5000 saved bytes a sample) and a loss whose backward
    # allocates 8000: activations hold the blocks' inputs (0 here) and one block's recompute; the loss's
    # backward runs before any recompute, so its phase is 4 x 8000, not 4 x 5000 + 4 x 8000.
    with_loss = ModelProfile(tp=1, children=(child(5000, 1000, 10), child(5000, 1000, 10),
                                             child(100, 8000, 10, kind="Head")), seq_len=1, param_bytes=4)
    [checkpointed] = stage_memories(Layout(dp_shard=2, activation_checkpointing=True),
                                    Training(global_batch=8, precision="32", optimizer="sgd"), with_loss)
    assert checkpointed["activations"] == 4 * 100 + 4 * 5000
    assert checkpointed["activations"] + checkpointed["transients"] == 4 * 100 + 4 * 8000
    # A block's phase decides when its recompute and backward outgrow the loss's: 5000 + 4000 > 8000
    heavy_blocks = ModelProfile(tp=1, children=(child(5000, 4000, 10), child(5000, 4000, 10),
                                                child(100, 8000, 10, kind="Head")), seq_len=1, param_bytes=4)
    [blocks] = stage_memories(Layout(dp_shard=2, activation_checkpointing=True),
                              Training(global_batch=8, precision="32", optimizer="sgd"), heavy_blocks)
    assert blocks["activations"] + blocks["transients"] == 4 * 100 + 4 * (5000 + 4000)


def test_a_mixed_precision_profile_is_traced_under_autocast() -> None:
    """bf16-mixed is traced as CUDA autocast runs it (fake CUDA tensors: no GPU needed): a block's qkv and fc
    outputs, kept by per-op checkpointing, are bf16 (half of fp32's), its weights' bf16 casts are counted
    apart, once a micro-batch, and the FLOPs do not change. A model built in bf16 is traced as built."""
    d, s = 128, 32
    x = torch.zeros(1, s, dtype=torch.long)
    fp32, mixed = (next(c for c in profiler(_gpt(), x, precision=p)(1).children if c.kind == "Block")
                   for p in ("32", "bf16-mixed"))
    assert fp32.cast_bytes == 0 and mixed.cast_bytes == 2 * 12 * d * d  # qkv, proj, fc, fc2 weights in bf16
    assert mixed.saved_bytes < 0.75 * fp32.saved_bytes
    assert mixed.flops == fp32.flops and mixed.op_recompute_flops == fp32.op_recompute_flops
    assert 0 <= mixed.op_kept_bytes - (s * 3 * d * 2 + s * 4 * d * 2 + s * d * 2 + 4 * s * 4) <= 64
    bf16 = _gpt().to(torch.bfloat16)
    assert profiler(bf16, x, precision="bf16-mixed")(1).children == profiler(bf16, x)(1).children
