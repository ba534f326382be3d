"""LCCN (Algorithm 3): CE pre-training, then a classifier trained on latent labels drawn
by a Gibbs chain over the shared confusion counts C. Variants through ``LCCNConfig``:
LCCN* (``outlier``: K + 1 latent classes) and LCCN+ (``use_trusted``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from pipeline.confusion import transition
from pipeline.engine import transition_error
from pipeline import label_issues
from pipeline.lccn import GibbsLabeler
from pipeline.loop import predict, train_one_epoch
from pipeline.methods.base import Method, register
from pipeline.monitor import CollapseMonitor, chain_health
from pipeline.warmup import estimate_phi_init, initial_assignment


@register
class LCCN(Method):
    """State: ``phi_init`` (None until the noise phase starts), the LCCN step count
    ``lccn_step`` (the labeler's; it seeds the distributed Gibbs draws and drives the
    annealing and the target ramp), the collapse monitor's reference accuracy. The chain
    itself (C and z) lives in the engine's chain backend."""

    name = "lccn"
    needs_chain = True

    def __init__(self, run, engine) -> None:
        super().__init__(run, engine)
        self.cfg = run.lccn
        data = engine.data
        self.trusted: Tensor | None = data.trusted if self.cfg.use_trusted else None
        self.monitor = CollapseMonitor(run.monitor)
        self.phi_init: Tensor | None = None
        self.lccn_step = 0
        self.labeler: GibbsLabeler | None = None
        self.pretrained_probs: Tensor | None = None
        self.report = label_issues.accumulator_for(run, engine, k_latent=self.num_outputs())

    def num_outputs(self) -> int:
        return self.num_classes + 1 if self.cfg.outlier else self.num_classes

    def in_noise_phase(self, epoch: int) -> bool:
        return epoch >= self.run.optim.pretrain_epochs

    def noise_phase_started(self) -> bool:
        return self.phi_init is not None

    def start_noise_phase(self, epoch: int) -> dict[str, float]:
        """Algorithm 3 lines 2-3 over all ranks: phi_init (K_latent, K) float64 from the
        pretrained classifier (statistics all-reduced) and the initial assignment of this
        rank's samples into the chain; the monitor's reference accuracy."""
        eng, lc = self.engine, self.cfg
        data = eng.data
        probs, idx, _ = predict(self.members[0].eval_model, data.train_eval_batches(),
                                device=eng.device)
        observed = data.observed[idx]
        phi_init = estimate_phi_init(lc, probs, observed, eng.k_latent, self.num_classes,
                                     reduce=eng.reduce_cpu)
        self.pretrained_probs = probs
        z0 = initial_assignment(observed, probs=probs, mode=lc.init)
        eng.chain.start(idx, z0, k_latent=eng.k_latent, trusted=self.trusted, clean=data.clean)
        self.phi_init = phi_init
        self.monitor.start(eng.val_top1())
        return {"init_transition_error": transition_error(phi_init, data.transition)}

    def begin_epoch(self, epoch: int, steps_per_epoch: int) -> None:
        if not self.in_noise_phase(epoch):
            return
        if self.labeler is None:
            o = self.run.optim
            cfg = self.cfg
            if self.engine.chain.shared:
                # at most a quarter of an epoch's steps per push: a replica never misses most
                # of an epoch of the other workers' labels (tiny runs, e.g. smoke tests)
                cfg = replace(cfg, commit_every=min(cfg.commit_every,
                                                    max(1, steps_per_epoch // 4)))
            self.labeler = self.engine.chain.labeler(
                cfg, phi_init=self.phi_init,
                max_steps=(o.epochs - o.pretrain_epochs) * steps_per_epoch,
                trusted=self.trusted, clean=self.engine.data.clean)
            self.labeler.step_count = self.lccn_step
        if hasattr(self.labeler, "max_staleness"):
            self.labeler.max_staleness = 0

    def _active(self, epoch: int) -> GibbsLabeler | None:
        return self.labeler if self.in_noise_phase(epoch) else None

    def train_epoch(self, epoch: int, batches: Iterable[Any],
                    after_step: Callable[[], None]) -> dict[str, float]:
        m = self.members[0]
        active = self._active(epoch)
        self._epoch = epoch
        stats = train_one_epoch(m.train_model, batches, m.optimizer, labeler=active,
                                trusted=self.trusted, xi=self.cfg.xi, device=self.engine.device,
                                num_classes=self.num_classes, after_step=after_step,
                                on_posterior=self.report.sink(epoch) if active else None)
        if self.labeler is not None:
            self.lccn_step = self.labeler.step_count
        if active is not None:
            label_issues.finish_epoch(self.report, self.engine, epoch, [m.eval_model])
        return stats

    def flush(self) -> None:
        if self.labeler is not None:
            self.labeler.flush()
            self.lccn_step = self.labeler.step_count

    def epoch_stats(self) -> dict[str, float]:
        return {"staleness_max": float(getattr(self.labeler, "max_staleness", 0))
                if self.labeler is not None else 0.0}

    def observe_chain(self, state: dict | None, *, epoch: int,
                      row: dict[str, float] | None) -> dict[str, float]:
        """transition_error of the chain's phi (NaN before the chain starts); at an epoch
        end of the noise phase the chain's health and the monitor's verdict
        (``collapse``), which raises :class:`~pipeline.monitor.ChainCollapsed` itself in
        one process with ``MonitorConfig.stop``."""
        if state is None or self.phi_init is None:
            return {"transition_error": float("nan")}
        phi = transition(state["counts"])
        out = {"transition_error": transition_error(phi, self.engine.data.transition)}
        if row is None:
            return out
        health = chain_health(state["z"], state["observed"], self.engine.k_latent,
                              self.num_classes, counted=state["counted"], phi=phi,
                              phi_init=self.phi_init)
        stop = None if self.engine.options.raise_on_collapse else False
        val = row.get("val_top1", float("nan"))
        out.update(health)
        out["collapse"] = float(bool(self.monitor.check(health, val, epoch=epoch, stop=stop)))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"lccn_step": self.lccn_step, "phi_init": self.phi_init,
                "monitor_val_start": self.monitor.val_start,
                label_issues.STATE_KEY: self.report.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lccn_step = int(state.get("lccn_step", 0))
        self.phi_init = state.get("phi_init")
        self.monitor.val_start = float(state.get("monitor_val_start", math.nan))
        self.report.load_state_dict(state.get(label_issues.STATE_KEY))
