"""``ParallelDims``: every parallel degree of a job, and the device mesh built from them, in one object.

Built once from the config (``polytrain.strategies.registry.build_strategy`` hands it to the
strategy), it is the single source of truth for the topology: ``dp_rank``/``dp_size``,
``tp_rank``, ``pp_rank``, ``cp_rank`` come from here and nowhere else, computed from the global
rank the same way ``init_device_mesh`` lays ranks out, so they are known before any process group
exists and agree with the mesh once it does.

Dimension order (outermost first) is ``pp, dp_replicate, dp_shard, cp, tp`` (torchtitan's): tensor
parallel ranks are neighbours (on a GPU node they share NVLink), context parallel next, pipeline
stages furthest apart. The data-parallel group (the sampler's split, metric reduction) is
``dp_replicate x dp_shard``; ranks of one tp/cp/pp group see the same batch. FSDP shards over
``dp_shard x cp`` (context-parallel ranks hold the same parameters and reduce their gradients
together) and replicates over ``dp_replicate`` (HSDP).

Mesh names for ``get_mesh``: the five dimensions, plus the flattened ``dp`` (replicate x shard),
``dp_shard_cp`` and ``dp_cp``, and ``fsdp``: the mesh ``fully_shard`` takes (1-D ``dp_shard_cp``,
or 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP).

Expert parallel (``ep``) is not a factor of the world size: it **borrows** the data-parallel ranks, as
torchtitan and transformers count it. ``ep`` divides ``dp = dp_replicate x dp_shard``; consecutive
data-parallel ranks (same pp, cp and tp coordinates) form an expert group that splits the experts, and the
``dp / ep`` groups hold the same experts, which FSDP shards over (``efsdp``). The expert meshes come from a
second root mesh ``(pp, edp, ep, cp, tp)`` over the same ranks: ``dp = edp x ep`` splits the
data-parallel index exactly as the main mesh lays it out, so a rank's batch is the same under both views.
Names: ``ep`` (the all-to-all group) and ``efsdp`` (the experts' FSDP mesh).
"""

from __future__ import annotations

import atexit
import gc
import math
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from polytrain.core.errors import ConfigError

DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # mesh order, outermost first
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}

# Meshes built in this process, by device type and degrees, with the default process group they were built
# over: the next Trainer of the job (a sweep, fit after fit in a notebook) reuses one instead of every rank
# creating the subgroups again (each size-1 dimension still gets its groups). Every rank builds the same
# Trainers in the same order, so every rank hits or misses together.
# Forgotten by release_mesh (teardown) and before the interpreter exits (see release_mesh for why).
_BUILT: dict[tuple[Any, ...], tuple[Any, Any, dict[str, Any]]] = {}


def _forget_built_meshes() -> None:
    if _BUILT:
        _BUILT.clear()
        gc.collect()  # the groups' C++ objects go now, while the interpreter is whole


atexit.register(_forget_built_meshes)


def check_ep_composes(ep: int, pp: int, cp: int) -> None:
    """The degrees expert parallel does not compose with (known before the world size is)."""
    if ep > 1 and cp > 1:
        raise ConfigError(f"ep={ep} with cp={cp}: expert parallel does not compose with context parallel "
                          f"here; use cp=1, or ep=1")
    if ep > 1 and pp > 1:
        # A pipeline learns each stage's output shapes on the meta device, where a router's data-dependent
        # choice of experts cannot run; and a model's auxiliary loss, computed from every layer's router
        # outputs at the end, would see only the last stage's layers.
        raise ConfigError(f"ep={ep} with pp={pp}: expert parallel does not compose with a pipeline here (its "
                          f"stages are traced on the meta device, which a router's data-dependent routing "
                          f"cannot run); use pp=1 with ep, or ep=1")


