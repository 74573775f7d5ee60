"""Deciding how many worker processes a job needs, and starting them.

Three ways in: the job is already a worker (torchrun, SLURM, our own launchers set RANK etc.);
the CLI or a script starts workers through torch's elastic agent (the same one torchrun uses,
so restarts and failure summaries behave identically); or ``launcher: spawn``/``fork`` for
notebooks, via ``torch.multiprocessing``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from polytrain.core.environment import ClusterEnvironment, detect_environment
from polytrain.core.errors import ConfigError
from polytrain.core.nodes import is_elastic_range, node_range
from polytrain.core.process_group import select_cuda_devices
from polytrain.core.worker_failure import (
    SCRIPT_WORKER_ENV,
    config_error_said,
    failure_report,
    quiet_agent_logs,
    root_cause,
)
from polytrain.strategies.registry import resolve_strategy_name, strategy_class

log = logging.getLogger("polytrain")

SINGLE_PROCESS_STRATEGIES = ("single", "dp")  # strategies that cannot use a second process
OVERSUBSCRIBE_ENV = "POLYTRAIN_OVERSUBSCRIBE"  # =1: allow more CPU processes than cores


class LaunchRequest(Protocol):
    """What launching reads from a job's configuration (``TrainerConfig`` has these fields)."""

    accelerator: str
    devices: Any  # "auto", a positive int, or a list of GPU indices
    num_nodes: Any  # a count, or a "MIN:MAX" range (elastic)
    strategy: Any  # the validated strategy mapping, or a Strategy instance
    launcher: str


