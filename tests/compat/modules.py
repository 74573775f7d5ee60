"""Five modules written the way PyTorch Lightning's own demos write them, for the compatibility tests.

The framework comes in through exactly one line, the import marked ``# <framework>`` below. The
compatibility harness (``harness.py``) loads this file's text with that line swapped for polytrain's
import and runs the same classes under both Trainers; nothing else may name a framework. Everything
the modules use from it goes through ``pl.``: ``pl.LightningModule``, ``pl.LightningDataModule``,
``pl.Callback`` (the harness itself also uses ``pl.Trainer`` and ``pl.seed_everything``).

Randomness: datasets are drawn from their own seeded ``torch.Generator`` when they are built, so
building them draws nothing from the global RNG. Inside training steps only the ``dropout`` option
of ``BoringModel`` and ``TransformerLM`` draws from the global RNG. Lightning gives every DDP rank
the *same* global stream (it seeds no rank differently), while polytrain gives each data-parallel
rank its own, so dropout masks differ between the frameworks under DDP: the ddp x2 comparisons use
``dropout=0.0`` (nn.Dropout with p=0 draws nothing), and the GAN takes its noise from a generator it
owns. One-process comparisons may use dropout > 0: there both frameworks must give the same stream.

Cases: ``CASES[name](**kwargs)`` builds what a test runs: the module, an optional datamodule, extra
callbacks, Trainer keywords the case needs, and the strategy name to use under DDP.
"""

from __future__ import annotations  # noqa: I001 - the framework import stays apart, last, on its own line

import os
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split

import lightning.pytorch as pl  # <framework>


# ----------------------------------------------------------------------------------------------
# (i) the boring model: one linear layer on random vectors


