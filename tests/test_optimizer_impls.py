"""Every optimizer implementation trains under every strategy exactly like one device.

torch picks an optimizer's implementation per device: a for-loop on CPU, ``foreach`` (one kernel per
group of tensors) on CUDA, ``fused`` on request. foreach and fused take every parameter of a group in
one call, so a strategy that leaves a mix of ``DTensor`` and plain parameters (tensor parallelism used
to: only planned layers were sharded) crashes on CUDA while passing every CPU test. Here each
implementation is asked for explicitly, on CPU, and compared with a plain PyTorch loop on one device
over the same global batches:

- the GPT example (examples/gpt) under tensor parallelism with ``AdamW(foreach=True)`` and
  ``AdamW(fused=True)``, 10 steps; its replicated parameters stay bitwise identical on both ranks, and
  the module called directly after fit (``sample``) gives one device's text;
- {for-loop, foreach, fused} x {SGD with momentum, Adam, AdamW} under single, ddp, fsdp and tensor
  (tp=2), and one of each under tensor x fsdp on 4 ranks;
- clipping by norm (the single-device norm) and by value under tensor parallelism;
- each strategy with CUDA's defaults (``AdamW(params)`` resolving to foreach, as on a GPU);
- sequence parallelism: norms in and out of the plan fed DTensor shards (Partial gradients), an
  ``nn.MultiheadAttention`` and a parameter of the module itself outside the plan;
- checkpoints: tensor mode's sharded directory loads into single, ddp and fsdp, a ddp file into tensor
  mode, and training continues where one uninterrupted run on one device lands.

"Equal" is: losses and optimizer state within 1e-5, weights within 1e-5 except, under Adam, the few
entries whose gradient is rounding noise (see ``noise_only``), within 1e-3. Each world size is one
spawn that runs every job in turn (process start-up dominates).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

from gpt_module import CharGPT  # noqa: E402 - the example, imported from its folder

from polytrain import Callback, TrainModule  # noqa: E402

pytestmark = pytest.mark.torch_api

TOL = {"rtol": 0.0, "atol": 1e-5}
OPTIMIZERS = ("sgd", "adam", "adamw")
IMPLS = ("for-loop", "foreach", "fused")
FULL = dict(d_model=64, n_head=4, n_layer=2, block_size=32, batch_size=16)  # the example's config
TINY = dict(d_model=16, n_head=2, n_layer=1, block_size=8, stride=8, batch_size=8)  # the matrix
MATRIX_STEPS, FULL_STEPS = 3, 10
SEQ = dict(batch_size=8)
SEQ_JOBS = [("adamw", "foreach"), ("sgd", "fused")]
RESUMED = MATRIX_STEPS + 2
CLIP = {"norm": 0.05, "value": 0.002}  # small enough to act on every step


def make_optimizer(params: Any, name: str, impl: str | None) -> torch.optim.Optimizer:
    kwargs = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True},
              None: {}}[impl]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, **kwargs)
    if name == "adam":
        return torch.optim.Adam(params, lr=3e-3, **kwargs)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, **kwargs)


class Recording:
    """The optimizer under test, and each step's loss recorded."""

    optimizer_name: str
    impl: str | None

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.parameters(), self.optimizer_name, self.impl)


class GPT(Recording, CharGPT):
    """The example, unchanged but for the optimizer."""

    def __init__(self, optimizer: str = "adamw", impl: str | None = "foreach", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name, self.impl = optimizer, impl
        self.losses: list[float] = []

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self.net(x), y)


class SeqParallel(Recording, TrainModule):
    """Sequence parallelism: activations between ``down`` and ``up2`` are sequence shards. ``norm`` is in
    the plan (``SequenceParallel``); ``norm2``, outside it, is fed DTensor shards (``use_local_output=
    False``); replicated parameters used on shards get Partial gradients, which must be summed over the
    tp peers. Outside the plan on plain replicated tensors: ``inp``, an ``nn.MultiheadAttention`` (its
    forward reads its child ``out_proj``'s parameters) and ``scale``, a parameter of the module itself
    used in the step."""

    def __init__(self, optimizer: str = "adamw", impl: str | None = "foreach", batch_size: int = 8) -> None:
        super().__init__()
        self.optimizer_name, self.impl, self.batch_size = optimizer, impl, batch_size
        self.losses: list[float] = []
        self.inp, self.mha = nn.Linear(6, 16), nn.MultiheadAttention(16, 2, batch_first=True)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm, self.up2, self.down2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm2, self.head = nn.LayerNorm(16), nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def probe_input(self) -> torch.Tensor:
        return torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5))

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        return {"up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "up2": ColwiseParallel(input_layouts=Shard(1)),
                "down2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.inp(x))
        h = h + self.mha(h, h, h, need_weights=False)[0]
        h = self.norm(self.down(F.gelu(self.up(h))))
        h = self.norm2(self.down2(F.gelu(self.up2(h))))
        return F.mse_loss(self.head(h) * self.scale, y)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, 6, generator=gen)  # (samples, sequence of 4, features)
        return DataLoader(TensorDataset(x, torch.randn(64, 4, 4, generator=gen)), batch_size=self.batch_size,
                          shuffle=True, drop_last=True)


