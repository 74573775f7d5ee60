"""A small GPT-style character language model on the text shipped next to it (tiny_corpus.txt).

The same module trains under ``fsdp``, ``model_parallel`` (tensor) and ``pipeline``: only the
``strategy:`` section of the config changes. What makes that work:

- every layer lives in ONE ``nn.Sequential`` attribute, ``self.net`` = (embeddings, *blocks, final
  norm, head), so the pipeline strategy can cut it into stages and FSDP can shard it layer by layer;
- a batch is ``(inputs, targets)`` and the loss is ``self.pipeline_loss(self.net(x), y)``, which the
  pipeline strategy calls on its last stage;
- ``tensor_parallel_plan()`` names, per block, the attention's fused ``qkv`` projection and the
  MLP's ``fc`` as column-parallel and both output projections as row-parallel (Megatron's split:
  one all-reduce per attention and one per MLP in forward). The ``qkv`` rows are laid out head by
  head (``[head][q|k|v][head_dim]``), so a column shard holds whole heads: ``n_head`` must be a
  multiple of the tensor-parallel degree.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_corpus.txt")


class Embeddings(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, block_size: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be a multiple of n_head={n_head}")
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # The number of heads comes from the tensor: all of them on one device, this rank's share
        # under tensor parallelism (qkv is column-sharded head by head).
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim)
        q, k, v = (part.transpose(1, 2) for part in qkv.unbind(dim=3))  # (b, heads, t, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def char_windows(text: str, vocab: str, block_size: int, stride: int) -> TensorDataset:
    """(inputs, targets) windows of ``block_size`` characters; targets are inputs shifted by one."""
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    starts = range(0, len(ids) - block_size - 1, stride)
    x = torch.stack([ids[s:s + block_size] for s in starts])
    y = torch.stack([ids[s + 1:s + block_size + 1] for s in starts])
    return TensorDataset(x, y)


class CharGPT(TrainModule):
    def __init__(self, d_model: int = 64, n_head: int = 4, n_layer: int = 2, block_size: int = 32,
                 stride: int = 8, batch_size: int = 16, lr: float = 3e-3, val_fraction: float = 0.1,
                 corpus: str = CORPUS) -> None:
        super().__init__()
        with open(corpus, encoding="utf-8") as fh:
            self.text = fh.read()
        self.vocab = "".join(sorted(set(self.text)))
        self.block_size, self.stride, self.batch_size = block_size, stride, batch_size
        self.lr, self.val_fraction = lr, val_fraction
        self.n_layer = n_layer
        self.net = nn.Sequential(
            Embeddings(len(self.vocab), d_model, block_size),
            *[Block(d_model, n_head) for _ in range(n_layer)],
            nn.LayerNorm(d_model),
            nn.Linear(d_model, len(self.vocab)),
        )

    # ------------------------------------------------------------------ the contract
    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        for i in range(1, self.n_layer + 1):  # net[0] is the embeddings; blocks follow
            plan[f"net.{i}.attn.qkv"] = ColwiseParallel()
            plan[f"net.{i}.attn.proj"] = RowwiseParallel()
            plan[f"net.{i}.mlp.fc"] = ColwiseParallel()
            plan[f"net.{i}.mlp.proj"] = RowwiseParallel()
        return plan

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        self.log("val/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    # ------------------------------------------------------------------ data
    def _split(self) -> tuple[str, str]:
        cut = int(len(self.text) * (1 - self.val_fraction))
        return self.text[:cut], self.text[cut:]

    def train_dataloader(self) -> DataLoader:
        ds = char_windows(self._split()[0], self.vocab, self.block_size, self.stride)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        ds = char_windows(self._split()[1], self.vocab, self.block_size, self.block_size)
        return DataLoader(ds, batch_size=self.batch_size)

    @torch.no_grad()
    def sample(self, prompt: str, length: int = 80) -> str:
        """Greedy continuation of ``prompt`` (one device; for a quick look after training)."""
        index = {c: i for i, c in enumerate(self.vocab)}
        ids = torch.tensor([[index.get(c, 0) for c in prompt]])
        for _ in range(length):
            logits = self.net(ids[:, -self.block_size:])
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return "".join(self.vocab[i] for i in ids[0].tolist())