@dataclass(frozen=True)
class LaunchPlan:
    accelerator: str
    devices: int
    num_nodes: int
    strategy_name: str
    processes_per_node: int
    env: ClusterEnvironment
    method: str  # "here" (this process is a worker) | "elastic" | "spawn" | "fork"
    node_range: tuple[int, int] | None = None  # num_nodes "MIN:MAX": c10d rendezvous admitting MIN..MAX nodes

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.num_nodes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _resolve_accelerator(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if name == "gpu" else name


def _resolve_device_list(devices: list[int], accelerator: str) -> int:
    """``devices=[i, j]`` (Lightning's GPU indices): one process per listed GPU, local rank r on
    ``cuda:devices[r]``."""
    if accelerator != "cuda":
        raise ConfigError(f"trainer.devices={devices} is a list of GPU indices, but the accelerator is "
                          f"{accelerator!r}; on CPU give a number of processes, e.g. devices={len(devices)}")
    count = torch.cuda.device_count()
    if len(set(devices)) != len(devices) or any(i < 0 or i >= count for i in devices):
        raise ConfigError(f"trainer.devices={devices}: list distinct GPU indices below {count} (the GPUs "
                          f"visible here are cuda:0..cuda:{count - 1})")
    return len(devices)


def _resolve_devices(devices: Any, accelerator: str, env: ClusterEnvironment) -> int:
    if isinstance(devices, (list, tuple)):
        return _resolve_device_list(list(devices), accelerator)
    available = torch.cuda.device_count() if accelerator == "cuda" else (os.cpu_count() or 1)
    if accelerator == "cuda" and available == 0:
        raise ConfigError(f"trainer.accelerator=cuda but torch sees no GPU here (torch {torch.__version__}, "
                          f"torch.cuda.device_count() is 0); set trainer.accelerator=cpu (or auto), or run "
                          f"where a GPU and a CUDA build of torch are")
    if devices == "auto":
        if env.is_distributed:
            return env.local_world_size
        return max(1, torch.cuda.device_count()) if accelerator == "cuda" else 1
    # Under a launcher the processes exist already: plan_launch names a disagreement with them as such.
    if devices > available and not env.is_distributed:
        if accelerator == "cuda":
            raise ConfigError(f"trainer.devices={devices} but only {available} GPU(s) are visible; set "
                              f"trainer.devices to at most {available}")
        if os.environ.get(OVERSUBSCRIBE_ENV, "") not in ("", "0"):
            return devices  # asked for on purpose: the processes share the cores
        raise ConfigError(f"trainer.devices={devices} CPU processes but only {available} CPU cores are "
                          f"available; set trainer.devices to at most {available}, or set "
                          f"{OVERSUBSCRIBE_ENV}=1 in the environment to start {devices} processes on "
                          f"{available} cores anyway (each slower)")
    return devices


def _interactive() -> bool:
    return hasattr(sys, "ps1") or "ipykernel" in sys.modules or not sys.argv or sys.argv[0] in ("", "-c")


def _nodes_here(cfg: LaunchRequest, env: ClusterEnvironment, per_node: int, name: str) -> int:
    """Under a launcher with ``num_nodes: "MIN:MAX"``: how many nodes this rendezvous admitted."""
    low, high = node_range(cfg.num_nodes)
    nodes, extra = divmod(env.world_size, per_node)
    if extra or not low <= nodes <= high:
        raise ConfigError(
            f"the launcher started {env.world_size} processes but trainer.num_nodes={cfg.num_nodes!r} with "
            f"{per_node} process(es) per node (strategy '{name}') allows "
            f"{low * per_node}..{high * per_node}; start every node with {per_node} process(es) and "
            f"--nnodes={low}:{high}, or widen the range")
    return nodes


def plan_launch(cfg: LaunchRequest) -> LaunchPlan:
    env = detect_environment()
    accelerator = _resolve_accelerator(cfg.accelerator)
    devices = _resolve_devices(cfg.devices, accelerator, env)
    select_cuda_devices(list(cfg.devices) if isinstance(cfg.devices, (list, tuple)) else None)
    spec = (cfg.strategy if isinstance(cfg.strategy, dict)
            else {"name": getattr(cfg.strategy, "name", "custom")})
    name = spec["name"]
    low, high = node_range(cfg.num_nodes)
    elastic = is_elastic_range(cfg.num_nodes)
    if name == "auto":
        name = resolve_strategy_name("auto", env.world_size if env.is_distributed else devices * high)
    options = spec if isinstance(cfg.strategy, dict) else getattr(cfg.strategy, "options", None)
    per_node = strategy_class(name).processes_per_node(devices, options) if name != "custom" else devices
    launched = env.source != "none"  # a worker already (even alone, WORLD_SIZE=1, after losing nodes)
    if elastic and launched:
        low = high = _nodes_here(cfg, env, per_node, name)
    wanted = per_node * low
    if env.is_distributed and name in SINGLE_PROCESS_STRATEGIES:
        # Each process would train its own replica on the whole dataset, never exchanging a gradient:
        # refuse before anything is built.
        raise ConfigError(
            f"strategy '{name}' trains in one process, but the launcher ({env.source}) started "
            f"{env.world_size} processes (WORLD_SIZE={env.world_size}): each would train its own "
            f"unsynchronised replica. Use strategy: ddp (or auto) for {env.world_size} processes, or launch "
            f"one process (e.g. torchrun --nproc_per_node=1)"
            f"{' and let dp drive the GPUs' if name == 'dp' else ''}"
        )
    if env.is_distributed:
        if cfg.devices != "auto" and env.world_size != wanted:
            raise ConfigError(
                f"the launcher started {env.world_size} processes but trainer.devices={devices} x "
                f"num_nodes={cfg.num_nodes} asks for {wanted} with strategy '{name}'; make them agree "
                f"(or set trainer.devices=auto)"
            )
        method = "here"
    elif elastic:
        method = "here" if launched else _elastic_method(cfg, per_node, low, high)
    elif wanted == 1:
        method = "here"
    elif cfg.launcher == "none":
        raise ConfigError(f"this job needs {wanted} processes but trainer.launcher='none'; start it with "
                          f"torchrun --nproc_per_node={per_node} or choose launcher auto/elastic/spawn")
    elif cfg.launcher == "auto":
        method = "fork" if _interactive() else "elastic"
    else:
        method = cfg.launcher
    return LaunchPlan(accelerator, devices, low, name, per_node, env, method,
                      (low, high) if elastic and not launched else None)


def _elastic_method(cfg: LaunchRequest, per_node: int, low: int, high: int) -> str:
    """``num_nodes: "MIN:MAX"`` outside a launcher: only torch's elastic agent can admit and lose nodes."""
    if cfg.launcher not in ("auto", "elastic"):
        raise ConfigError(f"trainer.num_nodes={cfg.num_nodes!r} (elastic, {low} to {high} nodes) needs the "
                          f"elastic launcher, but trainer.launcher={cfg.launcher!r}; set "
                          f"trainer.launcher=auto (or elastic), or start each node with torchrun "
                          f"--nnodes={low}:{high} --nproc_per_node={per_node}")
    return "elastic"


# A function's workers are forked from a server that has imported torch, what every worker imports next
# (torch.optim pulls in torch._dynamo) and the function's own module once, where a fresh interpreter per
# worker would repeat those imports: seconds of CPU each (docs/performance.md). The server is a fresh
# interpreter itself, started when the first worker is, with this process's environment (OMP_NUM_THREADS
# set by _launch_config is what its OpenMP runtime reads); none of these imports touches CUDA, so each
# worker initialises its own device as a spawned one would. "__main__" first, as spawn imports it too.
WORKER_START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
WORKER_PRELOAD = ("__main__", "torch", "torch.distributed", "torch.optim", "torch._dynamo",
                  "polytrain.trainer.trainer")


def _launch_config(plan: LaunchPlan, max_restarts: int) -> Any:
    # Without this, the first restart after rank 0 dies cannot rendezvous on gloo (the store
    # lived in the dead worker).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # As torchrun does: N workers each using every core would oversubscribe the CPU N-fold.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.processes_per_node)))
    if plan.node_range is not None:
        return _elastic_range_config(plan, max_restarts)
    if plan.num_nodes > 1:
        addr = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        node_rank = os.environ.get("NODE_RANK")
        if not (addr and port and node_rank is not None):
            raise ConfigError("num_nodes > 1: set MASTER_ADDR, MASTER_PORT and NODE_RANK on every node "
                              "(or start each node with torchrun --nnodes/--node_rank)")
        rdzv = dict(rdzv_backend="static", rdzv_endpoint=f"{addr}:{port}",
                    rdzv_configs={"rank": int(node_rank), "timeout": 900})
    else:
        rdzv = dict(rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                    rdzv_configs={"timeout": 900})
    return LaunchConfig(
        min_nodes=plan.num_nodes, max_nodes=plan.num_nodes, nproc_per_node=plan.processes_per_node,
        run_id=f"polytrain-{uuid.uuid4().hex[:8]}", max_restarts=max_restarts, monitor_interval=0.1,
        start_method=WORKER_START_METHOD, **rdzv,
    )


# torchrun's --rdzv-conf for num_nodes "MIN:MAX", e.g. last_call_timeout=5
RDZV_CONF_ENV = "POLYTRAIN_RDZV_CONF"
RUN_ID_ENV = "POLYTRAIN_RUN_ID"  # the rendezvous id every node of one job shares


def rdzv_conf(text: str) -> dict[str, Any]:
    """``key=value,key=value`` (torchrun's --rdzv-conf syntax) as rendezvous options; numbers become ints."""
    conf: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{RDZV_CONF_ENV}={text!r}: {item!r} is not key=value; write e.g. "
                              f"{RDZV_CONF_ENV}=last_call_timeout=5,join_timeout=900")
        conf[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return conf


def _elastic_range_config(plan: LaunchPlan, max_restarts: int) -> Any:
    """``num_nodes: "MIN:MAX"``: every node's agent joins one c10d rendezvous at MASTER_ADDR:MASTER_PORT;
    the agent hosting it (the one on MASTER_ADDR started first) must live as long as the job."""
    low, high = plan.node_range or (plan.num_nodes, plan.num_nodes)
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        raise ConfigError(f"num_nodes={low}:{high} (elastic): set MASTER_ADDR and MASTER_PORT to the same "
                          f"host:port on every node (the rendezvous endpoint; no NODE_RANK needed)")
    configs = {"timeout": 900, **rdzv_conf(os.environ.get(RDZV_CONF_ENV, ""))}
    run_id = os.environ.get(RUN_ID_ENV) or os.environ.get("SLURM_JOB_ID") or f"polytrain-{port}"
    return LaunchConfig(
        min_nodes=low, max_nodes=high, nproc_per_node=plan.processes_per_node, run_id=run_id,
        max_restarts=max_restarts, monitor_interval=0.1, start_method=WORKER_START_METHOD,
        rdzv_backend="c10d", rdzv_endpoint=f"{addr}:{port}", rdzv_configs=configs,
    )


def launch_elastic(plan: LaunchPlan, entrypoint: Callable | str, args: tuple, max_restarts: int = 0) -> Any:
    """Run ``entrypoint(*args)`` (a function, or a program path) in every worker via the elastic agent.

    Raises ``ChildFailedError`` naming the first failing rank and its traceback when a worker fails
    and restarts are exhausted; survivors are stopped by the agent.
    """
    config = _launch_config(plan, max_restarts)
    if callable(entrypoint) and WORKER_START_METHOD == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload([*WORKER_PRELOAD, entrypoint.__module__])
    return elastic_launch(config, entrypoint)(*args)


def relaunch_script(plan: LaunchPlan, max_restarts: int, stage: str,
                    when_stopped: Callable[[], list[str]] | None = None) -> None:
    """Python API outside torchrun: run this same script again in each worker, like torchrun would,
    and leave with the job's status. The launching process itself does not train. A worker's error nothing
    catches goes to the agent's error file (``report_uncaught_to_launcher``), and is printed here once: the
    failing rank's traceback, short, then the one line that names it. Stopped by Ctrl-C or SIGTERM (the
    agent ends the workers): one line, ``when_stopped()``'s lines after it, and the shell's code for the
    signal (130, 143)."""
    script = os.path.abspath(sys.argv[0])
    os.environ[SCRIPT_WORKER_ENV] = "1"  # the workers inherit it: this process only launches them
    if max_restarts == 0:
        quiet_agent_logs()
    try:
        launch_elastic(plan, sys.executable, ("-u", script, *sys.argv[1:]), max_restarts)
    except (KeyboardInterrupt, SignalException) as err:
        signum = int(getattr(err, "sigval", signal.SIGINT))
        print(f"polytrain: {stage} stopped by {signal.Signals(signum).name}; its processes have ended",
              file=sys.stderr)
        for line in when_stopped() if when_stopped is not None else []:
            print(f"polytrain: {line}", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    except ChildFailedError as err:
        said = config_error_said(root_cause(err))
        if said is not None:  # said as the launcher says its own
            print(f"polytrain {stage}: {said}", file=sys.stderr)
            raise SystemExit(2) from None
        print(failure_report(err), file=sys.stderr)
        print(f"polytrain: {stage} failed on {root_cause(err)}", file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _spawned_worker(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    fn(*args)


SPAWN_ATTEMPTS = 3  # a rendezvous port taken by another job between choosing and binding it: try another


def port_taken(error: BaseException | str) -> bool:
    """Whether a worker failed because the rendezvous port was already in use (rank 0's store could not
    bind it): the job never got past joining its process group."""
    text = str(error).lower()
    return "eaddrinuse" in text or "address already in use" in text


def launch_spawn(plan: LaunchPlan, fn: Callable, args: tuple) -> None:
    """``torch.multiprocessing`` start (spawn or fork); an exception in any worker is re-raised here
    with that worker's traceback after the others are terminated. The rendezvous port is free when
    chosen, but another program may take it before rank 0 binds it: then the job starts again on
    another port (nothing of it ran past joining the process group)."""
    if plan.num_nodes > 1:
        raise ConfigError("launcher 'spawn'/'fork' starts processes on this machine only; use torchrun or "
                          "the elastic launcher for num_nodes > 1")
    for attempt in range(1, SPAWN_ATTEMPTS + 1):
        port = free_port()
        try:
            mp.start_processes(_spawned_worker, args=(plan.world_size, port, fn, args),
                               nprocs=plan.world_size, join=True, start_method=plan.method)
            return
        except mp.ProcessRaisedException as err:
            if attempt == SPAWN_ATTEMPTS or not port_taken(err):
                raise
            log.warning("rendezvous port %d was taken before the workers bound it; starting again on another "
                        "(attempt %d of %d)", port, attempt + 1, SPAWN_ATTEMPTS)
