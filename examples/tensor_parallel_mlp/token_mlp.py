"""Tensor parallelism by hand-written plan: a bag-of-tokens classifier whose embedding table is
split over the vocabulary (``VocabParallelEmbedding``, Megatron style) and whose MLP is split
column-wise then row-wise, on 2 CPU processes.

What each rank holds with ``tp: 2``: half of the embedding rows (ids outside its half look up
zeros, and one all-reduce sums the halves), half of ``fc``'s output features and the matching half
of ``proj``'s input features (one all-reduce after ``proj``). The head is small and replicated.

Data: generated — sequences of token ids; the label is the quarter of the vocabulary that occurs
most often in the sequence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule
from polytrain.layers import VocabParallel, VocabParallelEmbedding


def token_data(n: int, vocab: int, length: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    # Each sequence favours one quarter of the vocabulary: that quarter is the label.
    favourite = torch.randint(0, 4, (n, 1), generator=gen)
    quarter = vocab // 4
    biased = favourite * quarter + torch.randint(0, quarter, (n, length), generator=gen)
    uniform = torch.randint(0, vocab, (n, length), generator=gen)
    ids = torch.where(torch.rand(n, length, generator=gen) < 0.5, biased, uniform)
    counts = torch.stack([((ids // quarter) == q).sum(1) for q in range(4)], dim=1)
    return TensorDataset(ids, counts.argmax(1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TokenMLP(TrainModule):
    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 128, length: int = 12,
                 samples: int = 2048, batch_size: int = 32, lr: float = 0.1) -> None:
        super().__init__()
        self.vocab, self.length, self.samples = vocab, length, samples
        self.batch_size, self.lr = batch_size, lr
        self.embed = VocabParallelEmbedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)
        self.head = nn.Linear(dim, 4)

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"embed": VocabParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids).mean(dim=1))
        return self.head(h + self.mlp(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        loss = F.cross_entropy(self(ids), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, labels = batch
        logits = self(ids)
        self.log("val/loss", F.cross_entropy(logits, labels))
        self.log("val/acc", (logits.argmax(1) == labels).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(self.samples, self.vocab, self.length, 0), batch_size=self.batch_size,
                          shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_data(512, self.vocab, self.length, 1), batch_size=128)
