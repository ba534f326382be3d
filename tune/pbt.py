"""Population-based training (``python -m tune.sweep --scheduler pbt``): Tune's
``PopulationBasedTraining`` over the jobs' Train runs, mutating the Dirichlet alpha and the
annealing floor (:data:`MUTATIONS`) and carrying the whole run state across an exploit.

What PBT needs from a trial is a *Tune* checkpoint with every result it may clone: a trial
in the lower quantile is stopped and restarted from the checkpoint of one in the upper
quantile, with that trial's config perturbed. The Train-in-Tune report
(:class:`tune.reporting.EpochReport`) passes metrics only. So a PBT trial
(:func:`run_trial`) runs its job in a background thread and reports each epoch itself from
the trial's function thread, with a copy of the Train checkpoint of that epoch
(``state.pt`` and ``meta.json``: the model, optimiser, scheduler, data position, method
state and the confusion actor's C, z and counters, all from one consistent moment); a
callback in the Train controller (:class:`CheckpointQueue`) hands each epoch's result and
checkpoint path over through a Ray queue.

A trial that starts with a Tune checkpoint (an exploit, or its own after a restored sweep)
starts a new Train run ``<trial_id>-e<epoch>_<tag>`` (:func:`clone_run_name`) seeded with
that checkpoint: the file is written into the new run's storage, where the job finds it as
its newest complete checkpoint, so the model, the optimiser and the actor's C and z (put
back by the fenced ``open``) continue from the cloned trial's moment, under the trial's
mutated config. The seeded state forgets the MLflow run of the trial it came from (the new
run logs to a child run of its own, tagged ``pbt.restored_from``); ``<trial run
dir>/pbt.jsonl`` records each start, fresh or from a checkpoint, with its config.

Tune keeps every PBT checkpoint of a trial (a cloned one must outlive the clone's restart;
``CheckpointConfig(num_to_keep=None)``): each is one Train checkpoint in size.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ray.train.v2.api.callback import UserCallback

from lccn_jobs.driver import run_job
from pipeline.train.checkpoints import META_FILE, STATE_FILE
from tune import trial
from tune.reporting import epoch_result
from tune.search_spaces import TIME_ATTR, to_tune

# what PBT perturbs (x0.8 / x1.2, or resampled from these with probability 1/4), clipped
# into the configs' ranges after each perturbation
MUTATIONS: dict[str, dict[str, list[float]]] = {
    "lccn.alpha": {"loguniform": [0.01, 1000.0]},
    "lccn.anneal_floor": {"uniform": [0.1, 1.0]},
}
LOG_FILE = "pbt.jsonl"
_END = "__end__"


def pbt_space(space: dict[str, Any]) -> dict[str, Any]:
    """``space`` made fit for PBT: every mutated key present (drawn from
    :data:`MUTATIONS` where the space has none) and annealing on (the floor is a bound of
    the annealing power)."""
    out = dict(space)
    for key, spec in MUTATIONS.items():
        out.setdefault(key, spec)
    out["lccn.anneal"] = True
    return out


def clip_config(config: dict[str, Any]) -> dict[str, Any]:
    """PBT's ``custom_explore_fn``: keep perturbed values inside :data:`MUTATIONS`' ranges
    (x1.2 of the largest alpha or floor would leave them)."""
    for key, spec in MUTATIONS.items():
        if key in config:
            lo, hi = next(iter(spec.values()))
            config[key] = float(min(max(float(config[key]), lo), hi))
    return config


def make_scheduler(*, max_t: int, fits: bool, time_attr: str = TIME_ATTR, interval: int = 1,
                   burn_in: int = 0, quantile: float = 0.25, seed: int = 0):
    """:class:`JobPBT` on ``time_attr`` (epochs done) perturbing :data:`MUTATIONS` every
    ``interval`` epochs after ``burn_in``, for trials of ``max_t`` epochs; ``fits``: the
    whole population runs at once (no trial is paused to let another run)."""
    import random

    random.seed(seed)  # PBT draws its clone targets and perturbations from `random`
    return _pbt_class()(
        max_t=max_t, fits=fits, time_attr=time_attr, perturbation_interval=interval,
        burn_in_period=burn_in, hyperparam_mutations=_mutation_domains(),
        quantile_fraction=quantile, custom_explore_fn=clip_config, synch=False)


def _mutation_domains() -> dict[str, Any]:
    return to_tune(MUTATIONS)


def _pbt_class():
    from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

    class JobPBT(PopulationBasedTraining):
        """Tune's asynchronous PBT (a trial is compared with the others' latest scores)
        with two changes for trials that are Train runs, where every restart costs a new
        worker group: a trial's last epoch is never a perturbation point (cloning into a
        trial that is about to end, or pausing it, only costs a restart), and when the
        whole population runs at once a trial is not paused to let another run."""

        def __init__(self, *, max_t: int, fits: bool, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.max_t, self.fits = max_t, fits

        def on_trial_result(self, tune_controller, trial, result):
            if result.get(self._time_attr, 0) >= self.max_t:
                return TrialScheduler.CONTINUE
            decision = super().on_trial_result(tune_controller, trial, result)
            if decision == TrialScheduler.PAUSE and self.fits:
                return TrialScheduler.CONTINUE
            return decision

    return JobPBT


class CheckpointQueue(UserCallback):
    """Ray Train callback (runs in the Train controller): every epoch-closing report of
    rank 0 goes into ``queue`` as ``(tune result, checkpoint path)``."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        result = epoch_result(metrics[0] if metrics else {})
        if result is None:
            return
        self.queue.put((result, None if checkpoint is None else checkpoint.path))


