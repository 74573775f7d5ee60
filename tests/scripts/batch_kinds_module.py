"""A module around a Hugging Face causal LM (GPT-2 or Llama from a small config, held as one attribute) whose
loader yields the tokens in any of the structures the loop takes: ``batch_kind`` is tensor, tuple, list,
dict, dataclass or batch_encoding. Its ``training_step`` logs, reads ``self.trainer``, and under
``configure_model: true`` builds the model there, as a module written for training would."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule

KINDS = ("tensor", "tuple", "list", "dict", "dataclass", "batch_encoding")
VOCAB, SEQ = 64, 16


@dataclasses.dataclass
class Tokens:
    input_ids: torch.Tensor
    labels: torch.Tensor


def build_model(arch: str) -> torch.nn.Module:
    import transformers

    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def collate(kind: str, rows: list[tuple[torch.Tensor]]) -> Any:
    tokens = torch.stack([r[0] for r in rows])
    if kind == "tensor":
        return tokens
    if kind == "tuple":
        return tokens, tokens
    if kind == "list":
        return [tokens, tokens]
    if kind == "dict":
        return {"input_ids": tokens, "labels": tokens}
    if kind == "dataclass":
        return Tokens(tokens, tokens)
    from transformers import BatchEncoding

    return BatchEncoding({"input_ids": tokens, "labels": tokens})


def ids_and_labels(kind: str, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "tensor":
        return batch, batch
    if kind in ("tuple", "list"):
        return batch[0], batch[1]
    if kind == "dataclass":
        return batch.input_ids, batch.labels
    return batch["input_ids"], batch["labels"]


class BatchKindsLM(TrainModule):
    def __init__(self, batch_kind: str = "tuple", arch: str = "gpt2", batch_size: int = 8,
                 configure_model: bool = False) -> None:
        super().__init__()
        if batch_kind not in KINDS:
            raise ValueError(f"batch_kind={batch_kind!r}; valid: {', '.join(KINDS)}")
        self.batch_kind, self.arch, self.batch_size = batch_kind, arch, batch_size
        self.build_late = configure_model
        self.model = None if configure_model else build_model(arch)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model(self.arch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = ids_and_labels(self.batch_kind, batch)
        loss = self.model(input_ids=ids, labels=labels).loss
        # What a step written for training does: log, and read its trainer
        self.log("train/loss", loss, prog_bar=True)
        if self.trainer.max_epochs is not None and self.current_epoch >= self.trainer.max_epochs:
            raise AssertionError("a step past the last epoch")
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, VOCAB, (4 * self.batch_size, SEQ),
                               generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size,
                          collate_fn=lambda rows: collate(self.batch_kind, rows))
