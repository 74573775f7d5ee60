"""The GAN example (manual optimisation, two optimizers) equals a hand-written two-optimizer loop,
on one process and on ddp x2.

The reference is plain PyTorch: two Adam optimizers, the discriminator frozen (``requires_grad``)
while the generator steps and the other way round, the discriminator's gradient clipped by norm. For
ddp x2 it replays what the two ranks do on one process: global batch k is the concatenation of the
ranks' batches k (``DistributedSampler`` by hand), each rank's noise comes from its own generator
(``noise_seed + rank``), and the loss is the mean of the ranks' mean losses, whose gradient is what
DDP's averaged gradients are.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "gan"))
from gan_module import DigitsGAN, digit_images  # noqa: E402

pytestmark = pytest.mark.own_logic

N_IMAGES, BATCH, EPOCHS, NOISE_SEED, TOL = 256, 16, 2, 1, 1e-6


def _module() -> DigitsGAN:
    torch.manual_seed(0)
    return DigitsGAN(batch_size=BATCH, n_images=N_IMAGES, noise_seed=NOISE_SEED)


def _fit(module: DigitsGAN, root: str, devices: int) -> Any:
    from polytrain import Trainer

    trainer = Trainer(accelerator="cpu", devices=devices,
                      strategy="ddp_find_unused_parameters_true" if devices > 1 else "single",
                      max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, run_dir=root,
                      use_distributed_sampler="always")
    trainer.fit(module)
    return trainer


def _hand_loop(world: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _module()
    gen, disc = copy.deepcopy(model.generator), copy.deepcopy(model.discriminator)
    opt_g = torch.optim.Adam(gen.parameters(), lr=model.hparams.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=model.hparams.lr, betas=(0.5, 0.999))
    data = TensorDataset(digit_images(N_IMAGES))
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0)
                for r in range(world)]
    noise = [torch.Generator().manual_seed(NOISE_SEED + r) for r in range(world)]
    losses = []
    for epoch in range(EPOCHS):
        for s in samplers:
            s.set_epoch(epoch)
        loaders = [DataLoader(data, batch_size=BATCH, sampler=s) for s in samplers]
        for parts in zip(*loaders):
            reals = [p[0] for p in parts]
            zs = [torch.randn(r.shape[0], model.hparams.latent_dim, generator=g)
                  for r, g in zip(reals, noise)]
            for p in disc.parameters():
                p.requires_grad_(False)
            g_loss = torch.stack([F.binary_cross_entropy_with_logits(disc(gen(z)), torch.ones(len(z), 1))
                                  for z in zs]).mean()
            g_loss.backward()
            opt_g.step()
            opt_g.zero_grad()
            for p in disc.parameters():
                p.requires_grad_(True)
            for p in gen.parameters():
                p.requires_grad_(False)
            d_losses = []
            for real, z in zip(reals, zs):
                fake = gen(z).detach()
                d_losses.append(0.5 * (F.binary_cross_entropy_with_logits(disc(real),
                                                                          torch.ones(len(real), 1))
                                       + F.binary_cross_entropy_with_logits(disc(fake),
                                                                            torch.zeros(len(z), 1))))
            d_loss = torch.stack(d_losses).mean()
            d_loss.backward()
            torch.nn.utils.clip_grad_norm_(disc.parameters(), model.hparams.clip)
            opt_d.step()
            opt_d.zero_grad()
            for p in gen.parameters():
                p.requires_grad_(True)
            losses.append(float(g_loss.detach()))
    state = {f"generator.{k}": v for k, v in gen.state_dict().items()}
    state.update({f"discriminator.{k}": v for k, v in disc.state_dict().items()})
    return state, losses


def _assert_close_to(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    worst = max(float((state[k] - v).abs().max()) for k, v in reference.items())
    assert worst <= TOL, f"largest weight difference from the hand-written loop: {worst:.3g}"
    return worst


def test_gan_single_process_matches_a_hand_written_loop(tmp_path: Any) -> None:
    module = _module()
    trainer = _fit(module, str(tmp_path), 1)
    assert trainer.global_step == 2 * EPOCHS * N_IMAGES // BATCH  # manual optimisation counts every step()
    reference, _ = _hand_loop(1)
    _assert_close_to(module.state_dict(), reference)


def _ddp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = _module()
    trainer = _fit(module, root, world_size)
    return {"state": {k: v.clone() for k, v in module.state_dict().items()}, "steps": trainer.global_step}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gan_ddp_two_ranks_matches_a_hand_written_loop(tmp_path: Any) -> None:
    ranks = run_distributed(_ddp_worker, 2, str(tmp_path), timeout=240)
    reference, _ = _hand_loop(2)
    for r in ranks:
        assert r["steps"] == 2 * EPOCHS * N_IMAGES // (2 * BATCH)
        _assert_close_to(r["state"], reference)
    assert all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in reference)  # replicas agree


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gan_config_trains_through_the_cli(tmp_path: Any) -> None:
    """The example as a user runs it: ``polytrain fit -c examples/gan/config.yaml`` on 2 CPU processes."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p))
    args = [sys.executable, "-m", "polytrain", "fit", "-c", "examples/gan/config.yaml",
            f"trainer.run_dir={tmp_path}",
            "trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.enable_progress_bar=false",
            "trainer.logger=false", "module.n_images=192"]
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    checkpoints = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith((".pt", ".ckpt"))]
    assert checkpoints, f"no checkpoint under {tmp_path}: {list(os.walk(tmp_path))}"
