"""The engine's parts that the trainers' tests do not reach: the method registry and the
collectives over a real two-process gloo group (127.0.0.1)."""

from __future__ import annotations

import socket

import pytest
import torch

from pipeline.config import METHODS
from pipeline.engine import TorchCollectives, all_gather_rows
from pipeline.methods import Method, get_method, register, registered


def test_every_accepted_method_is_registered_and_unknown_names_are_errors():
    assert set(METHODS) <= set(registered())
    for name in METHODS:
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