MODELS = {"gpt": GPT, "seq": SeqParallel}


def build(model: str, size: dict[str, Any], optimizer: str, impl: str | None,
          batch_size: int | None = None) -> GPT:
    torch.manual_seed(0)  # every run, on every rank, starts from the same weights
    kwargs = dict(size, batch_size=batch_size or size["batch_size"])
    return MODELS[model](optimizer, impl, **kwargs)


# --------------------------------------------------------------------------- one device, by hand


def reference(model: str, size: dict[str, Any], optimizer: str, impl: str | None, steps: int,
              clip: tuple[str, float] | None = None) -> dict[str, Any]:
    """A plain PyTorch loop on one device over the global batch, in the order the trainer's sampler
    draws it (``DistributedSampler(ds, 1, 0, shuffle=True, seed=0)``)."""
    module = build(model, size, optimizer, impl)
    ds = module.train_dataloader().dataset
    loader = DataLoader(ds, batch_size=size["batch_size"], drop_last=True,
                        sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))
    opt = make_optimizer(module.parameters(), optimizer, impl)
    losses, norms, noisy = [], [], {}
    for step, batch in enumerate(loader):
        if step == steps:
            break
        loss = module.loss(batch)
        loss.backward()
        noise_only(noisy, module, optimizer)
        if clip is not None and clip[0] == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip[1])))
        elif clip is not None:
            torch.nn.utils.clip_grad_value_(module.parameters(), clip[1])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": {k: v.clone() for k, v in module.state_dict().items()},
            "optim": full_optimizer(module, [opt]), "norms": norms, "noise": noisy,
            "sample": direct_call(module)}


def direct_call(module: nn.Module) -> Any:
    """What the module computes when called directly, outside the trainer's step."""
    if hasattr(module, "probe_input"):
        with torch.no_grad():
            return module.mha(*[module.probe_input()] * 3)[0]
    return module.sample("The ", 12)


ADAM_NOISE = 1e-7  # ten times Adam's eps: a gradient this small is of the order of its rounding


def noise_only(noisy: dict[str, torch.Tensor], module: nn.Module, optimizer: str) -> None:
    """Mark the entries whose gradient was, at some step, within rounding noise of zero (0 < |g| < 1e-7; the
    attention's key bias is one: its gradient is zero in exact arithmetic). Adam divides the gradient by
    its own running magnitude, so there it turns a rounding difference of 1e-10 into an update
    difference of up to ~lr: two correct runs that round differently (ddp or tensor parallel against one
    device) disagree on those few entries by ~1e-5..1e-4, while losses and every other entry agree to
    ~1e-7. SGD does not amplify; its runs mark nothing."""
    if optimizer == "sgd":
        return
    for name, param in module.named_parameters():
        tiny = (param.grad != 0) & (param.grad.abs() < ADAM_NOISE)  # exact zeros move nothing, anywhere
        noisy[name] = noisy[name] | tiny if name in noisy else tiny


_REFERENCES: dict[tuple, dict[str, Any]] = {}


def ref(model: str, size: dict[str, Any], optimizer: str, impl: str | None, steps: int,
        clip: tuple[str, float] | None = None) -> dict[str, Any]:
    key = (model, tuple(sorted(size.items())), optimizer, impl, steps, clip)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(model, size, optimizer, impl, steps, clip)
    return _REFERENCES[key]


