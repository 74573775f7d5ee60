"""The GPT the benchmarks train (``gpt_throughput.py``, ``activation_memory.py``): GPT-2 small's shape
(``FULL``: 12 layers, d 768, 12 heads, seq 1024, vocab 50304, tied head, 124M parameters) or a tiny
one for CPU (``TINY``), as a ``TrainModule`` whose ``training_step`` logs the loss, with AdamW.
The classes are made on first use (``classes()``), so parsing a benchmark's arguments imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Shape:
    vocab: int
    d: int
    layers: int
    heads: int
    seq: int


FULL = Shape(vocab=50304, d=768, layers=12, heads=12, seq=1024)
TINY = Shape(vocab=512, d=64, layers=2, heads=4, seq=64)


# --------------------------------------------------------------------------- the model


def _make_classes() -> tuple[type, type]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from polytrain import TrainModule

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(TrainModule):
        def __init__(self, shape: Shape, lr: float = 3e-4, fused: bool = False) -> None:
            super().__init__()
            self.shape, self.lr, self.fused = shape, lr, fused
            self.tok = nn.Embedding(shape.vocab, shape.d)
            self.pos = nn.Embedding(shape.seq, shape.d)
            self.blocks = nn.ModuleList(Block(shape.d, shape.heads) for _ in range(shape.layers))
            self.ln_f = nn.LayerNorm(shape.d)
            self.head = nn.Linear(shape.d, shape.vocab, bias=False)
            self.head.weight = self.tok.weight  # tied, as GPT-2
            self.loader: Any = None
            for name, p in self.named_parameters():  # GPT-2's initialisation
                if p.dim() == 1:
                    nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
                else:
                    std = (0.02 / math.sqrt(2 * shape.layers) if name.endswith(("proj.weight", "out.weight"))
                           else 0.02)
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

        def loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x).view(-1, self.shape.vocab).float(), y.view(-1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return make_optimizer(self.parameters(), self.lr, self.fused)

        def train_dataloader(self) -> Any:
            return self.loader

    return Block, GPT


def make_optimizer(params: Any, lr: float, fused: bool) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, betas=(0.9, 0.95), fused=fused or None)


def model_flops_per_token(model: Any, shape: Shape) -> float:
    n = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()  # tied head counted once
    return 6 * n + 12 * shape.layers * shape.d * shape.seq


_CLASSES: tuple[type, type] | None = None


def classes() -> tuple[type, type]:
    """``(Block, GPT)``, made once per process."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _make_classes()
    return _CLASSES


def build(shape: Shape, fused: bool = False) -> Any:
    """A fresh GPT of ``shape`` from seed 0 (every variant of a benchmark starts from the same weights)."""
    import torch

    torch.manual_seed(0)
    return classes()[1](shape, fused=fused)