def clone_run_name(trial_id: str, meta: dict[str, Any]) -> str:
    """The Train run a trial starts from a Tune checkpoint: ``<trial>-e<epoch>_<tag>``, the
    tag a hash of the checkpoint's run and global step. Two clones at the same epoch from
    different donors (or different checkpoints of one) are two runs; the same checkpoint
    (a restored sweep restarting the trial) gives the same name, and the run resumes."""
    tag = hashlib.sha1(f"{meta.get('run_name')}@{int(meta['global_step'])}".encode())
    return f"{trial_id}-e{int(meta['epoch'])}_{tag.hexdigest()[:8]}"  # (no "-e" in the tag)


def seed_run(checkpoint_dir: str | Path, run_root: Path) -> dict[str, Any]:
    """Write the state of a Tune checkpoint (a copy of a Train checkpoint) into
    ``run_root`` (a new Train run's storage folder) as ``checkpoint_pbt_seed``, without the
    MLflow run of the trial it came from; the job resumes from it. Returns its
    ``meta.json``. An existing seed is kept (a restarted trial resuming its own run)."""
    import torch


    src = Path(checkpoint_dir)
    meta = json.loads((src / META_FILE).read_text())
    dst = run_root / "checkpoint_pbt_seed"
    if (dst / META_FILE).is_file():
        return meta
    tmp = run_root / ".checkpoint_pbt_seed.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = torch.load(src / STATE_FILE, map_location="cpu", weights_only=False)
    state["mlflow_run_id"] = None
    torch.save(state, tmp / STATE_FILE)
    (tmp / META_FILE).write_text(json.dumps({**meta, "mlflow_run_id": None}, indent=1))
    tmp.rename(dst)
    return meta


def _report(result: dict[str, Any], path: str | None) -> None:
    """One Tune result with a copy of the Train checkpoint at ``path``."""
    import ray.tune


    with tempfile.TemporaryDirectory(prefix="lccn-pbt-") as tmp:
        try:
            for name in (STATE_FILE, META_FILE):
                shutil.copy2(Path(path) / name, Path(tmp) / name)
        except (OSError, TypeError):  # no checkpoint, or Train already replaced it (its
            ray.tune.report(result)   # num_to_keep): this epoch cannot be cloned
            return
        ray.tune.report(result, checkpoint=ray.tune.Checkpoint.from_directory(tmp))


def run_trial(config: dict[str, Any], **kwargs: Any) -> None:
    """Tune function trainable of a PBT sweep (see the module doc): the trial's run from
    its Tune checkpoint, if any, every epoch reported with its checkpoint."""
    import ray.tune
    from ray.util.queue import Queue


    trial_id = ray.tune.get_context().get_trial_id()
    run_dir = Path(kwargs["sweep_dir"]) / "trials" / trial_id
    run_name, tags = trial_id, []
    source, epoch, step = None, 0, 0  # a fresh start
    ckpt = ray.tune.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            meta = json.loads((Path(d) / "meta.json").read_text())
            run_name = clone_run_name(trial_id, meta)
            seed_run(d, run_dir / "train" / run_name)
        source = str(meta.get("run_name"))
        epoch, step = int(meta["epoch"]), int(meta["global_step"])
        tags.append(("pbt.restored_from", source))
    # every start, fresh or cloned, with the config it runs under (the table's per-epoch
    # configs, tune.sweep.with_epoch_configs)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOG_FILE, "a") as f:
        f.write(json.dumps({"time": time.time(), "run_name": run_name, "restored_from": source,
                            "epoch": epoch, "global_step": step, "config": config},
                           default=str) + "\n")
    job, args, jr = trial.trial_run(config, trial_id=trial_id, run_name=run_name,
                                    extra_tags=tags, **kwargs)
    queue = Queue(actor_options={"num_cpus": 0})
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            run_job(args, job=job.name, run=jr.run, dist=jr.dist, view=jr.view,
                    log=jr.lines(), callbacks=[CheckpointQueue(queue)])
        except BaseException as e:  # noqa: BLE001 - raised again in the trial's thread
            errors.append(e)
        finally:
            queue.put(_END)

    worker = threading.Thread(target=fit, name=f"train-{run_name}", daemon=True)
    worker.start()
    while True:
        item = queue.get()
        if item == _END:
            break
        _report(*item)
    worker.join()
    if errors:
        raise errors[0]
