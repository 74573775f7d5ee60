"""Cutting an ``nn.Sequential`` into pipeline stages: balance, original names, clear errors.

All local: no process group. The options' checks run at config load (``Trainer(...)``).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from polytrain import Trainer, TrainModule
from polytrain.parallel import pipeline_sequential_cut as S
from polytrain.trainer.configuration.config import ConfigError

pytestmark = pytest.mark.own_logic


def _max_stage(weights: list[int], points: list[int]) -> int:
    bounds = [0, *points, len(weights)]
    return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))


def _best(weights: list[int], n_stages: int) -> int:
    return min(_max_stage(weights, list(points))
               for points in itertools.combinations(range(1, len(weights)), n_stages - 1))


def test_equal_layers_split_evenly() -> None:
    assert S.balance([100] * 8, 4) == [2, 4, 6]
    assert S.balance([100] * 8, 2) == [4]
    assert S.balance([7, 7, 7], 3) == [1, 2]


def test_parameter_free_children_stay_with_the_layer_before_them() -> None:
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    costs = S.child_costs(seq)
    assert costs == [72, 0, 72, 0, 72, 0]
    assert S.balance(costs, 3) == [2, 4]  # (Linear, ReLU) x 3
    # A parameter-free model splits by layer count.
    assert S.balance([0] * 6, 3) == [2, 4]


def test_skewed_costs_give_the_big_layer_its_own_stage() -> None:
    assert S.balance([1, 1000, 1, 1, 1], 2) == [2]
    assert S.balance([1000, 1, 1, 1, 1000], 3) == [1, 4]


def test_balance_is_optimal_and_never_leaves_a_stage_empty() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 0, 1, 5, 40, 300]) for _ in range(n)]
        points = S.balance(costs, k)
        assert len(points) == k - 1 and points == sorted(set(points)) and all(0 < p < n for p in points)
        weights = [c + 1 for c in costs]
        assert _max_stage(weights, points) == _best(weights, k), (costs, k, points)


def test_shared_parameters_are_counted_once() -> None:
    shared = nn.Linear(4, 4)
    seq = nn.Sequential(shared, nn.Tanh(), shared)
    assert S.child_costs(seq) == [20, 0, 0]


def test_stages_keep_original_names_and_pruning_does_not_renumber() -> None:
    seq = nn.Sequential(*(nn.Linear(3, 3) for _ in range(5)))
    children = S.stage_children(seq, [2, 4])
    assert children == [["0", "1"], ["2", "3"], ["4"]]
    stage = S.stage_module(seq, children[1])
    assert list(stage.state_dict()) == ["2.weight", "2.bias", "3.weight", "3.bias"]
    assert stage[0] is seq[2]  # the same module objects, not copies
    x = torch.randn(2, 3)
    assert torch.equal(stage(x), seq[3](seq[2](x)))

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = seq

    holder = Holder()
    S.prune(holder.net, {"2", "3"})
    assert list(holder.state_dict()) == ["net.2.weight", "net.2.bias", "net.3.weight", "net.3.bias"]
    assert torch.equal(holder.net(x), stage(x))


def test_user_split_points_that_empty_a_stage_name_the_numbers() -> None:
    assert S.check_split_points([2, 5], 7, 3) == [2, 5]
    with pytest.raises(ConfigError, match=r"split_points=\[3, 3\] leave stage 1 empty "
                                          r"\(children 3\.\.2 of 7\)"):
        S.check_split_points([3, 3], 7, 3)
    with pytest.raises(ConfigError, match=r"leave stage 2 empty \(children 5\.\.4 of 5\)"):
        S.check_split_points([2, 5], 5, 3)
    with pytest.raises(ConfigError, match=r"leave stage 0 empty"):
        S.check_split_points([0, 3], 5, 3)
    with pytest.raises(ConfigError, match=r"gives 2 stages but the pipeline has 4 .*exactly 3 child indices"):
        S.check_split_points([2], 5, 4)


def test_more_stages_than_children_is_an_error_with_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"3 children into 4 stages: at least 1 stage\(s\) would be empty"):
        S.balance([1, 1, 1], 4)


class _Two(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(2, 2))
        self.decoder = nn.Sequential(nn.Linear(2, 2))


def test_the_sequential_is_found_or_named() -> None:
    class One(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2))

    assert S.find_sequential(One(), None)[0] == "net"
    with pytest.raises(ConfigError, match=r"2 nn.Sequential children \(encoder, decoder\).*sequential="):
        S.find_sequential(_Two(), None)
    assert S.find_sequential(_Two(), "decoder")[0] == "decoder"
    with pytest.raises(ConfigError, match=r"sequential='head' names nothing on _Two"):
        S.find_sequential(_Two(), "head")


def test_parameters_outside_the_sequential_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"2 parameter\(s\) outside the pipelined nn.Sequential 'decoder': "
                                          r"encoder.0.weight, encoder.0.bias"):
        S.check_params_inside(_Two(), "decoder")


def test_tied_weights_across_ranks_are_refused_but_allowed_on_one_rank() -> None:
    embed, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    seq = nn.Sequential(embed, nn.Tanh(), head)
    children = S.stage_children(seq, [2])
    with pytest.raises(ConfigError, match=r"net.0.weight \(stage 0, rank 0\) is the same parameter as "
                                          r"net.2.weight \(stage 1, rank 1\): tied weights"):
        S.check_no_shared_across_ranks("net", seq, children, {0: 0, 1: 1})
    S.check_no_shared_across_ranks("net", seq, children, {0: 0, 1: 0})  # both stages on rank 0: fine


def test_describe_lists_each_stage() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
    text = S.describe("net", S.stage_children(seq, [2]), S.child_costs(seq))
    assert text == "stage 0: net.0-1 (6 params); stage 1: net.2 (3 params)"


@pytest.mark.parametrize("options, message", [
    ({"schedule": "pipedream"}, r"schedule='pipedream' is not known; valid: gpipe, 1f1b, interleaved_1f1b"),
    ({"schedule": "gpipe", "stages_per_rank": 2}, r"runs one stage per rank but stages_per_rank=2"),
    ({"schedule": "zbv"}, r"schedule='zbv' needs stages_per_rank=2, got 1"),
    ({"n_microbatches": 0}, r"n_microbatches=0 must be at least 1"),
    ({"pp": 0}, r"pp=0 must be a positive degree or -1"),
    ({"microbatches": 4}, r"no option 'microbatches'; valid: schedule, n_microbatches"),
])
def test_options_are_checked_at_config_load(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Trainer(accelerator="cpu", devices=2, strategy={"name": "pipeline", **options})
