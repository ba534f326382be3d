"""LCCN (Algorithm 3): CE pre-training, then a classifier trained on latent labels drawn
by a Gibbs chain over the shared confusion counts C. Variants through ``LCCNConfig``:
LCCN* (``outlier``: K + 1 latent classes; at the end of the run every training sample's
p(outlier) is exported as ``outliers.csv``) and LCCN+ (``use_trusted``)."""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.core.confusion import transition, transition_error
from pipeline.core.losses import clipped_cross_entropy, soft_cross_entropy
from pipeline.core.monitor import (
    CollapseMonitor,
    chain_health,
    floor_epoch,
    memorisation_epoch,
    label_entropy,
    noise_floor,
    overfit_epoch,
    warmup_end_epoch,
    warmup_fall,
    warmup_rise,
)
from pipeline.core.posterior import STATE_KEY, PosteriorWindow
from pipeline.core.warmup import estimate_phi_init, initial_latents
from pipeline.train.fastpath import HostStage
from pipeline.train.labeler import GibbsLabeler
from pipeline.train.loop import LabelTask, StepInput, Task, predict
from pipeline.train.methods.base import Method, register
from pipeline.train.report import accumulator_for, finish_epoch, record_if_selected

OUTLIERS_FILE = "outliers.csv"
OUTLIER_COLUMNS = ("idx", "key", "observed", "p_outlier", "flag")