class RandomVectors(Dataset):
    """``length`` random vectors of ``size`` features, fixed by ``seed`` (drawn from a private generator)."""

    def __init__(self, size: int, length: int, seed: int) -> None:
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class BoringModel(pl.LightningModule):
    """A linear layer pulled towards ones; every loader of its own, a scheduler stepped per epoch."""

    def __init__(self, in_features: int = 32, out_features: int = 2, lr: float = 0.1, batch_size: int = 4,
                 n_train: int = 64, n_val: int = 16, shuffle: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(in_features, out_features)
        # p=0 draws nothing; p>0 draws a mask from the global RNG in every training step
        # (1-process tests only).
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.dropout(x))

    def loss(self, preds: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(preds, torch.ones_like(preds))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self(batch))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(self(batch)), prog_bar=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.loss(self(batch)))

    def predict_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return [optimizer], [scheduler]

    def _loader(self, seed: int, n: int, shuffle: bool = False) -> DataLoader:
        return DataLoader(RandomVectors(self.hparams.in_features, n, seed),
                          batch_size=self.hparams.batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(1, self.hparams.n_train, shuffle=self.hparams.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(2, self.hparams.n_val)

    def test_dataloader(self) -> DataLoader:
        return self._loader(3, self.hparams.n_val)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(4, self.hparams.n_val)


class NoteCallback(pl.Callback):
    """Returned by ``HookedBoringModel.configure_callbacks``; keeps a count it checkpoints."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


class HookedBoringModel(BoringModel):
    """``BoringModel`` that defines every hook whose call depends on being overridden (``prepare_data``,
    ``configure_model``, ``on_validation_model_train``...) plus the ones users most often customise,
    each doing what the default does, so a recorded run shows the whole lifecycle."""

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str) -> None:
        pass

    def teardown(self, stage: str) -> None:
        pass

    def configure_model(self) -> None:
        pass

    def configure_callbacks(self) -> list[Any]:
        return [NoteCallback()]

    def on_validation_model_eval(self) -> None:
        self.eval()

    def on_validation_model_train(self) -> None:
        self.train()

    def on_test_model_eval(self) -> None:
        self.eval()

    def on_test_model_train(self) -> None:
        self.train()

    def on_predict_model_eval(self) -> None:
        self.eval()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch.to(device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["boring_note"] = "saved"

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_note = checkpoint.get("boring_note")


class EpochMetricsModel(BoringModel):
    """``BoringModel`` logging in every kind of place a real project does: per step, per epoch from the
    steps (reduced across ranks), and inside the epoch-end hooks themselves (a value that hook then reads
    back, as Lightning code does), so a recorded run shows what ``trainer.callback_metrics`` holds inside
    every epoch-end hook."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self(batch))
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(self(batch)), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.loss(self(batch)), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        self.log("train_note", 10.0 * (self.current_epoch + 1), sync_dist=True)
        self.seen_in_hooks.append(("on_train_epoch_end", float(self.trainer.callback_metrics["train_note"])))

    def on_validation_epoch_end(self) -> None:
        self.log("val_note", 10.0 * (self.current_epoch + 1), sync_dist=True)
        self.seen_in_hooks.append(("on_validation_epoch_end",
                                   float(self.trainer.callback_metrics["val_note"])))

    def on_test_epoch_end(self) -> None:
        self.log("test_note", 5.0, sync_dist=True)

    @property
    def seen_in_hooks(self) -> list[tuple[str, float]]:
        return self.__dict__.setdefault("_seen_in_hooks", [])


# ----------------------------------------------------------------------------------------------
# (ii) a small Transformer language model on synthetic tokens


class SyntheticTokens(Dataset):
    """Sequences of ``seq_len + 1`` tokens that count up from a random start by a random stride
    (mod ``vocab_size``): learnable, with a little noise so the loss does not reach zero."""

    def __init__(self, vocab_size: int, seq_len: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab_size, (length, 1), generator=g)
        stride = torch.randint(1, 4, (length, 1), generator=g)
        tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
        noise = torch.rand(length, seq_len + 1, generator=g) < 0.05
        self.tokens = torch.where(noise, torch.randint(vocab_size, tokens.shape, generator=g), tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class TransformerLM(pl.LightningModule):
    """A causal Transformer encoder (pre-norm) with learned positions, AdamW and a per-step warm-up."""

    def __init__(self, vocab_size: int = 32, d_model: int = 32, nhead: int = 2, num_layers: int = 2,
                 dim_feedforward: int = 64, seq_len: int = 16, dropout: float = 0.0, lr: float = 3e-3,
                 warmup_steps: int = 4, batch_size: int = 8, n_train: int = 64, n_val: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=dropout, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab_size)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.encoder(h, mask=self.causal_mask[:n, :n], is_causal=True)
        return self.head(h)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", torch.exp(loss.detach()), on_step=False, on_epoch=True)
        return {"loss": loss}

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def _loader(self, n: int, seed: int, shuffle: bool) -> DataLoader:
        data = SyntheticTokens(self.hparams.vocab_size, self.hparams.seq_len, n, seed)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.n_train, 10, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.n_val, 11, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.n_val, 12, shuffle=False)


# ----------------------------------------------------------------------------------------------
# (iii) an autoencoder on 8x8 digits, fed by a LightningDataModule, with an image-logging callback


def load_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1797 handwritten digits (shipped with the package: nothing is downloaded),
    as float images in [0, 1] of shape (N, 1, 8, 8) and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(digits.target, dtype=torch.int64)


class DigitsDataModule(pl.LightningDataModule):
    """``prepare_data`` writes the digits once to ``data_dir`` (a "download"); ``setup`` reads them and
    splits the first ``n_fit`` into train and validation sets with ``random_split``; the rest is the
    test (and predict) set. ``split_seed=None`` splits with the global RNG instead of a seeded generator."""

    def __init__(self, data_dir: str | None = None, batch_size: int = 32, n_fit: int = 320, n_val: int = 64,
                 n_test: int = 64, split_seed: int | None = 42) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = data_dir or os.path.join(tempfile.gettempdir(), "compat-digits")
        self.batches_served = 0

    @property
    def path(self) -> str:
        return os.path.join(self.data_dir, "digits.pt")

    def prepare_data(self) -> None:
        if os.path.exists(self.path):
            return
        os.makedirs(self.data_dir, exist_ok=True)
        images, labels = load_digit_images()
        tmp = f"{self.path}.{os.getpid()}.tmp"
        torch.save({"images": images, "labels": labels}, tmp)
        os.replace(tmp, self.path)  # another process may be "downloading" too

    def setup(self, stage: str) -> None:
        data = torch.load(self.path, weights_only=True)
        images, labels = data["images"], data["labels"]
        n_fit, n_val, n_test = self.hparams.n_fit, self.hparams.n_val, self.hparams.n_test
        if stage in ("fit", "validate"):
            full = TensorDataset(images[:n_fit], labels[:n_fit])
            seed = self.hparams.split_seed
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
            self.train_set, self.val_set = random_split(full, [n_fit - n_val, n_val], generator=generator)
        if stage in ("test", "predict"):
            self.test_set = TensorDataset(images[n_fit:n_fit + n_test], labels[n_fit:n_fit + n_test])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.batches_served += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"batches_served": self.batches_served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_served = state_dict["batches_served"]


def image_grid(images: torch.Tensor, nrow: int) -> torch.Tensor:
    """(N, C, H, W) -> one (C, rows*H, nrow*W) image, row-major, zero-padded to full rows."""
    n, c, h, w = images.shape
    rows = -(-n // nrow)
    padded = torch.cat([images, images.new_zeros(rows * nrow - n, c, h, w)])
    return padded.reshape(rows, nrow, c, h, w).permute(2, 0, 3, 1, 4).reshape(c, rows * h, nrow * w)


class ReconstructionLogger(pl.Callback):
    """After each real (not sanity-check) validation epoch, reconstructs the first ``num_images`` images of
    the first validation batch: keeps the grid (inputs on top, reconstructions below) in ``self.images``
    and, on global rank 0, sends it to a logger whose experiment has ``add_image`` (TensorBoard)."""

    def __init__(self, num_images: int = 8) -> None:
        self.num_images = num_images
        self.images: list[torch.Tensor] = []
        self._first_batch: torch.Tensor | None = None

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if batch_idx == 0:
            self._first_batch = batch[0][: self.num_images]

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking or self._first_batch is None:
            return
        x = self._first_batch
        with torch.no_grad():
            recon = pl_module(x)
        grid = image_grid(torch.cat([x, recon]).clamp(0, 1).cpu(), nrow=len(x))
        self.images.append(grid)
        experiment = getattr(trainer.logger, "experiment", None)
        if trainer.is_global_zero and hasattr(experiment, "add_image"):
            experiment.add_image("reconstructions", grid, global_step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"logged": len(self.images)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.images = [torch.zeros(0)] * state_dict["logged"]  # the count continues; old grids are not kept


class AutoEncoder(pl.LightningModule):
    """A fully connected 64 -> hidden -> latent -> hidden -> 64 autoencoder; Adam, and a plateau scheduler
    that watches ``val_loss``."""

    def __init__(self, hidden: int = 32, latent: int = 8, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(),
                                     nn.Linear(hidden, latent))
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, 64),
                                     nn.Sigmoid(), nn.Unflatten(1, (1, 8, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = F.mse_loss(self(x), x)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.log("val_loss", F.mse_loss(self(x), x), prog_bar=True, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.log("test_loss", F.mse_loss(self(x), x), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self.encoder(batch[0])

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


# ----------------------------------------------------------------------------------------------
# (iv) a GAN on 8x8 digits with manual optimisation and two optimizers


class Generator(nn.Module):
    def __init__(self, latent_dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(latent_dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 64),
                                 nn.Sigmoid())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z).view(-1, 1, 8, 8)


class Discriminator(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class GAN(pl.LightningModule):
    """Generator and discriminator trained alternately in one ``training_step`` (manual optimisation):
    ``toggle_optimizer``/``untoggle_optimizer`` around each half, ``manual_backward``, gradient clipping
    on the discriminator, and step-LR schedulers the module steps itself once per epoch."""

    def __init__(self, latent_dim: int = 16, hidden: int = 64, lr: float = 2e-3, batch_size: int = 32,
                 n_train: int = 256, noise_seed: int = 1234) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim, hidden)
        self.discriminator = Discriminator(hidden)
        # The noise comes from a generator this module owns, never from the global RNG: under DDP,
        # Lightning gives every rank the same global stream and polytrain gives each data-parallel rank
        # its own, so global draws here would differ between the two frameworks. Every rank draws the
        # same noise (each has its own copy of this generator, seeded alike).
        self.noise = torch.Generator().manual_seed(noise_seed)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], self.hparams.latent_dim, generator=self.noise).to(real)
        ones = torch.ones(real.shape[0], 1, device=real.device)
        zeros = torch.zeros(real.shape[0], 1, device=real.device)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        fake = self(z).detach()
        d_loss = 0.5 * (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                        + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros))
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)
        return {"g_loss": g_loss.detach(), "d_loss": d_loss.detach()}

    def on_train_epoch_end(self) -> None:
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 1, gamma=0.9),
                                torch.optim.lr_scheduler.StepLR(opt_d, 1, gamma=0.9)]

    def train_dataloader(self) -> DataLoader:
        images, _ = load_digit_images()
        return DataLoader(TensorDataset(images[: self.hparams.n_train]), batch_size=self.hparams.batch_size,
                          shuffle=True)


