"""Llama-3 shaped decoders for the planner's table tests: the public shapes (torchtitan's
``torchtitan/models/llama3/__init__.py``), built on the meta device, no weights.

One ``nn.Sequential`` (embedding, blocks, final norm, head), grouped-query attention through
``F.scaled_dot_product_attention``, SwiGLU MLP, and torchtitan's tensor-parallel plan: q/k/v, w1, w3
and the head column-parallel, wo and w2 row-parallel, the norms sequence-parallel. The loss is
torchtitan's (cross-entropy on the logits cast to fp32); under tensor parallelism, where each rank holds
its shard of the vocabulary, it is computed as torch's loss parallelism computes it (the runs'
default), whose backward makes other temporaries than cross-entropy's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_multiplier: float
    multiple_of: int
    vocab: int = 128256

    @property
    def hidden(self) -> int:  # torchtitan's compute_ffn_hidden_dim
        h = int(self.ffn_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)


LLAMA3 = {
    "8B": LlamaShape(4096, 32, 32, 8, 1.3, 1024),
    "70B": LlamaShape(8192, 80, 64, 8, 1.3, 4096),
    "405B": LlamaShape(16384, 126, 128, 8, 1.2, 4096),
}


@dataclass(frozen=True)
class PublishedRun:
    """A run torchtitan published, with the settings the planner is given for it."""

    name: str
    gpus: int
    degrees: tuple[int, int, int, int]  # (dp_replicate, dp_shard, tp, pp) as published
    local_batch: int  # samples per data-parallel rank per step
    device_gib: int  # memory of the H100s the run used
    pp_schedule: str = "1f1b"
    stages_per_rank: int = 1
    seq_len: int = 8192  # every llama3 train config at torchtitan 9dec370 trains on 8192 tokens
    float8: bool = False  # float8 linears (torchao, dynamic tensorwise scaling: 9dec370's default)
    fsdp_float8_all_gather: bool = False
    async_tp: bool = False

    @property
    def global_batch(self) -> int:  # local batch x the run's data-parallel degree
        return self.local_batch * self.degrees[0] * self.degrees[1]


# torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (added in 820504e, describing runs at torchtitan
# 9dec370, Dec 2024): H100s with 96 GB HBM2e, 8 per host, 400 Gb/s per GPU between hosts. Table 1: 8B on 8
# GPUs, FSDP, local batch 2, selective (op) AC. Table 4: 70B on 256, FSDP 32 x TP 8, local 16, full AC,
# Float8. Table 5: 405B on 512, FSDP 8 x TP 8 x PP 8, local 32, full AC, Float8, async TP, Interleaved
# 1F1B: at 9dec370 a looped schedule with no split points given gets 2 stages per rank
# (pipelining_utils.generate_split_points) and pp micro-batches (pipeline_parallel_microbatches unset).
# The 8B config itself (train_configs/llama3_8b.toml at 9dec370: batch_size 1, seq_len 8192, FSDP over
# every GPU) is the "8 x H100 80GB" case.
# Float8 settings: train_configs/llama3_405b.toml at 9dec370 sets enable_float8_linear,
# enable_fsdp_float8_all_gather and enable_async_tensor_parallel; llama3_70b.toml has float8 off, so of
# Table 4's "Float8" only the float8 linears are known (the float8 all-gather is off by default, and the
# table's first row, "2D", ran without async TP; "2D + AsyncTP" is PUBLISHED_VARIANTS["70B-async-tp"]).
PUBLISHED = {
    "8B-config": PublishedRun("8B", 8, (1, 8, 1, 1), 1, 80),
    "8B": PublishedRun("8B", 8, (1, 8, 1, 1), 2, 96),
    "70B": PublishedRun("70B", 256, (1, 32, 8, 1), 16, 96, float8=True),
    "405B": PublishedRun("405B", 512, (1, 8, 8, 8), 32, 96, "interleaved_1f1b", 2, float8=True,
                         fsdp_float8_all_gather=True, async_tp=True),
}
PUBLISHED_VARIANTS = {"70B-async-tp": PublishedRun("70B", 256, (1, 32, 8, 1), 16, 96, float8=True,
                                                   async_tp=True)}


class Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.head_dim = s.dim // s.n_heads
        self.wq = nn.Linear(s.dim, s.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.n_heads * self.head_dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # head counts from the tensors: this rank's share under tensor parallelism
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.hidden, bias=False)
        self.w3 = nn.Linear(s.dim, s.hidden, bias=False)
        self.w2 = nn.Linear(s.hidden, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(s.dim)
        self.attention = Attention(s)
        self.ffn_norm = nn.RMSNorm(s.dim)
        self.feed_forward = FeedForward(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.shape = s
        self.net = nn.Sequential(nn.Embedding(s.vocab, s.dim), *[Block(s) for _ in range(s.n_layers)],
                                 nn.RMSNorm(s.dim), nn.Linear(s.dim, s.vocab, bias=False))

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        plan: dict[str, Any] = {"net.0": RowwiseParallel(),
                                f"net.{self.shape.n_layers + 1}": SequenceParallel(),
                                f"net.{self.shape.n_layers + 2}": ColwiseParallel()}
        for i in range(1, self.shape.n_layers + 1):
            plan[f"net.{i}.attention_norm"] = SequenceParallel()
            plan[f"net.{i}.ffn_norm"] = SequenceParallel()
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                         "feed_forward.w3"):
                plan[f"net.{i}.{name}"] = ColwiseParallel()
            plan[f"net.{i}.attention.wo"] = RowwiseParallel()
            plan[f"net.{i}.feed_forward.w2"] = RowwiseParallel()
        return plan

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = outputs.flatten(0, 1).float()
        if outputs.shape[-1] < self.shape.vocab:  # the head's output is this rank's vocabulary shard
            return ShardedCrossEntropy.apply(logits, targets.flatten())
        return F.cross_entropy(logits, targets.flatten())


class ShardedCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits sharded on the vocabulary, as torch's loss parallelism runs it on one rank's
    shard (``torch/distributed/tensor/parallel/loss.py``, which torchtitan's TP runs enter): log-softmax
    through the max, the sum of exponentials and their log, its output saved; the backward fused into
    nll's, a zeroed tensor with -1 at the targets, then ``(that + exp(log_probs)) x grad``. Its all-reduces
    (tensors of one value a token) and the masking of targets outside the shard are left out: the planner
    counts bytes."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        log_probs = shifted - torch.exp(shifted).sum(dim=-1, keepdim=True).log()
        ctx.save_for_backward(log_probs, targets)
        return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_probs, targets = ctx.saved_tensors
        picked = torch.zeros_like(log_probs)
        picked.scatter_(-1, targets.unsqueeze(-1), -1.0)
        return (picked + torch.exp(log_probs)) * (grad / log_probs.shape[0]), None


def build(name: str, dtype: torch.dtype = torch.bfloat16) -> Llama:
    with torch.device("meta"):
        return Llama(LLAMA3[name]).to(dtype)
