"""Which checkpoint a restarted or re-submitted run resumes from, and which checkpoint
folders are removed: the newest complete one wins, also when Ray Train never registered it
(its report was lost with the failure), and folders Ray does not manage are cleaned up."""

from __future__ import annotations

import io
import json

import pytest
import torch

from pipeline.core import storage
from pipeline.data import s3
from pipeline.train.checkpoints import (
    META_FILE,
    STATE_FILE,
    checkpoint_dirs,
    load_state,
    newest_complete_checkpoint,
    prune_checkpoints,
)


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path, monkeypatch):
    """A run's checkpoint folder: on disk, or a prefix in a moto S3 bucket (the endpoint
    from the environment, as on a cluster node)."""
    if request.param == "local":
        return tmp_path
    url = request.getfixturevalue("moto_url")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", url)
    bucket = f"ckpt-{request.node.name.split('[')[0][-40:].replace('_', '-')}"
    s3.client(endpoint_url=url).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs/train/r"


def _write(root, name: str, step: int, *, truncate: bool = False) -> None:
    buf = io.BytesIO()
    torch.save({"global_step": step, "model": {"w": torch.arange(1000.0)}}, buf)
    raw = buf.getvalue()
    if truncate:  # the failure hit while the folder was being written
        raw = raw[: len(raw) // 2]
    storage.write_bytes(storage.join(root, name, STATE_FILE), raw)
    storage.write_text(storage.join(root, name, META_FILE), json.dumps({"global_step": step}))


def _snapshot(root, names: list[str]) -> None:
    storage.write_text(storage.join(root, "checkpoint_manager_snapshot.json"), json.dumps(
        {"checkpoint_results": [{"checkpoint_dir_name": n, "metrics": {}} for n in names]}))


def _left(root) -> list[str]:
    return [storage.name(d) for d in checkpoint_dirs(root)]


def test_newest_complete_checkpoint_wins_over_the_registered_one(root):
    _write(root, "checkpoint_a", 250)
    _write(root, "checkpoint_b", 260)
    _write(root, "checkpoint_c", 270)
    _write(root, "checkpoint_d", 280)
    _write(root, "checkpoint_e", 290, truncate=True)
    storage.write_text(storage.join(root, "checkpoint_f", "other.txt"), "")  # no meta.json
    _snapshot(root, ["checkpoint_a", "checkpoint_b"])  # Ray knows up to step 260
    newest = newest_complete_checkpoint(root)
    assert storage.name(newest) == "checkpoint_d" and type(newest) is type(root)
    assert load_state(newest)["global_step"] == 280
    assert newest_complete_checkpoint(storage.join(root, "missing")) is None


def test_prune_removes_what_ray_does_not_manage_but_keeps_the_resume_point(root):
    for name, step in (("checkpoint_a", 250), ("checkpoint_b", 260), ("checkpoint_c", 270),
                       ("checkpoint_d", 280)):
        _write(root, name, step)
    _write(root, "checkpoint_e", 290, truncate=True)
    _write(root, "checkpoint_old", 100)  # an orphan older than every registered one
    _snapshot(root, ["checkpoint_a", "checkpoint_b"])
    deleted = prune_checkpoints(root)
    assert sorted(deleted) == ["checkpoint_c", "checkpoint_e", "checkpoint_old"]
    assert _left(root) == ["checkpoint_a", "checkpoint_b", "checkpoint_d"]  # d: resume point
    # once the run registers a newer checkpoint, the former resume point is an orphan
    _write(root, "checkpoint_g", 300)
    _snapshot(root, ["checkpoint_b", "checkpoint_g"])
    assert prune_checkpoints(root) == ["checkpoint_a", "checkpoint_d"]
    assert _left(root) == ["checkpoint_b", "checkpoint_g"]
    # no snapshot yet (nothing reported): nothing is touched
    assert prune_checkpoints(storage.join(root, "none")) == []


def test_a_read_that_fails_prunes_nothing(root, monkeypatch):
    """A network or disk error while the checkpoints are read says nothing about them:
    nothing is deleted (before, the resume point whose meta.json did not read was)."""
    for name, step in (("checkpoint_a", 250), ("checkpoint_b", 260), ("checkpoint_d", 280)):
        _write(root, name, step)
    _snapshot(root, ["checkpoint_a", "checkpoint_b"])
    real = storage.read_bytes

    def flaky(loc, **kw):
        if "checkpoint_d" in str(loc):
            raise OSError(f"{loc}: connection reset by peer")
        return real(loc, **kw)

    monkeypatch.setattr(storage, "read_bytes", flaky)
    assert prune_checkpoints(root) == []
    assert _left(root) == ["checkpoint_a", "checkpoint_b", "checkpoint_d"]
    # a resume is not held up by it: the newest checkpoint that reads is taken
    assert storage.name(newest_complete_checkpoint(root)) == "checkpoint_b"


def test_a_delete_that_fails_leaves_the_folder_and_the_run_goes_on(root, monkeypatch, capfd):
    _write(root, "checkpoint_a", 250)
    _write(root, "checkpoint_old", 100)
    _snapshot(root, ["checkpoint_a"])

    def refused(loc, **kw):
        raise OSError(f"{loc}: SlowDown")

    monkeypatch.setattr(storage, "delete_dir", refused)
    assert prune_checkpoints(root) == []
    out = capfd.readouterr().out
    assert "could not remove" in out and "checkpoint_old" in out and "SlowDown" in out
    assert _left(root) == ["checkpoint_a", "checkpoint_old"]


def test_a_resume_reads_the_chosen_state_once(root, monkeypatch):
    """Rank 0 finds the newest complete checkpoint by loading it, and resumes from that
    loaded state: from object storage a second read of ``state.pt`` is a second download."""
    from types import SimpleNamespace

    from pipeline.cluster import ray_train
    from pipeline.train.checkpoints import newest_complete_state

    _write(root, "checkpoint_a", 250)
    _write(root, "checkpoint_b", 260)
    d, state = newest_complete_state(root)
    assert storage.name(d) == "checkpoint_b" and state["global_step"] == 260
    assert torch.equal(state["model"]["w"], load_state(d)["model"]["w"])

    session = ray_train.RaySession.__new__(ray_train.RaySession)
    session.rank, session.world_size = 0, 1
    session._train = SimpleNamespace(get_checkpoint=lambda: None)
    session.checkpoint_root, session.endpoint_url = root, None

    def second_read(*a, **k):
        raise AssertionError("state.pt read a second time")

    monkeypatch.setattr(ray_train, "load_state", second_read)
    assert session.load_checkpoint()["global_step"] == 260