def full_optimizer(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, full tensors (a collective for DTensor parameters)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(module, optimizers, options=options)
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


# --------------------------------------------------------------------------- through the Trainer

STRATEGIES = {
    "single": "single",
    "ddp": "ddp",
    "fsdp": "fsdp",
    "tensor": {"name": "model_parallel", "mode": "tensor", "tp": 2},
    "tensor_fsdp": {"name": "model_parallel", "mode": "tensor", "tp": 2, "dp_shard": 2},
}


class NormRecorder(Callback):
    """Keeps every norm the step's ``clip_gradients`` returns (the one clipping by norm used)."""

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.norms: list[float] = []
        inner = trainer.strategy.executor.clip_gradients

        def clip_gradients(optimizer: Any, value: float, algorithm: str) -> Any:
            norm = inner(optimizer, value, algorithm)
            if norm is not None:
                self.norms.append(float(norm))
            return norm

        trainer.strategy.executor.clip_gradients = clip_gradients


def _norms(trainer: Any) -> list[float]:
    return next(cb.norms for cb in trainer.callbacks if isinstance(cb, NormRecorder))


def fit(root: str, strategy: str, model: str, size: dict[str, Any], optimizer: str, impl: str | None,
        steps: int, clip: tuple[str, float] | None = None, ckpt: str | None = None, save: str | None = None,
        probe: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train under ``strategy`` (every rank calls) on the same global batch as ``reference``."""
    from polytrain import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // 2 if strategy.startswith("tensor") else world
    module = build(model, size, optimizer, impl, size["batch_size"] // dp)
    name = "-".join(str(p) for p in (strategy, model, optimizer, impl, clip and clip[0], ckpt and "resumed",
                                     steps))
    trainer = Trainer(accelerator="cpu", devices=world, strategy=STRATEGIES[strategy], max_steps=steps,
                      logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, run_dir=os.path.join(root, name), limit_val_batches=0,
                      gradient_clip_val=clip and clip[1], gradient_clip_algorithm=clip[0] if clip else "norm",
                      callbacks=[NormRecorder()],
                      use_distributed_sampler="always",  # the reference's DistributedSampler order on one
                      # rank too
                      timeout=120.0)  # a collective left waiting fails the job in 2 minutes
    trainer.fit(module, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    strat = trainer.strategy
    state = strat.module_state_dict()  # a collective for sharded strategies: the full model on rank 0
    out = {"losses": module.losses, "norms": _norms(trainer), "steps": trainer.global_step,
           "state": {k: v.detach().cpu().clone() for k, v in state.items()} or None,
           "optim": full_optimizer(strat.module, strat.optimizers)}
    if probe is not None:
        out.update(probe(trainer))
    return out


def replicas(trainer: Any) -> dict[str, Any]:
    """How each parameter is laid out, and the local values of the replicated ones (tensor mode)."""
    from torch.distributed.tensor import DTensor

    module = trainer.strategy.module
    params = dict(module.named_parameters())
    return {"sample": direct_call(module),  # after fit, outside the step: the called module's hooks
            "kinds": {n: str(p.placements) if isinstance(p, DTensor) else type(p).__name__
                      for n, p in params.items()},
            "mesh_dims": {n: p.device_mesh.ndim if isinstance(p, DTensor) else 0 for n, p in params.items()},
            "replicas": {n: p.to_local().detach().clone() for n, p in params.items()
                         if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)}}


def cuda_defaults(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()`` with ``torch.optim`` resolving its defaults as on CUDA: an optimizer built without
    ``foreach=``/``fused=`` takes the foreach path. Counts Adam's foreach steps to prove it."""
    import torch.optim.adam as adam_mod
    import torch.optim.optimizer as optimizer_mod

    devices, multi = optimizer_mod._get_foreach_kernels_supported_devices, adam_mod._multi_tensor_adam
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return multi(*args, **kwargs)

    optimizer_mod._get_foreach_kernels_supported_devices = lambda: [*devices(), "cpu"]
    adam_mod._multi_tensor_adam = counted
    try:
        out = run()
    finally:
        optimizer_mod._get_foreach_kernels_supported_devices = devices
        adam_mod._multi_tensor_adam = multi
    return {**out, "foreach_steps": len(calls)}


def two_rank_jobs(root: str) -> list[tuple[tuple, dict[str, Any]]]:
    """``(key, fit keywords)`` for everything the 2-rank spawn runs, in order."""
    jobs: list[tuple[tuple, dict[str, Any]]] = []
    for impl in ("foreach", "fused"):
        jobs.append((("gpt", impl), dict(strategy="tensor", size=FULL, optimizer="adamw", impl=impl,
                                         steps=FULL_STEPS, probe=replicas)))
    for strategy in ("ddp", "fsdp", "tensor"):
        for optimizer in OPTIMIZERS:
            for impl in IMPLS:
                jobs.append(((strategy, optimizer, impl), dict(strategy=strategy, optimizer=optimizer,
                                                               impl=impl)))
        jobs.append(((strategy, "cuda"), dict(strategy=strategy, impl=None, cuda=True)))
    for algorithm, value in CLIP.items():
        jobs.append((("clip", algorithm), dict(strategy="tensor", clip=(algorithm, value))))
    for optimizer, impl in SEQ_JOBS:
        jobs.append((("seq", optimizer, impl), dict(strategy="tensor", model="seq", size=SEQ,
                                                    optimizer=optimizer, impl=impl,
                                                    clip=("value", CLIP["value"]), probe=replicas)))
    # Checkpoints at step 2, resumed to step RESUMED: tensor -> fsdp and ddp here (and -> single in the
    # test's process), ddp -> tensor.
    tp_dir, ddp_file = os.path.join(root, "tensor-step2"), os.path.join(root, "ddp-step2.ckpt")
    jobs += [(("ckpt", "tensor"), dict(strategy="tensor", impl="fused", steps=2, save=tp_dir)),
             (("ckpt", "tensor->fsdp"), dict(strategy="fsdp", steps=RESUMED, ckpt=tp_dir)),
             (("ckpt", "tensor->ddp"), dict(strategy="ddp", steps=RESUMED, ckpt=tp_dir)),
             (("ckpt", "ddp"), dict(strategy="ddp", steps=2, save=ddp_file)),
             (("ckpt", "ddp->tensor"), dict(strategy="tensor", steps=RESUMED, ckpt=ddp_file))]
    return jobs


FOUR_RANK_JOBS = (("sgd", "fused"), ("adam", "for-loop"), ("adamw", None))  # None: CUDA's default, foreach


def four_rank_jobs(root: str) -> list[tuple[tuple, dict[str, Any]]]:
    return [((optimizer, impl), dict(strategy="tensor_fsdp", optimizer=optimizer, impl=impl,
                                     cuda=impl is None, probe=replicas))
            for optimizer, impl in FOUR_RANK_JOBS]


def run_job(root: str, strategy: str, model: str = "gpt", size: dict[str, Any] = TINY,
            optimizer: str = "adamw", impl: str | None = "foreach", steps: int = MATRIX_STEPS,
            cuda: bool = False, **kwargs: Any) -> Any:
    if cuda:
        return cuda_defaults(lambda: fit(root, strategy, model, size, optimizer, impl, steps, **kwargs))
    return fit(root, strategy, model, size, optimizer, impl, steps, **kwargs)


class JobFailed:
    """What a job that raised leaves in the results: its test fails with this traceback, the others run."""

    def __init__(self, text: str) -> None:
        self.text = text


def guarded(job: Callable[[], Any]) -> Any:
    import traceback

    try:
        return job()
    except Exception:  # noqa: BLE001 - reported by the test that reads this job
        return JobFailed(traceback.format_exc())


def worker(rank: int, world_size: int, root: str, jobs: Callable[[str], list]) -> dict[tuple, Any]:
    """Every job in turn; after one raises, the rest are not run (a peer may be stuck in a collective)."""
    out: dict[tuple, Any] = {}
    first_failure = None
    for key, kwargs in jobs(root):
        if first_failure is not None:
            out[key] = JobFailed(f"not run: job {first_failure} raised before it")
            continue
        out[key] = guarded(lambda kw=kwargs: run_job(root, **kw))
        if isinstance(out[key], JobFailed):
            first_failure = key
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("optim2"))
    return {"root": root, "ranks": run_distributed(worker, 2, root, two_rank_jobs, timeout=400.0)}


def runs_of(spawn: dict[str, Any], key: tuple) -> list[dict[str, Any]]:
    runs = [rank[key] for rank in spawn["ranks"]]
    failed = [f"rank {r}:\n{run.text}" for r, run in enumerate(runs) if isinstance(run, JobFailed)]
    if failed:
        pytest.fail(f"job {key} raised\n" + "\n".join(failed), pytrace=False)
    return runs


def global_losses(runs: list[dict[str, Any]]) -> torch.Tensor:
    """The global batch's loss per step: the mean over ranks (data-parallel ranks see equal shares;
    tensor-parallel peers see the same batch, so each data rank weighs alike)."""
    return torch.tensor([r["losses"] for r in runs]).mean(0)


WORST: dict[str, float] = {}  # the largest difference each check saw (printed with -s)


def check(runs: list[dict[str, Any]], reference_run: dict[str, Any], what: str) -> None:
    """Losses, weights and optimizer state equal one device's within 1e-5."""
    losses, want = global_losses(runs), torch.tensor(reference_run["losses"])
    assert_close(losses, want, **TOL, msg=lambda m: f"{what} losses: {m}")
    worst = (losses - want).abs().max().item()
    state, noisy_entries, noisy_worst = runs[0]["state"], 0, 0.0
    assert state.keys() == reference_run["state"].keys(), what
    for name, value in reference_run["state"].items():
        got, value = state[name], value.clone()
        noise = reference_run["noise"].get(name)
        if noise is not None:  # loosely (a wrong layout would be off by O(1)), then strictly the rest
            assert_close(got[noise], value[noise], rtol=0.0, atol=1e-3,
                         msg=lambda m, n=name: f"{what} {n}: {m}")
            noisy_entries += int(noise.sum())
            noisy_worst = (max(noisy_worst, (got[noise] - value[noise]).abs().max().item()) if noise.any()
                           else noisy_worst)
            got, value = got[~noise], value[~noise]
        assert_close(got, value, **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")
        worst = max(worst, (got - value).abs().max().item())
    got, expected = runs[0]["optim"], reference_run["optim"]
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_close(got[key].float(), value.float(), **TOL, msg=lambda m, k=key: f"{what} {k}: {m}")
            worst = max(worst, (got[key].float() - value.float()).abs().max().item())
        elif not key.endswith((".foreach", ".fused")):  # hyperparameters; the implementation may differ
            assert got[key] == value, (what, key)
    WORST[what] = worst
    total = sum(v.numel() for v in state.values())
    print(f"{what}: largest difference {worst:.1e}; {noisy_entries} of {total} weights with rounding-noise "
          f"gradients, largest difference there {noisy_worst:.1e}")


def check_replicas(runs: list[dict[str, Any]], what: str) -> None:
    """Every parameter is a DTensor, and replicated ones hold bitwise the same values on every tp peer."""
    kinds = runs[0]["kinds"]
    assert all(k.startswith("(") for k in kinds.values()), (what, kinds)  # a placements tuple: a DTensor
    assert runs[0]["replicas"], what
    for run in runs[1:]:
        assert run["replicas"].keys() == runs[0]["replicas"].keys(), what
        for name, value in runs[0]["replicas"].items():
            assert torch.equal(run["replicas"][name], value), f"{what}: {name} differs between tp peers"


# --------------------------------------------------------------------------- tests


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_gpt_tensor_parallel_adamw_matches_one_device(two_ranks: dict[str, Any], impl: str) -> None:
    runs = runs_of(two_ranks, ("gpt", impl))
    check_replicas(runs, f"gpt {impl}")
    kinds = runs[0]["kinds"]
    assert (kinds["net.1.attn.qkv.weight"] == "(Shard(dim=0),)"
            and kinds["net.1.attn.proj.weight"] == "(Shard(dim=1),)")
    assert ({"net.0.tok.weight", "net.1.ln1.weight", "net.3.weight", "net.4.weight"}
            <= runs[0]["replicas"].keys())
    reference_run = ref("gpt", FULL, "adamw", impl, FULL_STEPS)
    assert len(runs[0]["losses"]) == FULL_STEPS and reference_run["losses"][-1] < reference_run["losses"][0]
    check(runs, reference_run, f"gpt tensor adamw {impl}")
    assert [r["sample"] for r in runs] == [reference_run["sample"]] * 2  # the module called directly


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "tensor"])
def test_optimizer_implementations_match_one_device(request: pytest.FixtureRequest, tmp_path: Any,
                                                    strategy: str, optimizer: str, impl: str) -> None:
    if strategy == "single":
        runs = [fit(str(tmp_path), "single", "gpt", TINY, optimizer, impl, MATRIX_STEPS)]
    else:
        runs = runs_of(request.getfixturevalue("two_ranks"), (strategy, optimizer, impl))
    check(runs, ref("gpt", TINY, optimizer, impl, MATRIX_STEPS), f"{strategy} {optimizer} {impl}")


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "tensor"])
def test_cuda_default_optimizer_is_foreach_and_trains(request: pytest.FixtureRequest, tmp_path: Any,
                                                      strategy: str) -> None:
    if strategy == "single":
        runs = [cuda_defaults(lambda: fit(str(tmp_path), "single", "gpt", TINY, "adamw", None, MATRIX_STEPS))]
    else:
        runs = runs_of(request.getfixturevalue("two_ranks"), (strategy, "cuda"))
    assert [r["foreach_steps"] for r in runs] == [MATRIX_STEPS] * len(runs)  # AdamW(params) took foreach
    check(runs, ref("gpt", TINY, "adamw", "foreach", MATRIX_STEPS), f"{strategy} with CUDA's defaults")


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("algorithm", list(CLIP))
def test_gradient_clipping_under_tensor_parallel(two_ranks: dict[str, Any], algorithm: str) -> None:
    runs = runs_of(two_ranks, ("clip", algorithm))
    reference_run = ref("gpt", TINY, "adamw", "foreach", MATRIX_STEPS, clip=(algorithm, CLIP[algorithm]))
    check(runs, reference_run, f"tensor clip by {algorithm}")
    if algorithm == "norm":  # the single-device norm, on every rank, and large enough to have clipped
        for run in runs:
            assert_close(torch.tensor(run["norms"]), torch.tensor(reference_run["norms"]), rtol=1e-5,
                         atol=0.0)
        assert min(reference_run["norms"]) > CLIP["norm"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer,impl", SEQ_JOBS)
def test_sequence_parallel_partial_gradients_match_one_device(two_ranks: dict[str, Any], optimizer: str,
                                                              impl: str) -> None:
    runs = runs_of(two_ranks, ("seq", optimizer, impl))
    check_replicas(runs, f"seq {optimizer} {impl}")
    assert {"inp.weight", "mha.in_proj_weight", "mha.out_proj.weight", "norm.weight", "norm2.weight",
            "scale"} <= runs[0]["replicas"].keys()
    reference_run = ref("seq", SEQ, optimizer, impl, MATRIX_STEPS, clip=("value", CLIP["value"]))
    check(runs, reference_run, f"sequence parallel {optimizer} {impl}")
    for run in runs:  # nn.MultiheadAttention called directly after fit
        assert_close(run["sample"], reference_run["sample"], **TOL)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_tensor_parallel_checkpoints_are_portable(two_ranks: dict[str, Any], tmp_path: Any) -> None:
    saved = runs_of(two_ranks, ("ckpt", "tensor"))
    check(saved, ref("gpt", TINY, "adamw", "fused", 2), "tensor at step 2 (saved)")
    whole = ref("gpt", TINY, "adamw", "foreach", RESUMED)
    tail = {**whole, "losses": whole["losses"][2:]}
    single = fit(str(tmp_path), "single", "gpt", TINY, "adamw", "foreach", RESUMED,
                 ckpt=os.path.join(two_ranks["root"], "tensor-step2"))
    for what, runs in [("tensor dir -> single", [single]),
                       ("tensor dir -> fsdp", runs_of(two_ranks, ("ckpt", "tensor->fsdp"))),
                       ("tensor dir -> ddp", runs_of(two_ranks, ("ckpt", "tensor->ddp"))),
                       ("ddp file -> tensor", runs_of(two_ranks, ("ckpt", "ddp->tensor")))]:
        assert [r["steps"] for r in runs] == [RESUMED] * len(runs), what
        check(runs, tail, what)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_tensor_x_fsdp_on_four_ranks_matches_one_device(tmp_path: Any) -> None:
    ranks = run_distributed(worker, 4, str(tmp_path), four_rank_jobs, timeout=400.0)
    for optimizer, impl in FOUR_RANK_JOBS:
        runs = runs_of({"ranks": ranks}, (optimizer, impl))
        assert set(runs[0]["mesh_dims"].values()) == {2}  # FSDP over dp on top of tp: all 2-D DTensors
        assert runs[0]["kinds"]["net.0.tok.weight"] == "(Shard(dim=0), Replicate())"  # outside the plan
        if impl is None:
            assert [r["foreach_steps"] for r in runs] == [MATRIX_STEPS] * 4
        check(runs, ref("gpt", TINY, optimizer, impl or "foreach", MATRIX_STEPS),
              f"tp x fsdp {optimizer} {impl}")
