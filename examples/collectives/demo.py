"""Point-to-point messages and collectives through a polytrain strategy, one demo after another.

    python -m torch.distributed.run --standalone --nproc_per_node=2 examples/collectives/demo.py
    (options: --config PATH, --only all_reduce,scatter)

Every rank prints one line per result: ``[rank R] <demo>: <value>``. Ranks and the rendezvous come
from torchrun's environment; the script never sets an address, a port or a rank itself.

Point-to-point calls are meant to differ by rank (one side sends, the other receives). Collectives
are not: every rank makes the same collective call in the same order, and only the arguments
(what to scatter, which rank is the destination) depend on the rank.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import yaml

from polytrain import connect


def say(strategy, demo: str, value) -> None:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    # One write() per line: both ranks share the terminal (or pipe), and print() may issue the text
    # and its newline as two writes that the other rank's line can slip between.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"[rank {strategy.global_rank}] {demo}: {value}\n".encode())


def send_recv(strategy) -> None:
    """Blocking: rank 0 adds one to a zero tensor and sends it; rank 1 waits until it arrives."""
    tensor = torch.zeros(1)
    if strategy.global_rank == 0:
        tensor += 1
        strategy.send(tensor, dst=1)
    elif strategy.global_rank == 1:
        strategy.recv(tensor, src=0)  # rank 1 allocated `tensor` itself; recv fills it
    say(strategy, "send_recv", tensor)


def isend_irecv(strategy) -> None:
    """Non-blocking: the calls return at once; the data is there only after ``wait()``."""
    tensor = torch.zeros(1)
    request = None
    if strategy.global_rank == 0:
        tensor += 1
        request = strategy.isend(tensor, dst=1)  # do not touch `tensor` until the request completes
    elif strategy.global_rank == 1:
        request = strategy.irecv(tensor, src=0)  # reading `tensor` here could still show 0.0
    if request is not None:
        request.wait()
    say(strategy, "isend_irecv", tensor)


def all_reduce(strategy) -> None:
    """Sum of (rank + 1) over an explicit group of every rank: 1 + 2 = 3 on 2 ranks, on every rank."""
    group = dist.new_group(list(range(strategy.world_size)))  # itself a collective: every rank calls it
    tensor = torch.tensor([strategy.global_rank + 1.0])
    strategy.all_reduce(tensor, "sum", group=group)
    say(strategy, "all_reduce", tensor)
    dist.destroy_process_group(group)


def broadcast(strategy) -> None:
    """Rank 0's tensor is copied to every rank."""
    tensor = torch.tensor([42.0]) if strategy.global_rank == 0 else torch.zeros(1)
    say(strategy, "broadcast", strategy.broadcast(tensor, src=0))


def reduce(strategy) -> None:
    """Like all_reduce, but only the destination rank is guaranteed to hold the sum."""
    dst = strategy.world_size - 1
    result = strategy.reduce(torch.tensor([strategy.global_rank + 1.0]), op="sum", dst=dst)
    say(strategy, "reduce", result if strategy.global_rank == dst else "(not the destination)")


def all_gather(strategy) -> None:
    """Every rank ends up with every rank's tensor, stacked in rank order."""
    say(strategy, "all_gather", strategy.all_gather(torch.tensor([strategy.global_rank * 10.0])))


def gather(strategy) -> None:
    """Rank 0 collects every rank's tensor; the others get None."""
    gathered = strategy.gather(torch.tensor([strategy.global_rank * 10.0]), dst=0)
    say(strategy, "gather", [t.item() for t in gathered] if gathered is not None else None)


def scatter(strategy) -> None:
    """Rank 0 holds one chunk per rank; rank i receives chunk i."""
    chunks = None
    if strategy.global_rank == 0:
        chunks = [torch.tensor([100.0 + i]) for i in range(strategy.world_size)]
    say(strategy, "scatter", strategy.scatter(torch.zeros(1), chunks, src=0))


DEMOS = {fn.__name__: fn for fn in (send_recv, isend_irecv, all_reduce, broadcast, reduce, all_gather, gather,
                                     scatter)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config",
                        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.yaml"))
    parser.add_argument("--only", default=None,
                        help="comma-separated demo names (default: the config's list)")
    args = parser.parse_args()
    with open(args.config, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    names = args.only.split(",") if args.only else cfg.get("demos", list(DEMOS))
    unknown = [n for n in names if n not in DEMOS]
    if unknown:
        raise SystemExit(f"unknown demo(s) {unknown}; valid: {', '.join(DEMOS)}")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("run under a launcher with at least 2 processes, e.g.\n"
                         "  python -m torch.distributed.run --standalone --nproc_per_node=2 " + __file__)

    strategy = connect(cfg.get("strategy", "ddp"), accelerator=cfg.get("accelerator", "cpu"),
                       timeout=float(cfg.get("timeout", 60)))
    try:
        for name in names:
            DEMOS[name](strategy)
            strategy.barrier()  # keeps each demo's lines together in the output
    finally:
        strategy.teardown()


if __name__ == "__main__":
    main()