def outlier_table(p_outlier: Tensor, observed: Tensor, rows: Tensor, *, threshold: float,
                  keys: Sequence[str] | None = None) -> str:
    """The ``outliers.csv`` text: one line per training sample ``rows (M,)`` (idx of the
    split): ``idx``, ``key`` (``keys[idx]``; empty when unknown), ``observed``,
    ``p_outlier`` (empty for a sample never drawn in the window) and ``flag`` (1 when
    ``p_outlier > threshold``). p_outlier, observed: ``(N,)`` by idx."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(OUTLIER_COLUMNS)
    for r in rows.tolist():
        p = float(p_outlier[r])
        key = keys[r] if keys is not None else ""
        w.writerow((r, key, int(observed[r]), "" if p != p else f"{p:.6f}",
                    "" if p != p else int(p > threshold)))
    return out.getvalue()


def swing_warning(ce_rows: list[dict], n_val: int) -> str | None:
    """The warning, with its numbers, when the cross-entropy warm-up's rows end more than
    two standard errors below their best noisy validation accuracy
    (:func:`~pipeline.core.monitor.warmup_fall`); None otherwise. The noise phase's
    transition and initial latent labels come from the last warm-up epoch's classifier
    (unless ``warmup_weights="best"``): on the digits quickstart's 4-epoch warm-up at
    learning rate 0.1 one that ended 9.6 points below its best left a latent class empty
    (docs/label-issues.md)."""
    fall, se, at = warmup_fall(ce_rows, n_val)
    if not fall > 2 * se:  # NaN: no validation split
        return None
    best = at + 1  # the warm-up's epochs are its rows (a continued run's are shifted)
    return (f"[lccn] warning: the cross-entropy warm-up ends on a classifier "
            f"{fall * 100:.1f} points below its best noisy validation accuracy "
            f"({float(ce_rows[-1]['val_top1']):.3f} at its last epoch, "
            f"{float(ce_rows[at]['val_top1']):.3f} at epoch {best}; one standard error "
            f"{se * 100:.1f} points over {n_val} held-out images): the noise phase starts "
            f"its transition and latent labels from a classifier on a swing down, which "
            f"can empty a latent class; --warmup-weights best starts it from epoch {best}'s "
            f"weights (or: --pretrain-epochs {best}, a lower warm-up learning rate)")


class GibbsTask(LabelTask):
    """LCCN's training pass in the noise phase: forward -> Gibbs-sample z (Eq. 7) with the
    ``labeler`` -> ξ-clipped CE on z (or, with ``targets="posterior"``, on the Eq. 7
    conditional z was drawn from; ``"map"``: its arg max), the observed label's CE mixed in
    while the labeler's ramp is below 1 -> backward -> optimiser step -> commit z (async;
    the store's reply is awaited by the next sample). ``observe(idx (B,), posterior (B,
    K_latent), valid (B,) bool)`` sees the Eq. 7 conditional of every batch (LCCN*'s
    p(outlier) average, the label-issue report). ``sampler_model``: the network whose
    class probabilities Eq. 7 reads instead of the trained one's (an eval-mode network no
    step trains; :attr:`LCCNConfig.guard_sampler`, :attr:`LCCNConfig.teacher`).

    On an accelerator z goes to the host through a pinned buffer whose copy is enqueued
    right after sampling and awaited only after backward and the optimiser step are
    enqueued, so the device stays busy.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 labeler: GibbsLabeler, trusted: Tensor | None = None, xi: float = 1e-20,
                 known_below: int | None = None,
                 observe: Callable[[Tensor, Tensor, Tensor], None] | None = None,
                 sampler_model: torch.nn.Module | None = None) -> None:
        super().__init__(model, optimizer, trusted=trusted, xi=xi, known_below=known_below)
        self.labeler, self.observe, self.sampler_model = labeler, observe, sampler_model
        self.stage = HostStage()

    def begin(self) -> None:
        super().begin()
        self.steps = 0
        self.changed: Tensor | None = None  # summed on the device, read once in end()
        self.staleness = self.sampler = self.sync = 0.0
        self.gamma = 1.0

    def forward(self, k: int, step: StepInput) -> tuple[Tensor, Tensor]:
        b, lab = step.batch, self.labeler
        if self.steps == 0:
            lab.prefetch(b.idx)
        self.steps += 1
        logits, w, labels_d = self.logits(step)
        t0 = time.perf_counter()
        if self.sampler_model is None:
            probs = torch.softmax(logits.detach().float(), dim=1)
        else:
            with torch.no_grad():
                probs = torch.softmax(self.sampler_model(step.images).float(), dim=1)
        z, stats = lab.sample(probs, b.observed, b.idx)
        self.sampler += time.perf_counter() - t0 - stats.wait
        self.sync += stats.wait
        if self.observe is not None:
            self.observe(b.idx, stats.posterior, b.valid)
        target = z if lab.cfg.targets != "map" else stats.posterior.argmax(1)
        target = target.to(step.images.device, non_blocking=True)
        self.stage.put(z)  # to the host for the commit, without waiting for it here
        if self.changed is None:
            self.changed = torch.zeros((), dtype=torch.float64, device=step.images.device)
        self.changed += stats.changed
        self.staleness += stats.staleness
        self.gamma = stats.gamma
        if lab.cfg.targets == "posterior":
            loss = soft_cross_entropy(logits, stats.posterior.to(step.images.device), xi=self.xi,
                                      weight=w)
        else:
            loss = clipped_cross_entropy(logits, target, xi=self.xi, weight=w)
        if stats.ramp < 1.0:
            # the LCCN target's weight ramps up from 0: a weak pretrained classifier keeps
            # learning from the observed labels while its own posterior is still poor
            loss = stats.ramp * loss + (1.0 - stats.ramp) * clipped_cross_entropy(
                logits, labels_d, xi=self.xi, weight=w)
        return loss, target

    def after_step(self, k: int, step: StepInput) -> None:
        # send the labels now: the round trip overlaps the next forward; the reply is
        # awaited by the next sample()
        t0 = time.perf_counter()
        b, nxt = step.batch, step.nxt
        z_host = self.stage.get()
        self.labeler.commit(b.idx[b.valid], z_host[b.valid], nxt.idx if nxt is not None else None)
        self.sync += time.perf_counter() - t0

    def end(self) -> dict[str, float]:
        fit = super().end()
        self.sync += self.labeler.flush()
        per = max(self.steps, 1)
        changed = 0.0 if self.changed is None else float(self.changed)
        return {**fit, "changed": changed / per, "staleness": self.staleness / per,
                "gamma": float(self.gamma), "sampler_time": self.sampler,
                "sync_time": self.sync}


