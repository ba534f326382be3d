"""Which checkpoint a restarted or re-submitted run resumes from, and which checkpoint
folders are removed: the newest complete one wins, also when Ray Train never registered it
(its report was lost with the failure), and folders Ray does not manage are cleaned up."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.train.checkpoints import (
    META_FILE,
    STATE_FILE,
    newest_complete_checkpoint,
    prune_checkpoints,
)


def _write(root: Path, name: str, step: int, *, truncate: bool = False) -> Path:
    d = root / name
    d.mkdir(parents=True)
    torch.save({"global_step": step, "model": {"w": torch.arange(1000.0)}}, d / STATE_FILE)
    if truncate:  # the failure hit while the folder was being written
        raw = (d / STATE_FILE).read_bytes()
        (d / STATE_FILE).write_bytes(raw[: len(raw) // 2])
    (d / META_FILE).write_text(json.dumps({"global_step": step}))
    return d


def _snapshot(root: Path, names: list[str]) -> None:
    (root / "checkpoint_manager_snapshot.json").write_text(json.dumps(
        {"checkpoint_results": [{"checkpoint_dir_name": n, "metrics": {}} for n in names]}))


def test_newest_complete_checkpoint_wins_over_the_registered_one(tmp_path):
    _write(tmp_path, "checkpoint_a", 250)
    _write(tmp_path, "checkpoint_b", 260)
    _write(tmp_path, "checkpoint_c", 270)
    _write(tmp_path, "checkpoint_d", 280)
    _write(tmp_path, "checkpoint_e", 290, truncate=True)
    (tmp_path / "checkpoint_f").mkdir()  # no meta.json at all
    _snapshot(tmp_path, ["checkpoint_a", "checkpoint_b"])  # Ray knows up to step 260
    assert newest_complete_checkpoint(tmp_path).name == "checkpoint_d"
    assert newest_complete_checkpoint(tmp_path / "missing") is None


def test_prune_removes_what_ray_does_not_manage_but_keeps_the_resume_point(tmp_path):
    for name, step in (("checkpoint_a", 250), ("checkpoint_b", 260), ("checkpoint_c", 270),
                       ("checkpoint_d", 280)):
        _write(tmp_path, name, step)
    _write(tmp_path, "checkpoint_e", 290, truncate=True)
    _write(tmp_path, "checkpoint_old", 100)  # an orphan older than every registered one
    _snapshot(tmp_path, ["checkpoint_a", "checkpoint_b"])
    deleted = prune_checkpoints(tmp_path)
    assert sorted(deleted) == ["checkpoint_c", "checkpoint_e", "checkpoint_old"]
    left = sorted(p.name for p in tmp_path.glob("checkpoint_*") if p.is_dir())
    assert left == ["checkpoint_a", "checkpoint_b", "checkpoint_d"]  # d: the resume point
    # once the run registers a newer checkpoint, the former resume point is an orphan
    _write(tmp_path, "checkpoint_g", 300)
    _snapshot(tmp_path, ["checkpoint_b", "checkpoint_g"])
    assert prune_checkpoints(tmp_path) == ["checkpoint_a", "checkpoint_d"]
    # no snapshot yet (nothing reported): nothing is touched
    assert prune_checkpoints(tmp_path / "none") == []
