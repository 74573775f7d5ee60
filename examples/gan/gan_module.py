"""A small GAN on scikit-learn's bundled 8x8 digits: manual optimisation with two optimizers.

``training_step`` drives both optimizers itself, as a Lightning GAN does: ``self.optimizers()``,
``toggle_optimizer`` around each half (only that network's parameters require gradients),
``self.manual_backward`` (scaled under ``16-mixed``, all-reduced under ddp), gradient clipping of the
discriminator with ``self.clip_gradients``, and ``optimizer.step()`` / ``zero_grad()``.

Noise: by default ``torch.randn`` from the training stream, which differs between data-parallel ranks
(so two replicas do not generate the same fakes). ``noise_seed`` instead draws it from a generator
this module owns, seeded ``noise_seed + data-parallel rank``: what a test needs to replay the run by
hand.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TrainModule


def digit_images(n: int | None = None) -> torch.Tensor:
    """The digits as (N, 1, 8, 8) floats in [0, 1] (bundled with scikit-learn: nothing is downloaded)."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images[:n] if n is not None else images


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


class DigitsGAN(TrainModule):
    def __init__(self, latent_dim: int = 16, hidden: int = 64, lr: float = 2e-3, batch_size: int = 32,
                 n_images: int | None = None, noise_seed: int | None = None, clip: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim, hidden)
        self.discriminator = Discriminator(hidden)
        self._noise: torch.Generator | None = None

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def noise(self, n: int) -> torch.Tensor:
        seed = self.hparams.noise_seed
        if seed is None:
            return torch.randn(n, self.hparams.latent_dim, device=self.device)
        if self._noise is None:
            self._noise = torch.Generator().manual_seed(seed + self.trainer.strategy.dp_rank)
        return torch.randn(n, self.hparams.latent_dim, generator=self._noise).to(self.device)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = self.noise(real.shape[0])
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
        self.clip_gradients(opt_d, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"train/g_loss": g_loss, "train/d_loss": d_loss}, prog_bar=True)
        return {"g_loss": g_loss.detach(), "d_loss": d_loss.detach()}

    def configure_optimizers(self) -> Any:
        lr, betas = self.hparams.lr, (0.5, 0.999)
        return [torch.optim.Adam(self.generator.parameters(), lr=lr, betas=betas),
                torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=betas)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(digit_images(self.hparams.n_images)),
                          batch_size=self.hparams.batch_size, shuffle=True)
