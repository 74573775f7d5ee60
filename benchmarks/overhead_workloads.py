"""The workloads ``overhead.py`` times against each other: polytrain's ``Trainer`` with its default
callbacks, a hand-written PyTorch loop doing identical work (see ``overhead.py``'s docstring for
what "identical" covers), and with ``--lightning`` the same module under Lightning's ``Trainer``.
torch, polytrain and lightning are imported inside the functions so that ``overhead.py --help`` starts
instantly (the DDP workers' server imports torch and polytrain once: ``local_ranks.worker_context``)."""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from typing import Any


def make_dataset(args: argparse.Namespace, world: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    per_epoch = args.steps // args.epochs
    n = per_epoch * args.batch_size * world
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, args.features, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(x, y)


def make_net(args: argparse.Namespace) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(),
                         nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))


def make_optimizer(params: Any, args: argparse.Namespace) -> Any:
    import torch

    return torch.optim.SGD(params, lr=args.lr, momentum=0.9)


_CLASSES: tuple[type, type] | None = None


def _classes() -> tuple[type, type]:
    """The TrainModule and the epoch-timer callback, defined on first use (they subclass polytrain's)."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _make_classes()
    return _CLASSES


def _make_classes() -> tuple[type, type]:
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from polytrain import Callback, TrainModule

    class BenchModule(TrainModule):
        def __init__(self, args: argparse.Namespace, dataset: Any) -> None:
            super().__init__()
            self.args = args
            self.dataset = dataset
            self.net = make_net(args)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return make_optimizer(self.parameters(), self.args)

        def train_dataloader(self) -> Any:
            return DataLoader(self.dataset, batch_size=self.args.batch_size, shuffle=True)

    class EpochTimer(Callback):
        """First in the callback list: its epoch start runs before the progress bar is created and
        its epoch end before the loggers flush and the checkpoint is written."""

        def __init__(self) -> None:
            self.inside = 0.0
            self._t0 = 0.0

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self._t0 = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.inside += time.perf_counter() - self._t0

    return BenchModule, EpochTimer


def _lightning_closure(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
    """``--lightning-order``: the step as Lightning's automatic optimisation runs it:
    ``optimizer.step(closure)``, the closure running forward, zero_grad, backward. polytrain keeps this
    order (zero_grad after the forward, before backward) and builds the closure only where something calls
    it: an optimizer such as LBFGS, or a module's ``optimizer_step`` override."""
    import torch.nn.functional as F

    def closure() -> Any:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    return closure


# --------------------------------------------------------------------------- the two variants


def run_polytrain(args: argparse.Namespace, dataset: Any, run_dir: str, strategy: str) -> dict[str, Any]:
    from polytrain import Trainer

    module_class, timer_class = _classes()
    module = module_class(args, dataset)
    timer = timer_class()
    t0 = time.perf_counter()
    trainer = Trainer(strategy=strategy, accelerator="cpu", max_epochs=args.epochs, callbacks=[timer],
                      log_every_n_steps=args.log_every_n_steps, run_dir=run_dir, seed=0,
                      # the hand loop's DistributedSampler order on one process too (same weights)
                      use_distributed_sampler="always")
    t1, c1 = time.perf_counter(), time.process_time()
    trainer.fit(module)
    t2, c2 = time.perf_counter(), time.process_time()
    return {"wall": t2 - t1, "cpu": c2 - c1, "inside": timer.inside, "build": t1 - t0,
            "state": module.net.state_dict()}