@register
class LCCN(Method):
    """State: ``phi_init`` (None until the noise phase starts), the LCCN step count
    ``lccn_step`` (the labeler's; it seeds the distributed Gibbs draws and drives the
    annealing and the target ramp), the collapse monitor's reference accuracy. The chain
    itself (C and z) lives in the engine's chain backend."""

    name = "lccn"
    needs_chain = True
    auto_warmup = True

    def __init__(self, run, engine) -> None:
        super().__init__(run, engine)
        self.cfg = run.lccn
        data = engine.data
        self.trusted: Tensor | None = data.trusted if self.cfg.use_trusted else None
        if self.trusted is not None and not self.cfg.outlier:
            bad = torch.nonzero(self.trusted & (data.clean >= self.num_classes))[:, 0]
            if bad.numel():
                raise ValueError(f"{bad.numel()} trusted samples are labelled outliers (clean "
                                 f"= K = {self.num_classes}; first idx {int(bad[0])}): they "
                                 f"train on the outlier class, which needs LCCN* "
                                 f"(LCCNConfig.outlier)")
        self.monitor = CollapseMonitor(run.monitor)
        # the memorisation guard (LCCNConfig.guard_drop): the epoch whose end showed the
        # classifier memorising, after which self.cfg holds the switched targets and prior
        self.guarded_at: int | None = None
        # LCCNConfig.guard_sampler "frozen": the network Eq. 7 reads once the guard fired
        # (bare: what a checkpoint keeps; wrapped: what the step calls) and, in a resumed
        # run, the saved copy's weights until the guard fires again from the epoch rows
        self.sampler_bare: torch.nn.Module | None = None
        self.sampler_model: torch.nn.Module | None = None
        self._saved_sampler: dict[str, Tensor] | None = None
        # until it fires: the weights after the noise phase's epoch with the best noisy
        # validation accuracy so far (the copy it freezes), that accuracy, and the last
        # epoch row looked at (a run resumed within an epoch does not look at it again)
        self._best: dict[str, Any] = {"val": float("-inf"), "seen": -1, "epoch": None,
                                      "weights": None}
        # LCCNConfig.warmup_weights "best": the same over the warm-up's epochs (the copy the
        # noise phase starts from; dropped once it has)
        self._warm: dict[str, Any] = {"val": float("-inf"), "seen": -1, "epoch": None,
                                      "weights": None}
        # the epoch whose copy sampler_model holds (teacher="best", or a guard's frozen
        # sampler; None: the live network, or a frozen copy of no validated epoch)
        self._teacher_epoch: int | None = None
        self._guard_ranks = 0.0  # the ranks switched (all agree: 0 or the world size)
        self.phi_init: Tensor | None = None
        # H(observed | clean) that phi_init implies (every rank's rows: the guard reads it)
        self.noise_floor: float | None = None
        # H(observed): the observed labels' entropy (every rank's rows), guard_rise's scale
        self.label_entropy: float | None = None
        self.lccn_step = 0
        self._noise_start: int | None = None  # pretrain_auto: decided from the epoch rows
        self.labeler: GibbsLabeler | None = None
        self.pretrained_probs: Tensor | None = None
        # LCCN*: p(outlier), the outlier column of the posterior averaged over the last
        # cfg.outlier_epochs epochs' draws (float64: printed to six decimals)
        k, o = self.num_classes, run.optim
        self.outlier_mean = (PosteriorWindow(
            num_samples=engine.data.num_samples, width=1, columns=slice(k, k + 1),
            first=max(o.pretrain_epochs, o.epochs - self.cfg.outlier_epochs),
            total_epochs=o.epochs, dtype=torch.float64) if self.cfg.outlier else None)
        # the label-issue report: the whole posterior averaged over the last
        # cfg.report_epochs epochs (pipeline.track.label_issues)
        self.report = accumulator_for(run, engine, k_latent=self.num_outputs())
        self.windows = [w for w in (self.outlier_mean, self.report) if w is not None]

    @classmethod
    def latent_classes(cls, run, num_classes: int) -> int:
        return num_classes + 1 if run.lccn.outlier else num_classes

    @classmethod
    def names_samples(cls, run) -> bool:
        return run.lccn.outlier  # outliers.csv

    def in_noise_phase(self, epoch: int) -> bool:
        start = self.noise_start()
        return start is not None and epoch >= start

    def noise_start(self) -> int | None:
        """The noise phase's first epoch: ``pretrain_epochs``, or with ``pretrain_auto``
        the epoch the rows so far decide (:func:`~pipeline.core.monitor.warmup_end_epoch`;
        None while the warm-up goes on)."""
        o = self.run.optim
        if not o.pretrain_auto:
            return o.pretrain_epochs
        if self._noise_start is None:
            held = getattr(self.engine.data, "held_out", None)
            self._noise_start = warmup_end_epoch(
                self.engine.history, n_val=0 if held is None else int(held.sum()),
                cap=o.pretrain_epochs)
        return self._noise_start

    def noise_phase_started(self) -> bool:
        return self.phi_init is not None

    def start_noise_phase(self, epoch: int) -> dict[str, float]:
        """Algorithm 3 lines 2-3 over all ranks: phi_init (K_latent, K) float64 from the
        pretrained classifier (statistics all-reduced) and the initial assignment of this
        rank's samples into the chain; the monitor's reference accuracy."""
        eng, lc = self.engine, self.cfg
        data = eng.data
        self._start_from_best_warmup()
        probs, idx, _ = predict(self.members[0].scorer, data.train_eval_batches(),
                                device=eng.device)
        observed = data.observed[idx]
        phi_init = estimate_phi_init(lc, probs, observed, eng.k_latent, self.num_classes,
                                     reduce=eng.reduce_cpu)
        self.pretrained_probs = probs
        # the class shares: the training labels' over every rank (phi_init's columns)
        shares = eng.reduce_cpu(torch.bincount(observed.long(),
                                               minlength=self.num_classes).double())
        self.noise_floor = noise_floor(phi_init, shares)
        self.label_entropy = label_entropy(shares)
        z0 = initial_latents(lc, observed, probs, phi_init)
        eng.chain.start(idx, z0, k_latent=eng.k_latent, trusted=self.trusted, clean=data.clean)
        self.phi_init = phi_init
        self.monitor.start(eng.val_top1(), lr=eng.trained_lr())
        self._notes()
        return {"init_transition_error": transition_error(phi_init, data.transition)}

    def _remember_warmup(self) -> None:
        """``warmup_weights="best"``: after each warm-up epoch whose noisy validation
        accuracy beats every earlier one's, keep a copy of the network's weights (and its
        weight average's). The last row is the epoch just ended, whose weights these are;
        every rank reads the same rows, so all keep the same epoch."""
        hist = self.engine.history
        if self.cfg.warmup_weights != "best" or not hist or self.noise_phase_started():
            return
        row = hist[-1]
        epoch = int(row.get("epoch", -1))
        if epoch <= self._warm["seen"]:
            return
        self._warm["seen"] = epoch
        val = float(row.get("val_top1", float("nan")))
        if val > self._warm["val"]:  # False for NaN: no validation split, no copy
            m = self.members[0]
            self._warm.update(val=val, epoch=epoch, weights={
                "model": {k: v.detach().clone() for k, v in m.model.state_dict().items()},
                "ema": None if m.ema is None else {
                    k: v.detach().clone() for k, v in m.ema.state_dict().items()}})

    def _start_from_best_warmup(self) -> None:
        """At the noise phase's start, with ``warmup_weights="best"``: load the best
        warm-up epoch's weights into the network when it is not the last one."""
        self._remember_warmup()
        saved, at = self._warm["weights"], self._warm["epoch"]
        self._warm["weights"] = None
        hist = self.engine.history
        if saved is None or not hist or at == int(hist[-1].get("epoch", -1)):
            return
        m = self.members[0]
        m.model.load_state_dict(saved["model"])
        if m.ema is not None and saved["ema"] is not None:
            m.ema.load_state_dict(saved["ema"])
        if self.engine.session.rank == 0:
            last = float(hist[-1].get("val_top1", float("nan")))
            print(f"[lccn] warmup_weights best: the noise phase starts from the warm-up's "
                  f"epoch {at + 1} (noisy validation accuracy {self._warm['val']:.3f}; the "
                  f"last epoch's {last:.3f})", flush=True)

    def _guard(self, epoch: int) -> None:
        """The memorisation guard: from the epoch rows so far (every rank holds the same,
        a resumed run its checkpoint's), switch the rest of the run to
        ``guard_targets`` and the anchored prior once they show the classifier memorising
        (:func:`~pipeline.core.monitor.memorisation_epoch`, ``guard_drop``; and
        :func:`~pipeline.core.monitor.floor_epoch`, ``guard_floor``: the first to fire
        switches). The labeler is made again with
        the new prior at the next :meth:`begin_epoch` (its counts: the store's)."""
        lc = self.cfg
        if not self._guarded() or self.guarded_at is not None:
            return
        first, hist = self.noise_start(), self.engine.history
        val = (memorisation_epoch(hist, first_epoch=first, drop=lc.guard_drop,
                                  patience=lc.guard_patience) if lc.guard_drop > 0 else None)
        floor = floor_epoch(hist, first_epoch=first) if lc.guard_floor else None
        rise = (overfit_epoch(hist, first_epoch=first, rise=lc.guard_rise)
                if lc.guard_rise > 0 else None)
        fired = sorted(
            ([(rise, f"the held-out loss of the observed labels stopped falling while its "
                     f"gap to the training loss widened by more than {lc.guard_rise:g} x "
                     f"their entropy (epoch {rise + 1})")] if rise is not None else [])
            + ([(val, f"the noisy validation accuracy has been more than {lc.guard_drop:g} "
                      f"below its best for {lc.guard_patience} epochs (to epoch {val + 1})")]
               if val is not None else [])
            + ([(floor, f"the classifier's loss on the observed labels fell below the noise "
                        f"floor {self.noise_floor:.3f} (epoch {floor + 1})")]
               if floor is not None else []))
        if not fired:
            return
        at, why = fired[0]
        frozen_at = ""
        self.guarded_at = at
        self.cfg = replace(lc, targets=lc.guard_targets,
                           prior_strength=max(lc.prior_strength, lc.guard_prior_strength))
        if lc.guard_sampler == "frozen" and lc.teacher != "best":
            # the classifier of the best noisy-validation epoch so far (without a
            # validation split: as it stands at the switch); resumed: the saved copy
            saved = self._saved_sampler if self._saved_sampler is not None \
                else self._best["weights"]
            frozen_at = ("the run's resumed copy" if self._saved_sampler is not None
                         else f"epoch {self._best['epoch'] + 1} (the best noisy validation "
                              f"accuracy so far)" if saved is not None else "this epoch's start")
            self.sampler_bare, self.sampler_model = self.engine.frozen_copy(
                self.members[0], saved)
            self._teacher_epoch = self._best["epoch"] if saved is not None else None
            self._saved_sampler = None
            self._best["weights"] = None
        if self.labeler is not None:
            self.labeler.flush()
            self.lccn_step = self.labeler.step_count
            self.labeler = None
        if self.engine.session.rank == 0:
            print(f"[lccn] memorisation guard: {why}; from epoch {epoch + 1} on LCCN trains on "
                  f"{self.cfg.targets} targets with prior_strength "
                  f"{self.cfg.prior_strength:g}"
                  + (f"; Eq. 7 reads the classifier frozen as at {frozen_at}"
                     if self.sampler_model is not None else ""), flush=True)

    def _keeps_best(self) -> bool:
        """Whether the best noisy-validation epoch's weights are kept: for the teacher
        (``teacher="best"``, the whole noise phase) or for a guard's frozen sampler (until
        the guard fires)."""
        lc = self.cfg
        if lc.teacher == "best":
            return True
        return self._guarded() and lc.guard_sampler == "frozen" and self.guarded_at is None

    def _guarded(self) -> bool:
        """Whether any memorisation guard trigger is on."""
        lc = self.cfg
        return lc.guard_drop > 0 or lc.guard_floor or lc.guard_rise > 0

    def _remember_best(self) -> None:
        """Keep a copy of the weights (the weight average's when there is one) after each
        epoch from the noise phase's start (the last CE epoch included, except for LCCN*,
        whose outlier output that network has not trained) whose noisy
        validation accuracy beats every earlier one's: the network Eq. 7 reads with
        ``teacher="best"``, or is frozen at when a guard fires. The last row is the epoch
        just ended, whose weights these are."""
        hist = self.engine.history
        if not self._keeps_best() or not hist:
            return
        row = hist[-1]
        epoch = int(row.get("epoch", -1))
        # LCCN*: a network from before the noise phase never trained its outlier output,
        # so it could not read an outlier posterior; the candidates start one epoch later
        first = self.noise_start() - (0 if self.cfg.outlier else 1)
        if epoch <= self._best["seen"] or epoch < first:
            return
        self._best["seen"] = epoch
        val = float(row.get("val_top1", float("nan")))
        warm = self._warm["epoch"]
        if self.cfg.warmup_weights == "best" and epoch == self.noise_start() - 1 and \
                warm is not None and warm != epoch:
            # the warm-up's last row, while the network holds the restored warm-up epoch's
            # weights: the candidate is that epoch, at its own accuracy
            epoch, val = int(warm), float(self._warm["val"])
        # the teacher takes the later of equal epochs (a small validation split ties often,
        # and the later one has learned more); a guard's frozen sampler the earlier
        later = self.cfg.teacher == "best" and val == self._best["val"]
        if val > self._best["val"] or later:  # False for NaN: no validation split, no copy
            self._best.update(val=val, epoch=epoch, weights={
                k: v.detach().clone() for k, v in self.members[0].averaged.state_dict().items()})

    def _select_teacher(self) -> None:
        """``teacher="best"``: the network Eq. 7 reads this epoch. The trained one (None)
        when the epoch just ended holds the best noisy validation accuracy so far (or
        there is none), else the copy of the best epoch's weights (made once per best)."""
        if self.cfg.teacher != "best":
            return
        hist, best = self.engine.history, self._best["epoch"]
        if best is None or (hist and int(hist[-1].get("epoch", -1)) == best):
            self.sampler_bare = self.sampler_model = None
            self._teacher_epoch = None
            return
        if self._teacher_epoch != best or self.sampler_model is None:
            self.sampler_bare, self.sampler_model = self.engine.frozen_copy(
                self.members[0], self._best["weights"])
            self._teacher_epoch = best

    def begin_epoch(self, epoch: int, steps_per_epoch: int) -> None:
        if not self.in_noise_phase(epoch):
            self._remember_warmup()
            return
        self._remember_best()
        self._guard(epoch)
        self._select_teacher()
        self._check_ranks_agree(epoch)
        if self.labeler is None:
            o = self.run.optim
            self.labeler = self.engine.chain.labeler(
                self.cfg, phi_init=self.phi_init,
                max_steps=(o.epochs - self.noise_start()) * steps_per_epoch,
                trusted=self.trusted, clean=self.engine.data.clean,
                steps_per_epoch=steps_per_epoch)
            self.labeler.step_count = self.lccn_step
            if self.report is not None:  # the report's phi: the prior Eq. 7 samples with
                self.report.alpha = self.labeler.alpha.cpu().tolist()
        if hasattr(self.labeler, "max_staleness"):
            self.labeler.max_staleness = 0

    def _check_ranks_agree(self, epoch: int) -> None:
        """Every rank decides the switch and the teacher from the same all-reduced epoch
        rows; one all-reduce per epoch checks it (ranks that disagreed would train on
        different targets from different networks). Records ``guard_ranks``, the ranks
        switched."""
        eng = self.engine
        mine = torch.tensor([float(self.guarded_at is not None),
                             float(-1 if self._teacher_epoch is None else self._teacher_epoch)],
                            dtype=torch.float64)
        total = eng.reduce_cpu(mine.clone()) if eng.session.world_size > 1 else mine
        self._guard_ranks = float(total[0])
        if not torch.equal(total, mine * eng.session.world_size):
            raise RuntimeError(
                f"epoch {epoch + 1}: the ranks disagree on the memorisation switch or the "
                f"teacher (this rank: switched {bool(mine[0])}, teacher epoch "
                f"{int(mine[1])}; summed over {eng.session.world_size} ranks: "
                f"{total.tolist()}): their epoch rows differ")

    def _notes(self) -> None:
        """Rank 0, at the noise phase's start: what the guard and the teacher can see."""
        if self.engine.session.rank != 0:
            return
        o, lc = self.run.optim, self.cfg
        if getattr(self.engine.data, "held_out", None) is None:
            if lc.teacher == "best" or lc.guard_rise > 0 or lc.guard_drop > 0:
                print("[lccn] no noisy validation split (val_fraction 0): Eq. 7 reads the "
                      "network being trained and the memorisation guard cannot fire",
                      flush=True)
            return
        start = self.noise_start()
        self._warmup_note(start)
        if (lc.guard_rise > 0 or lc.guard_drop > 0) and not any(
                m > start for m in o.milestones) and not self.engine.options.lr_values:
            print(f"[lccn] the learning rate never falls after the noise phase's start "
                  f"(epoch {start + 1}; milestones {list(o.milestones)}): the "
                  f"memorisation guard watches only epochs at a lower rate, so it will not "
                  f"fire in this run", flush=True)

    def _warmup_note(self, start: int) -> None:
        """Rank 0, at the noise phase's start: where an automatic warm-up ended and why, or
        a warning with the numbers when a fixed one ends on a classifier whose noisy
        validation accuracy still rises by more than two standard errors."""
        o, hist = self.run.optim, self.engine.history
        n_val = int(self.engine.data.held_out.sum())
        ce_rows = [r for r in hist if int(r.get("epoch", -1)) < start]
        rise, se = warmup_rise(ce_rows, n_val)
        val = max((float(r.get("val_top1", math.nan)) for r in ce_rows), default=math.nan)
        nums = (f"best noisy validation accuracy {val:.3f}, the last two epochs "
                f"{rise * 100:+.1f} points above the best before them, one standard error "
                f"{se * 100:.1f} points over {n_val} held-out images")
        if o.pretrain_auto:
            how = ("stopped rising" if start < o.pretrain_epochs else
                   f"reached its cap of {o.pretrain_epochs} epochs")
            print(f"[lccn] cross-entropy warm-up: {start} epochs (--pretrain-epochs auto: "
                  f"{how}; {nums})", flush=True)
        elif rise > 2 * se:
            # its own rows, not pretrain_epochs: a run continued from another's CE state
            # (the benchmarks' --pretrain-from) starts its noise phase at epoch 0
            n_ce = len({int(r.get("epoch", -1)) for r in ce_rows})
            print(f"[lccn] warning: the cross-entropy warm-up ends after {n_ce} epochs on "
                  f"a classifier still learning ({nums}): the noise phase starts its "
                  f"transition and latent labels from it; --pretrain-epochs auto warms up "
                  f"until the accuracy stops rising", flush=True)
        swing = swing_warning(ce_rows, n_val)
        if swing is not None:
            print(swing, flush=True)

    def _active(self, epoch: int) -> GibbsLabeler | None:
        return self.labeler if self.in_noise_phase(epoch) else None

    def train_task(self, epoch: int) -> Task:
        """The classifier's pass: in the noise phase the labeler samples z for every batch
        (Eq. 7) and commits it after the step, the posterior windows observing each draw;
        before it, cross-entropy on the observed labels (trusted samples: their clean
        label)."""
        m = self.members[0]
        active = self._active(epoch)
        observers = ([fn for fn in (w.sink(epoch) for w in self.windows) if fn is not None]
                     if active is not None else [])

        def observe(idx: Tensor, posterior: Tensor, valid: Tensor) -> None:
            idx, posterior = idx[valid], posterior[valid.to(posterior.device)]
            for fn in observers:
                fn(idx, posterior)

        if active is None:
            return LabelTask(m.train_model, m.optimizer, trusted=self.trusted, xi=self.cfg.xi,
                             known_below=self.num_classes + 1)
        return GibbsTask(m.train_model, m.optimizer, labeler=active, trusted=self.trusted,
                         xi=self.cfg.xi, known_below=self.num_classes + 1,
                         observe=observe if observers else None,
                         sampler_model=self.sampler_model)

    def end_pass(self, epoch: int) -> None:
        if self.labeler is not None:
            self.lccn_step = self.labeler.step_count
        if self._active(epoch) is not None:
            if self.outlier_mean is not None:
                self.outlier_mean.end_epoch(epoch, self.engine.reduce_cpu)
            finish_epoch(self.report, self.engine, epoch, [self.members[0].scorer])

    def scored(self, epoch: int, row: dict[str, float]) -> None:
        """The label-issue report keeps the selected epoch's held-out predictions."""
        if self.report is not None and self.in_noise_phase(epoch):
            record_if_selected(self.report, self.engine, [self.members[0].scorer], row)

    def flush(self) -> None:
        if self.labeler is not None:
            self.labeler.flush()
            self.lccn_step = self.labeler.step_count
        # every rank at every moment: collectives (no-ops, on every rank alike, at an epoch
        # end, where end_pass has merged them already)
        for w in self.windows:
            w.merge(self.engine.reduce_cpu)

    def noise_model(self) -> Tensor | None:
        """The chain's phi from this rank's replica of C (None in the CE phase, where the
        classifier predicts the observed labels itself)."""
        if self.labeler is None:
            return None
        return transition(self.labeler.counts.cpu(), self.labeler.alpha.cpu())

    def epoch_stats(self) -> dict[str, float]:
        return {"staleness_max": float(getattr(self.labeler, "max_staleness", 0))
                if self.labeler is not None else 0.0,
                "guarded": float(self.guarded_at is not None),
                "guard_ranks": self._guard_ranks,
                # the epoch whose copy Eq. 7 read this epoch (teacher="best" or a guard's
                # frozen sampler), -1: the network being trained
                "teacher_epoch": float(-1 if self.sampler_model is None else
                                       self._teacher_epoch if self._teacher_epoch is not None
                                       else -2),
                "noise_floor": float("nan") if self.noise_floor is None else self.noise_floor,
                "label_entropy": (float("nan") if self.label_entropy is None
                                  else self.label_entropy)}

    def observe_chain(self, state: dict | None, *, epoch: int,
                      row: dict[str, float] | None) -> dict[str, float]:
        """transition_error of the chain's phi (NaN before the chain starts); at an epoch
        end of the noise phase the chain's health and the monitor's verdict
        (``collapse``), which raises :class:`~pipeline.core.monitor.ChainCollapsed` itself in
        one process with ``MonitorConfig.stop``."""
        if state is None or self.phi_init is None:
            return {"transition_error": float("nan")}
        # the chain's phi: its counts, plus the anchored prior's pseudo-counts when the run
        # has one (LCCNConfig.prior_strength: then phi is what Eq. 7 samples with)
        prior = (self.labeler.alpha.cpu() if self.labeler is not None
                 and self.cfg.prior_strength > 0 else 0.0)
        phi = transition(state["counts"], prior)
        out = {"transition_error": transition_error(phi, self.engine.data.transition)}
        if row is None:
            return out
        health = chain_health(state["z"], state["observed"], self.engine.k_latent,
                              self.num_classes, counted=state["counted"], phi=phi,
                              phi_init=self.phi_init)
        stop = None if self.engine.options.raise_on_collapse else False
        val = row.get("val_top1", float("nan"))
        out.update(health)
        out["val_compared"] = float(self.monitor.compares(row.get("lr")))
        out["collapse"] = float(bool(self.monitor.check(health, val, epoch=epoch,
                                                        lr=row.get("lr"), stop=stop)))
        return out

    def final_files(self) -> dict[str, str]:
        """LCCN*: ``outliers.csv`` (:func:`outlier_table`) over every training sample (the
        noisy validation split left out), from the draws of the last ``outlier_epochs``
        epochs, summed over ranks (:class:`~pipeline.core.posterior.PosteriorWindow`)."""
        if self.outlier_mean is None or self.outlier_mean.sum is None:
            return {}
        eng = self.engine
        n = eng.data.num_samples
        train = torch.ones(n, dtype=torch.bool)
        held_out = getattr(eng.data, "held_out", None)
        if held_out is not None:
            train &= ~torch.from_numpy(np.asarray(held_out, bool))
        opts = eng.options
        return {OUTLIERS_FILE: outlier_table(
            self.outlier_mean.mean()[:, 0], eng.data.observed, torch.nonzero(train)[:, 0],
            threshold=self.cfg.outlier_threshold, keys=opts.sample_keys)}

    def state_dict(self) -> dict[str, Any]:
        # the guard's frozen sampler (the teacher's copy is re-made from guard_best)
        sampler = (None if self.cfg.teacher == "best" else self.sampler_bare.state_dict()
                   if self.sampler_bare is not None else self._saved_sampler)
        return {"lccn_step": self.lccn_step, "phi_init": self.phi_init,
                "noise_floor": self.noise_floor, "label_entropy": self.label_entropy,
                "guard_sampler": None if sampler is None else {
                    k: v.detach().cpu() for k, v in sampler.items()},   # never trained
                "guard_best": {**self._best, "weights": None if self._best["weights"] is None
                               else {k: v.cpu() for k, v in self._best["weights"].items()}},
                "warmup_best": {**self._warm, "weights": None if self._warm["weights"] is None
                                else {part: None if w is None else {k: v.cpu() for k, v in
                                                                   w.items()}
                                      for part, w in self._warm["weights"].items()}},
                **self.monitor.state_dict(),
                "outlier_mean": (None if self.outlier_mean is None
                                 else self.outlier_mean.state_dict()),
                STATE_KEY: self.report.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lccn_step = int(state.get("lccn_step", 0))
        self.phi_init = state.get("phi_init")
        self.noise_floor = state.get("noise_floor")
        self.label_entropy = state.get("label_entropy")
        # the frozen sampler comes back when the guard fires again from the epoch rows
        self._saved_sampler = state.get("guard_sampler")
        best = state.get("guard_best")
        if best is not None:
            self._best = dict(best)
        warm = state.get("warmup_best")
        if warm is not None:
            self._warm = dict(warm)
        self.monitor.load_state_dict(state)
        saved = state.get("outlier_mean")
        if saved is not None and self.outlier_mean is not None:
            if "sums" in saved:  # a checkpoint of the earlier rank-0 gather format
                saved = {"sum": saved["sums"], "count": saved["draws"]}
            self.outlier_mean.load_state_dict(saved)
        self.report.load_state_dict(state.get(STATE_KEY))
