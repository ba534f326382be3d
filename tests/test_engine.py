"""The engine's parts that the trainers' tests do not reach: the method registry and the
collectives over a real two-process gloo group (127.0.0.1)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from pipeline.train.methods import Method, get_method, register, registered
from pipeline.train.session import TorchCollectives, all_gather_rows


def test_every_accepted_method_is_registered_and_unknown_names_are_errors():
    assert registered() == ("bootstrap", "ce", "divide_lccn", "dividemix", "forward", "lccn",
                            "sadapt", "trevision")
    for name in registered():
        cls = get_method(name)
        assert issubclass(cls, Method) and cls.name == name
    assert get_method("lccn").needs_chain and not get_method("ce").needs_chain
    assert not get_method("dividemix").needs_chain
    assert get_method("divide_lccn").needs_chain and get_method("divide_lccn").num_chains == 2
    with pytest.raises(ValueError, match="unknown method 'mixup'; registered: bootstrap, ce, "
                                         "divide_lccn, dividemix, forward, lccn, sadapt, "
                                         "trevision"):
        get_method("mixup")

    class Other(Method):
        name = "ce"

    with pytest.raises(ValueError, match="registered twice"):
        register(Other)
    assert get_method("ce").__name__ == "CrossEntropy"


class _Group(TorchCollectives):
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")


def _gather_worker(rank: int, port: int, out: dict) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=2)
    try:
        session = _Group(rank, 2)
        # rank r holds r + 2 rows (idx, value): different lengths on the two ranks
        n = rank + 2
        rows = torch.stack([torch.arange(n) + 10 * rank, torch.full((n,), rank)], 1)
        got = all_gather_rows(session, rows)
        total = session.all_reduce_sum(torch.tensor([float(n)]))
        session.barrier()
        out[rank] = (got.tolist(), float(total[0]))
    finally:
        torch.distributed.destroy_process_group()


def test_all_gather_rows_concatenates_uneven_shares_in_rank_order():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gather_worker, args=(port, out), nprocs=2, join=True)
        result = dict(out)
    want = [[0, 0], [1, 0], [10, 1], [11, 1], [12, 1]]
    assert result[0] == result[1] == (want, 5.0)


class _TwoRanks:
    """Rank 0 of two: all_reduce_sum adds the other rank's tensor."""

    rank, world_size, device = 0, 2, torch.device("cpu")

    def __init__(self, other):
        self.other = other

    def all_reduce_sum(self, t):
        return t + self.other(t)


def test_epoch_stats_average_over_the_ranks_that_measured_them():
    """A rank without a value (NaN: no known clean label in its share) neither halves the
    others' mean nor turns it into NaN on the logging rank; NaN only when no rank has one;
    images_per_s is the sum."""
    from pipeline.train.engine import _REDUCED, _epoch_row

    mine = {"loss": 1.0, "label_recovery": 0.9, "images_per_s": 100.0, "step_time": 0.5,
            "changed": float("nan")}
    theirs = {"loss": 3.0, "label_recovery": float("nan"), "images_per_s": 50.0,
              "step_time": 0.5, "changed": float("nan")}

    def other(t):  # the same packing as _epoch_row's: values (NaN -> 0), then 1 per value
        vals = torch.tensor([theirs.get(k, float("nan")) for k in _REDUCED], dtype=torch.float64)
        have = torch.isfinite(vals)
        return torch.cat([torch.where(have, vals, torch.zeros_like(vals)), have.double()])

    row = _epoch_row(mine, _TwoRanks(other), epoch=1, global_step=10, lr=0.1, phase=True)
    assert row["loss"] == 2.0 and row["label_recovery"] == pytest.approx(0.9)
    assert row["images_per_s"] == 150.0 and row["steps_per_s"] == 2.0
    assert np.isnan(row["changed"]) and np.isnan(row["staleness"])


def test_update_average_follows_a_replaced_average_or_model():
    """Member.update_average caches its tensor lists; a new ``ema`` or ``model`` module (an
    average set up again, a network replaced) must be the one updated, not the cached one."""
    import copy

    from pipeline.train.members import Member

    live = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.SGD(live.parameters(), lr=0.1)
    member = Member(model=live, optimizer=opt, scheduler=None, ema=copy.deepcopy(live))
    with torch.no_grad():
        for p in live.parameters():
            p.add_(1.0)
    member.update_average(0.5)
    first = member.ema
    for a, p in zip(first.parameters(), live.parameters()):
        torch.testing.assert_close(a, p - 0.5)
    member.ema = copy.deepcopy(live)  # a new average
    with torch.no_grad():
        for p in live.parameters():
            p.add_(1.0)
    member.update_average(0.5)
    for a, p in zip(member.ema.parameters(), live.parameters()):
        torch.testing.assert_close(a, p - 0.5)
    for a, p in zip(first.parameters(), live.parameters()):  # the old one is left alone
        torch.testing.assert_close(a, p - 1.5)
    other = copy.deepcopy(live)  # a new network
    with torch.no_grad():
        for p in other.parameters():
            p.add_(2.0)
    member.model = other
    member.update_average(0.0)
    for a, p in zip(member.ema.parameters(), other.parameters()):
        torch.testing.assert_close(a, p)


def test_norm_weight_decay_leaves_the_normalisation_layers_out_of_the_penalty():
    """OptimConfig.norm_weight_decay: one parameter group (the old optimiser state layout)
    unless it differs from weight_decay; then a step with zero gradients shrinks the other
    weights by lr x weight_decay and the batch-norm scale and shift and the biases by lr x
    norm_weight_decay."""
    from pipeline.train.members import param_groups
    from pipeline.train.models import build_model

    model = build_model("preact_resnet32", 10)
    assert len(param_groups(model, 5e-4)) == 1 and len(param_groups(model, 5e-4, 5e-4)) == 1
    groups = param_groups(model, 0.5, 0.0)
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    norm_ids = {id(p) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)
                for p in m.parameters()}
    bias_ids = {id(p) for n, p in model.named_parameters() if n.endswith(".bias")}
    assert bias_ids - norm_ids  # the classifier's bias: out of the penalty too
    norm_ids |= bias_ids
    assert {id(p) for p in groups[1]["params"]} == norm_ids and norm_ids
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(groups, lr=1.0, momentum=0.0, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        factor = 1.0 if id(p) in norm_ids else 0.5
        torch.testing.assert_close(p.detach(), before[n] * factor, msg=n)
