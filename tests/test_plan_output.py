"""``polytrain plan`` draws each layout's per-rank memory by term as a bar of a device's memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.parallel.planner.estimate import Estimate
from polytrain.parallel.planner.search import BAR_WIDTH, Layout, Plan, format_table, memory_bar

pytestmark = pytest.mark.own_logic

GiB = 1024**3


def test_the_bar_draws_each_term_in_proportion_to_the_device() -> None:
    memory = {"params": 10, "grads": 10, "optimizer": 20, "fsdp_buffers": 0, "activations": 40,
              "transients": 10}
    assert memory_bar(memory, capacity=100, width=10) == "PGOOAAAAT."
    assert (memory_bar({**memory, "activations": 500}, capacity=100, width=10)
            == "PGOOAAAAAA")  # capped at the width
    assert memory_bar({"params": 0}, capacity=100, width=10) == ".........."


def test_the_table_shows_the_bars_and_their_legend() -> None:
    memory = {"params": 8 * GiB, "grads": 8 * GiB, "optimizer": 16 * GiB, "fsdp_buffers": 4 * GiB,
              "activations": 20 * GiB, "transients": 4 * GiB}
    est = Estimate(Layout(dp_shard=8), memory, {"compute": 1.0}, 1.0, 8.0, 8192.0, 0.0)
    lines = format_table(Plan(ranked=[est]), capacity=80 * GiB).splitlines()
    assert lines[0] == ("1 sets of degrees fit (the fastest of their 1 variants shown, first 1), 0 rejected; "
                        "per-rank memory in GiB")
    assert lines[1].endswith("memory of a device")
    assert lines[2].endswith("  PPGGOOOOFAAAAAT.....") and BAR_WIDTH == 20
    assert lines[3].strip().startswith("columns: memory a rank holds by term")  # the axes' legend
    assert lines[4].strip().startswith("memory bar: 20 cells of 4 GiB each: P params, G grads, "
                                       "O optimizer state")
    assert "memory of a device" not in format_table(Plan(ranked=[est]))  # no capacity, no bar


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_digits_plan_names_its_cpu_its_sgd_and_ranks_no_tensor_parallel_layout() -> None:
    """The example has no tensor-parallel plan, runs on CPU and builds SGD with momentum (reading
    self.trainer in configure_optimizers): the plan says so, and every tp > 1 layout is rejected in the words
    the strategy uses."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "polytrain", "plan", "-c", "examples/digits/config.yaml",
                           "--nodes", "1", "--devices-per-node", "2"], cwd=root, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "on 1 x 2 cpu (from trainer.accelerator=cpu)" in lines[0] and "optimizer sgd_momentum," in lines[0]
    table = lines[2:lines.index(next(line for line in lines if "columns:" in line))]
    assert table and not any(row.split()[1].startswith("tp") for row in table), table
    assert any("tp2" in line and "has no tensor-parallel plan" in line for line in lines), lines