# ----------------------------------------------------------------------------------------------
# cases: what the harness builds


def boring_case(hooked: bool = False, **kwargs: Any) -> dict[str, Any]:
    model = (HookedBoringModel if hooked else BoringModel)(**kwargs)
    return {"model": model}


def epoch_metrics_case(**kwargs: Any) -> dict[str, Any]:
    return {"model": EpochMetricsModel(**kwargs)}


def transformer_case(**kwargs: Any) -> dict[str, Any]:
    return {"model": TransformerLM(**kwargs), "trainer": {"gradient_clip_val": 1.0}}


def autoencoder_case(data_dir: str | None = None, **kwargs: Any) -> dict[str, Any]:
    return {"model": AutoEncoder(**kwargs), "datamodule": DigitsDataModule(data_dir=data_dir),
            "callbacks": [ReconstructionLogger()]}


def gan_case(**kwargs: Any) -> dict[str, Any]:
    # Each half of the step leaves the other network's parameters without gradients: DDP must be told.
    return {"model": GAN(**kwargs), "ddp_strategy": "ddp_find_unused_parameters_true"}


CASES = {"boring": boring_case, "transformer": transformer_case, "autoencoder": autoencoder_case,
         "gan": gan_case, "epoch_metrics": epoch_metrics_case}
