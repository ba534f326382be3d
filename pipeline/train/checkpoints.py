"""Checkpoint files of a run: what a checkpoint folder holds, which one a resume takes,
which ones are pruned, and whether a mid-epoch checkpoint can resume under a new loader
geometry.

A checkpoint folder holds ``state.pt`` (:data:`STATE_FILE`: the engine's state dict, see
:mod:`pipeline.train.engine`) and ``meta.json`` (:data:`META_FILE`: epoch, batch, global
step, run name, the loader geometry), written by rank 0 at one consistent moment.
Nothing here imports Ray: Ray Train's own registry of checkpoints is read from its
snapshot file.

Imports: :mod:`pipeline.core` and :mod:`pipeline.train.sources` (the loader geometry).
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from pipeline.core import storage
from pipeline.core.config import RunConfig
from pipeline.core.storage import Location
from pipeline.train.sources import loader_geometry


def load_state(checkpoint_dir: Location, *, endpoint_url: str | None = None) -> dict:
    """The ``state.pt`` dict of a checkpoint folder (a path or an ``s3://`` prefix)."""
    path = storage.join(checkpoint_dir, STATE_FILE)
    if not storage.is_remote(path):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{checkpoint_dir}: not an LCCN checkpoint (no {STATE_FILE})")
        return torch.load(path, map_location="cpu", weights_only=True)
    try:
        data = storage.read_bytes(path, endpoint_url=endpoint_url)
    except FileNotFoundError:
        raise FileNotFoundError(f"{checkpoint_dir}: not an LCCN checkpoint (no {STATE_FILE})"
                                ) from None
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

STATE_FILE = "state.pt"
META_FILE = "meta.json"


def init_state_file(path: str | os.PathLike) -> Path:
    """The ``state.pt`` that :attr:`EngineOptions.init_from` names: the file itself, a
    checkpoint folder holding one, or a folder of ``checkpoint_*`` folders (a run's
    ``<run_dir>/train/<run_name>``; ``<run_dir>`` itself when it holds one run) whose
    newest complete checkpoint (largest global step) is taken."""
    if storage.is_remote(path):
        raise ValueError(f"--init-from {path}: weights are read from a local path; copy the "
                         f"checkpoint folder (or its {STATE_FILE}) to this machine first")
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if (p / STATE_FILE).is_file():
        return p / STATE_FILE
    # the resume path's own choice (a folder that does not load is skipped)
    roots = [p] + ([r for r in sorted((p / "train").iterdir()) if r.is_dir()]
                   if (p / "train").is_dir() else [])
    found = {r: d for r in roots if (d := newest_complete_checkpoint(r)) is not None}
    if not found:
        raise FileNotFoundError(f"--init-from {path}: no {STATE_FILE}, checkpoint folder or "
                                f"run with a complete checkpoint there")
    if len(found) > 1:
        raise ValueError(f"--init-from {path}: it holds the checkpoints of {len(found)} runs "
                         f"({', '.join(str(r) for r in found)}); name one")
    return next(iter(found.values())) / STATE_FILE


def last_lr(state: dict) -> float | None:
    """The learning rate a checkpoint's weights were last trained at: its last epoch row's;
    without a history its first optimiser's, which is the rate of the step it would take
    next (the same unless a milestone falls just after its last epoch); else None."""
    hist = state.get("history") or []
    if hist and "lr" in hist[-1]:
        return float(hist[-1]["lr"])
    opts = state.get("optimizers") or ([state["optimizer"]] if "optimizer" in state else [])
    try:
        return float(opts[0]["param_groups"][0]["lr"])
    except (IndexError, KeyError, TypeError):
        return None


def geometry_mismatch(saved: dict | None, now: dict | None, *, epoch: int,
                      batch: int) -> str | None:
    """Why a checkpoint taken at ``batch`` of ``epoch`` under the loader geometry ``saved``
    (:meth:`ShardSource.geometry`) cannot resume under ``now``, or None: inside an epoch
    the batch order depends on it (at an epoch boundary any geometry resumes)."""
    if batch <= 0 or saved is None or now is None or saved == now:
        return None
    diff = ", ".join(f"{k} {saved.get(k)} -> {now.get(k)}" for k in sorted(now)
                     if saved.get(k) != now.get(k))
    return (f"the checkpoint was taken at batch {batch} of epoch {epoch}, whose batch order "
            f"depends on the workers ({diff}): resuming there would train some samples twice "
            f"and skip others; resume with the checkpoint's values (world_size = "
            f"--num-workers, loader_workers = --loader-workers, batch_per_rank = --batch-size "
            f"/ --num-workers, --shuffle-buffer) or start a new run")


def checkpoint_step(checkpoint_dir: Location, *, endpoint_url: str | None = None,
                    strict: bool = False) -> int | None:
    """The global step a checkpoint folder's ``meta.json`` names; None when it is not there
    or does not parse. A read that fails otherwise (a network or disk error) is None too,
    or with ``strict`` raised: it says nothing about the checkpoint."""
    try:
        meta = storage.read_text(storage.join(checkpoint_dir, META_FILE),
                                 endpoint_url=endpoint_url)
    except FileNotFoundError:
        return None
    except OSError:
        if strict:
            raise
        return None
    try:
        return int(json.loads(meta)["global_step"])
    except (ValueError, KeyError, TypeError):
        return None


def checkpoint_dirs(root: Location, *, endpoint_url: str | None = None) -> list[Location]:
    """The ``checkpoint_*`` folders directly under ``root`` (a run's
    ``<run_dir>/train/<run_name>``, a path or an ``s3://`` prefix), by name."""
    return [storage.join(root, n)
            for n in storage.list_dirs(root, "checkpoint_", endpoint_url=endpoint_url)]


def resume_problem(run: RunConfig, dist: Any) -> str | None:
    """Before a (re-)submitted run starts: why its newest checkpoint on disk cannot be
    resumed under this run's loader geometry (a checkpoint inside an epoch, other workers:
    :func:`pipeline.train.checkpoints.geometry_mismatch`), or None. Reads ``meta.json`` only; the
    workers check the checkpoint they load again."""
    metas = []
    endpoint = getattr(dist, "s3_endpoint_url", None)
    root = storage.join(dist.run_dir, "train", dist.run_name)
    for d in checkpoint_dirs(root, endpoint_url=endpoint):
        try:
            meta = json.loads(storage.read_text(storage.join(d, META_FILE), endpoint_url=endpoint))
            step = int(meta["global_step"])
            if storage.is_file(storage.join(d, STATE_FILE), endpoint_url=endpoint):
                metas.append((step, storage.name(d), d, meta))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not metas:
        return None
    _, _, d, meta = max(metas)
    now = loader_geometry(world_size=dist.num_workers,
                          batch_per_rank=max(1, run.optim.batch_size // dist.num_workers),
                          loader_workers=dist.loader_workers, shuffle_buffer=dist.shuffle_buffer)
    problem = geometry_mismatch(meta.get("data_geometry"), now, epoch=int(meta.get("epoch", 0)),
                                batch=int(meta.get("batch", 0)))
    return None if problem is None else f"{d}: {problem}"


def newest_complete_checkpoint(root: Location, *, endpoint_url: str | None = None,
                               strict: bool = False) -> Location | None:
    """The ``checkpoint_*`` folder under ``root`` with the largest global step whose
    ``meta.json`` and ``state.pt`` both load and agree; None if there is none
    (:func:`newest_complete_state`, without the state)."""
    found = newest_complete_state(root, endpoint_url=endpoint_url, strict=strict)
    return None if found is None else found[0]


def newest_complete_state(root: Location, *, endpoint_url: str | None = None,
                          strict: bool = False) -> tuple[Location, dict] | None:
    """The ``checkpoint_*`` folder under ``root`` with the largest global step whose
    ``meta.json`` and ``state.pt`` both load and agree, and its loaded state (a resume uses
    it rather than reading ``state.pt`` again: from object storage that is a second
    download); None if there is none. ``root`` is a path or an ``s3://`` prefix; the
    folder is of the same kind.

    Rank 0 writes a checkpoint at one consistent moment and then reports it; Ray Train
    registers it only when every rank's report reaches its controller. A failure in between
    leaves complete checkpoints on disk that Ray does not know (seen: steps 270 and 280 on
    disk, Ray resumed from 260). They are as consistent as registered ones, so a restart
    resumes from the newest. A folder cut short by the failure fails to load and is skipped;
    one that cannot be read (a network or disk error) is skipped too, or with ``strict``
    the error is raised.
    """
    found = []
    for d in checkpoint_dirs(root, endpoint_url=endpoint_url):
        step = checkpoint_step(d, endpoint_url=endpoint_url, strict=strict)
        if step is not None:
            found.append((step, storage.name(d), d))
    for step, _, d in sorted(found, key=lambda t: t[:2], reverse=True):
        try:
            state = load_state(d, endpoint_url=endpoint_url)
        except Exception as e:  # noqa: BLE001 - truncated/partial file: not complete
            if strict and isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
                raise
            print(f"skipping {d} (step {step}): it does not load ({type(e).__name__}: {e})",
                  file=sys.__stdout__, flush=True)
            continue
        if int(state.get("global_step", -1)) == step:
            return d, state
    return None


def prune_checkpoints(root: Location, *, endpoint_url: str | None = None) -> list[str]:
    """Delete the checkpoint folders Ray Train does not manage: those not in its
    ``checkpoint_manager_snapshot.json`` that are incomplete or not newer than the newest
    registered one (``CheckpointConfig.num_to_keep`` never sees them). An unregistered
    complete checkpoint newer than every registered one is kept: a re-submission resumes
    from it. ``root``: a path or an ``s3://`` prefix. Returns the names deleted."""
    snap = storage.join(root, "checkpoint_manager_snapshot.json")
    try:
        results = json.loads(storage.read_text(snap, endpoint_url=endpoint_url)
                             ).get("checkpoint_results", [])
        registered = {r["checkpoint_dir_name"] for r in results}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return []  # no snapshot (nothing reported yet) or another layout: touch nothing
    try:  # a read that fails (not a missing file) deletes nothing: it proves nothing
        newest_registered = max((checkpoint_step(storage.join(root, n), strict=True,
                                                 endpoint_url=endpoint_url) or -1
                                 for n in registered), default=-1)
        newest = newest_complete_checkpoint(root, endpoint_url=endpoint_url, strict=True)
        doomed = []
        for d in checkpoint_dirs(root, endpoint_url=endpoint_url):
            n = storage.name(d)
            if n in registered:
                continue
            step = checkpoint_step(d, endpoint_url=endpoint_url, strict=True)
            if not (newest is not None and n == storage.name(newest) and step is not None
                    and step > newest_registered):
                doomed.append(d)
    except OSError as e:
        print(f"checkpoints under {root} left as they are: {e}", file=sys.__stdout__, flush=True)
        return []
    deleted = []
    for d in doomed:
        try:
            storage.delete_dir(d, endpoint_url=endpoint_url)
            deleted.append(storage.name(d))
        except OSError as e:  # a leftover folder costs space, never the run
            print(f"could not remove {d}: {e}", file=sys.__stdout__, flush=True)
    return deleted