@dataclass
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the other degrees leave of the world (any ONE degree may be -1)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    rank: int = 0  # this process's global rank: fixes its coordinates on every dimension
    ep: int = 1  # expert parallel: divides dp_replicate x dp_shard (borrowed from them, not a mesh factor)
    # Set by build_mesh (declared here so every mesh the strategy uses has a name and a type).
    mesh: Any = field(default=None, init=False, repr=False, compare=False)
    meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        inferred = [n for n in DEGREES if getattr(self, n) == -1]
        if len(inferred) > 1:
            raise ConfigError(f"only one parallel degree may be -1 (inferred from the world size), got "
                              f"{', '.join(f'{n}=-1' for n in inferred)} ({self._numbers()})")
        for name in DEGREES:
            value = getattr(self, name)
            if value < 1 and value != -1:
                raise ConfigError(f"parallel degree {name}={value} must be >= 1 or -1 ({self._numbers()})")
        if inferred:
            name = inferred[0]
            others = [n for n in ("dp_replicate", "dp_shard", "tp", "pp", "cp")
                      if n != name and (n == "dp_replicate" or getattr(self, n) != 1)]
            rest = math.prod(getattr(self, n) for n in DEGREES if n != name)
            if self.world_size % rest:
                shown = " x ".join(f"{n}={getattr(self, n)}" for n in others)
                raise ConfigError(f"cannot infer {name}: world_size={self.world_size} is not divisible by "
                                  f"{shown} = {rest}")
            setattr(self, name, self.world_size // rest)
        product = math.prod(getattr(self, n) for n in DEGREES)
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees do not multiply to the world size: "
                f"{' x '.join(f'{n}={getattr(self, n)}' for n in DEGREES)} = {product}, but "
                f"world_size={self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size={self.world_size}")
        self._check_ep()

    def _check_ep(self) -> None:
        if self.ep < 1:
            raise ConfigError(f"parallel degree ep={self.ep} must be >= 1 ({self._numbers()})")
        if self.dp_size % self.ep:
            raise ConfigError(
                f"ep={self.ep} must divide the data-parallel ranks dp_replicate x dp_shard = "
                f"{self.dp_replicate} x {self.dp_shard} = {self.dp_size}: expert parallel borrows them "
                f"(it is not a factor of world_size={self.world_size}); use an ep that divides "
                f"{self.dp_size}")
        check_ep_composes(self.ep, self.pp, self.cp)

    def _numbers(self) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)}" for n in DEGREES)
        return f"world_size={self.world_size}, {shown}" + (f", ep={self.ep}" if self.ep != 1 else "")

    # ------------------------------------------------------------------ degrees
    @property
    def dp_size(self) -> int:
        """Data-parallel replicas that see different data: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks one FSDP group shards parameters over: ``dp_shard x cp``."""
        return self.dp_shard * self.cp

    @property
    def edp_size(self) -> int:
        """Data-parallel ranks holding the same experts (FSDP shards the experts over them): ``dp / ep``."""
        return self.dp_size // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def degrees(self) -> list[tuple[str, int]]:
        """Named dimensions of the mesh, outermost first; degree-1 dims are kept (cheap, uniform)."""
        return [(n, getattr(self, n)) for n in DEGREES]

    # ------------------------------------------------------------------ this rank
    def coordinates(self, rank: int | None = None) -> dict[str, int]:
        """``rank``'s index on every dimension: row-major over ``DEGREES``, as ``init_device_mesh``
        lays out ``arange(world_size)``."""
        rank = self.rank if rank is None else rank
        coords = {}
        for name, size in reversed(self.degrees()):
            rank, coords[name] = divmod(rank, size)
        return coords

    @property
    def dp_rank(self) -> int:
        c = self.coordinates()
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    @property
    def ep_rank(self) -> int:
        """Which slice of the experts this rank holds."""
        return self.dp_rank % self.ep

    @property
    def tp_rank(self) -> int:
        return self.coordinates()["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coordinates()["pp"]

    @property
    def cp_rank(self) -> int:
        return self.coordinates()["cp"]

    def group_ranks(self, name: str, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s group along dimension(s) ``name`` (a degree or a flattened name)."""
        along = FLATTENED.get(name, (name,))
        coords = self.coordinates(rank)
        ranks = []
        for r in range(self.world_size):
            other = self.coordinates(r)
            if all(other[n] == coords[n] for n in DEGREES if n not in along):
                ranks.append(r)
        return ranks

    # ------------------------------------------------------------------ meshes
    def build_mesh(self, device_type: str) -> Any:
        """The N-D ``DeviceMesh`` and its flattened sub-meshes (every rank calls this, once)."""
        if self.mesh is not None:
            return self.mesh
        names = tuple(n for n in DEGREES)
        key = (device_type, tuple(getattr(self, n) for n in names), self.ep)
        world = dist.group.WORLD
        built = _BUILT.get(key)
        if built is not None and built[0] is world:  # the same process group still: its subgroups live
            self.mesh, self.meshes = built[1], dict(built[2])
            return self.mesh
        self.mesh = init_device_mesh(device_type, key[1], mesh_dim_names=names)
        self.meshes = {n: self.mesh[n] for n in names}
        for flat, parts in FLATTENED.items():
            # Flattened here, once: slicing a flattened dimension back out of the root mesh is deprecated.
            self.meshes[flat] = self.mesh[parts]._flatten(flat)
        shard = self.meshes["dp_shard"] if self.cp == 1 else self.meshes["dp_shard_cp"]
        if self.dp_replicate > 1:
            parts = ("dp_replicate", "dp_shard") if self.cp == 1 else ("dp_replicate", "dp_shard_cp")
            self.meshes["fsdp"] = self.mesh[parts]
        else:
            self.meshes["fsdp"] = shard
        if self.ep > 1:
            self.meshes.update(self._expert_meshes(device_type))
        _BUILT[key] = (world, self.mesh, dict(self.meshes))
        return self.mesh

    def _expert_meshes(self, device_type: str) -> dict[str, Any]:
        """``ep`` and ``efsdp`` as dimensions of one root mesh: FSDP takes an expert tensor already sharded
        over ``ep`` only when both meshes share their root, and lays out ``(efsdp, ep)`` from it."""
        shape = (self.pp, self.edp_size, self.ep, self.cp, self.tp)
        experts = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        return {"ep": experts["ep"], "efsdp": experts["edp"]}

    def release_mesh(self) -> None:
        """Forget the mesh once its process groups are destroyed. A ``DeviceMesh`` keeps its groups' C++
        objects alive; left until interpreter exit, gloo's worker threads are torn down during
        finalisation and the process aborts ("terminate called without an active exception", about 1
        run in 10 on torch 2.11). A later ``build_mesh`` builds it afresh."""
        self.mesh, self.meshes = None, {}
        _BUILT.clear()

    def get_mesh(self, name: str) -> Any:
        """The (sub-)mesh called ``name``; raises if the mesh is not built or the name is unknown."""
        if self.mesh is None:
            raise RuntimeError(f"the device mesh is not built yet (asked for '{name}'): "
                               f"the strategy builds it when it joins the process group")
        if name not in self.meshes:
            raise KeyError(f"no mesh named '{name}'; known: {', '.join(self.meshes)}")
        return self.meshes[name]