def run_hand(args: argparse.Namespace, dataset: Any, run_dir: str, distributed: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler
    from torch.utils.tensorboard import SummaryWriter
    from tqdm.auto import tqdm

    net = make_net(args)
    t0, c0 = time.perf_counter(), time.process_time()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    is_zero = rank == 0
    model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    optimizer = make_optimizer(model.parameters(), args)
    writer = SummaryWriter(os.path.join(run_dir, "tensorboard")) if is_zero else None
    rows: list[dict[str, Any]] = []
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    step = 0
    inside = 0.0
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        e0 = time.perf_counter()
        bar = tqdm(file=sys.stdout, dynamic_ncols=True, smoothing=0, total=len(loader), initial=0,
                   desc=f"Epoch {epoch}", unit="batch") if is_zero else None
        for x, y in loader:
            if getattr(args, "lightning_order", False):
                loss = optimizer.step(_lightning_closure(model, optimizer, x, y))
            else:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % args.log_every_n_steps == 0 and is_zero:
                value = loss.item()
                writer.add_scalar("train/loss", value, step)
                # polytrain's loggers add it, as Lightning's do
                writer.add_scalar("epoch", float(epoch), step)
                rows.append({"step": step, "train/loss": value, "epoch": float(epoch)})
            if bar is not None:
                bar.update(1)
        inside += time.perf_counter() - e0
        if bar is not None:
            bar.close()
        if is_zero:
            writer.flush()
            path = os.path.join(run_dir, "metrics.csv")
            with open(path + ".tmp", "w", newline="", encoding="utf-8") as fh:
                out = csv.DictWriter(fh, fieldnames=["step", "train/loss", "epoch"])
                out.writeheader()
                out.writerows(rows)
            os.replace(path + ".tmp", path)
            os.makedirs(ckpt_dir, exist_ok=True)
            final = os.path.join(ckpt_dir, "last.ckpt")
            with open(final + ".tmp", "wb") as fh:
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1, "step": step}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(final + ".tmp", final)
        if distributed:
            dist.barrier()
    if writer is not None:
        writer.close()
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "inside": inside, "build": 0.0,
            "state": net.state_dict()}


_LIGHTNING: type | None = None


def _lightning_module() -> type:
    """The benchmark module as a ``LightningModule`` (lightning is a dev-only dependency: imported here)."""
    global _LIGHTNING
    if _LIGHTNING is None:
        import lightning.pytorch as pl
        from torch.utils.data import DataLoader, DistributedSampler

        polytrain_module, _ = _classes()

        class BenchLightningModule(pl.LightningModule):
            def __init__(self, args: argparse.Namespace, dataset: Any) -> None:
                super().__init__()
                self.args, self.dataset, self.net = args, dataset, make_net(args)
                self.inside, self._t0 = 0.0, 0.0

            # polytrain's benchmark module's own functions, unchanged: the same user code in both.
            training_step = polytrain_module.training_step
            configure_optimizers = polytrain_module.configure_optimizers

            def train_dataloader(self) -> Any:
                # The hand loop's order (Lightning injects no sampler on one device): same weights.
                sampler = DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
                return DataLoader(self.dataset, batch_size=self.args.batch_size, sampler=sampler)

            # Lightning calls the module's epoch start after the callbacks' (the progress bar is made by then)
            # and its epoch end before the checkpoint callback's: "inside" is the step loop, as polytrain's.
            def on_train_epoch_start(self) -> None:
                self._t0 = time.perf_counter()

            def on_train_epoch_end(self) -> None:
                self.inside += time.perf_counter() - self._t0

        _LIGHTNING = BenchLightningModule
    return _LIGHTNING


def run_lightning(args: argparse.Namespace, dataset: Any, run_dir: str) -> dict[str, Any]:
    """``--lightning``, one process: Lightning's ``Trainer`` with its defaults (progress bar, model summary,
    a checkpoint at each epoch end) and the TensorBoard + CSV loggers, on the hand loop's data order."""
    import logging
    import warnings

    import lightning.pytorch as pl

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # its banner lines, once per fit
    module = _lightning_module()(args, dataset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "consider num_workers", once per fit
        trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, default_root_dir=run_dir,
                             log_every_n_steps=args.log_every_n_steps, use_distributed_sampler=False,
                             logger=[pl.loggers.TensorBoardLogger(run_dir), pl.loggers.CSVLogger(run_dir)])
        t1, c1 = time.perf_counter(), time.process_time()
        trainer.fit(module)
        t2, c2 = time.perf_counter(), time.process_time()
    return {"wall": t2 - t1, "cpu": c2 - c1, "inside": module.inside, "build": 0.0,
            "state": module.net.state_dict()}


# --------------------------------------------------------------------------- rounds


def weights_equal(a: Any, b: Any) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
