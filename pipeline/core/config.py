"""Typed, frozen configs, one per concern. Jobs build them; at the Ray boundary they travel
as ``asdict`` dicts and are rebuilt with :func:`from_dict` first thing in the worker."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

DIVISION_LOSSES = ("lccn", "prediction")
WARMUPS = ("eq8", "identity", "anchor")
INITS = ("argmax", "observed")
WARMUP_PRIORS = ("model", "deconvolved")
TARGETS = ("sample", "posterior", "map")
GUARD_SAMPLERS = ("frozen", "live")
TEACHERS = ("best", "live")
WARMUP_WEIGHTS = ("last", "best")
TRANSITIONS = ("anchor", "eq8", "file")


@dataclass(frozen=True)
class LCCNConfig:
    """The LCCN sampler and its variants.

    alpha: Dirichlet parameter, scalar or one value per observed class (> 0).
    prior_strength: the warm-up estimate ``phi_init`` as the Dirichlet prior of phi's rows
        after the warm-up: row k's prior is ``α_j + m · phi_init[k, j]`` with ``m =
        prior_strength · N / K_latent`` pseudo-counts (N: the samples counted in C; 1 weighs
        the estimate as much as an average row's counts). 0 (default): the paper's
        symmetric α alone. Where the classifier memorises its labels, the counts follow it
        (z → the observed labels, φ → the identity) and LCCN memorises with CE; the anchor
        keeps the estimated noise in φ. On the CPU memorisation protocol (symmetric 0.5,
        seed 0, sampled targets; benchmarks/results/cifar.md) strength 1 ends 4.9 points
        above CE at the final epoch and the default 8.2 below it (posterior targets then
        make LCCN a Forward correction, which memorises: 4.2 below CE even with strength
        1). Off by default until measured on every setting and on the protocol where CE
        does not memorise (where the counts refine the estimate: at asymmetric 0.5 they
        reach a φ error of 0.015).
    warmup_steps: δ, LCCN steps during which the conditional transition is replaced by
        ``phi_init``.
    warmup: how ``phi_init`` is estimated from the pretrained classifier. ``"anchor"``
        (default): the anchor-point estimate (Patrini et al. 2017): a classifier trained
        with CE on the observed labels estimates the *noisy* posterior P(ỹ | x), which at
        samples that surely belong to class k equals row k of phi. Consistent for a weak,
        under-confident classifier too. ``"eq8"``: the paper's Eq. 8 soft confusion, which
        treats the classifier as the *clean* posterior: a flat (weak) classifier shrinks
        its diagonal towards 1/K, the chain then follows the classifier more than the
        labels and can collapse (see docs/fidelity.md). ``"identity"``: ``(1-s) I + s/K``.
    warmup_prior: what Eq. 7 reads as the prior P(z | x) during the warm-up (and the
        ``argmax`` initial assignment). ``"model"`` (default, the paper): the classifier's
        probabilities. ``"deconvolved"``: the classifier read as what CE pre-training made
        it, the *noisy* posterior P(ỹ | x) (as the anchor estimate reads it), and turned
        into the clean one through ``phi_init`` (:func:`pipeline.core.warmup.deconvolve`). The
        paper's reading counts the noise twice: under a 0.5 cat→dog flip a CE classifier
        says 0.5 / 0.5 on a cat labelled dog, Eq. 7 draws it back to cat with probability
        1/3 instead of 1, and the counts that take over after the warm-up start from
        ``phi[cat, dog]`` near 0.25 instead of 0.5, where they stay (with posterior targets
        every such split is a fixed point). On CIFAR-10 at asymmetric 0.5 (CPU benchmark,
        three seeds) the deconvolved prior takes the φ error from 0.015 to 0.009 and the
        accuracy up 0.9 points, after a first LCCN epoch that overshoots (z relabels more
        than the noise did). Off by default: from a flat classifier under symmetric or
        instance-dependent noise the deconvolution amplifies its errors and the warm-up
        collapses for an epoch (once ending 3.9 points below CE;
        benchmarks/results/cifar.md). For noise that flips class pairs.
    anchor_quantile: the anchors of class k are the samples whose P(k | x) is at or above
        this quantile of P(k | ·) over the training split (0.97 as in Patrini et al.).
    init: the initial assignment of z when the LCCN phase starts. ``"argmax"`` (default,
        the paper): the pretrained classifier's arg max (through ``warmup_prior``);
        ``"observed"``: the observed labels.
    targets: what the classifier regresses on. ``"posterior"`` (default): the Eq. 7
        conditional p(z_m = k | ...) itself, i.e. the expectation of the paper's loss on
        the sampled label over the Gibbs draw (Rao-Blackwellised: the same expected
        gradient, without the variance of a one-hot draw from a flat posterior, which is
        what lets a weak classifier train on targets noisier than the observed labels).
        The chain (z and C) is still advanced by the exact Eq. 7 draw. ``"sample"``: the
        paper's one-hot z.
    ramp_epochs: the LCCN target's weight in the loss rises linearly from 0 to 1 over this
        many epochs at the start of the LCCN phase, the observed label taking the rest (0 =
        the paper: the LCCN target alone from the first step). The Eq. 7 posterior is only
        as good as the classifier: from a weak pre-trained classifier it is noisier than the
        labels, and a classifier trained on it at once degrades and drags the chain down with
        it; the ramp lets it keep learning from the labels while its posterior improves. It is
        counted in epochs, not as a share of the phase, because what it must outlast is a
        pass or two of the classifier over its own posterior, whatever the schedule's
        length, and every epoch of it teaches the classifier the flips the noise model then
        has to unlearn (on CIFAR-10 at asymmetric 0.5 from 8 CE epochs: +9.9 points over CE
        without a ramp, +6.4 with four epochs of it). One epoch (default) keeps a weak digits
        start 3 points above CE (4 below without a ramp); from a very weak CIFAR-10 start
        (3 CE epochs) it ends a point below CE and two epochs end level with it
        (docs/fidelity.md has the table).
    anneal: power annealing γ = max(exp(-anneal_rate * step / max_step), anneal_floor)
        (the paper's setting on Clothing1M/WebVision); off (γ = 1) by default, as on CIFAR.
    outlier: LCCN*, ``K_latent = K + 1`` with the last latent class = out of distribution.
    outlier_prior, outlier_warmup: LCCN* only: the prior mass ε of the outlier class in
        Eq. 7 over the first ``outlier_warmup`` fraction of the LCCN phase (0: off; 0.5 makes
        the exported outlier flags fire, at some cost in accuracy). Over the
        first ``outlier_warmup`` fraction of the LCCN phase, Eq. 7 reads the classifier's
        probabilities as ``(1 - ε) P(· | x) + ε e_K`` with ``ε = outlier_prior``: the CE
        pre-training on K observed classes only ever pushes the outlier logit down, so
        without a prior mass Eq. 7 (``P(K | x) φ[K, j]``) almost never proposes the outlier
        class and LCCN* stays LCCN (docs/methods.md). Off (0) by default: on real CIFAR-10
        (benchmarks/results/cifar_methods.md) ε = 0.5 cost LCCN* 1-2 points of test
        accuracy in three settings and 15 at symmetric 0.5, where the weak diagonal of φ
        lets the prior draw in-distribution samples into the outlier class. Set it (0.5
        over the first half: the best tried on the digits with 20% planted outliers,
        benchmarks/results/outliers.md) when the outlier flags are what you are after:
        without it the exported p(outlier) still ranks outliers first but rarely crosses
        the flag threshold.
    outlier_epochs, outlier_threshold: at the end of an LCCN* run every training sample's
        p(outlier), the Eq. 7 posterior of the outlier class averaged over its draws in the
        last ``outlier_epochs`` epochs, is exported (``outliers.csv``) with a flag
        ``p(outlier) > outlier_threshold``.
    refresh_steps: after the warm-up, Eq. 7's transition term is the exact collapsed
        conditional ``(α_j + C¬[k, j]) / Σ_j' (α_j' + C¬[k, j'])`` of the current counts,
        the sample's own count removed, at every step (1, default). With n > 1 it is
        ``φ = (C + α) / rowsum`` of the counts as they were at the last refresh, refreshed
        every n LCCN steps, as in the paper's code (``freq_trans = 200``): the classifier
        then samples against a transition that does not follow its last few hundred draws,
        which damps the loop of a chain chasing its own recent moves (one more option of the
        paper's protocol; on the CPU benchmark within a few tenths of a point of the exact
        conditional, benchmarks/results/cifar.md, so off). DivideLCCN's co-refinement reads the
        same transition; its division loss keeps the current counts. The refresh point
        restarts at a resumed run's first step.
    use_trusted: LCCN+, trusted samples train on their clean label and are never counted.
    commit_every: a worker sends its sampled labels to the store once every this many
        steps, in one call (1: one call per step). Its own moves reach its replica of C at
        once; the other workers' arrive up to ``commit_every`` of their steps later (the
        staleness metric). One worker samples the same chain whatever the value. Default 8:
        one actor then absorbs ~200,000-360,000 samples/s at batch 64 instead of ~30,000,
        with no measurable change in accuracy (benchmarks/results/actor.md, staleness.md);
        keep it well under the steps of an epoch (a distributed worker caps it at a
        quarter of its steps per epoch).
    guard_drop, guard_patience, guard_targets, guard_prior_strength: the memorisation
        guard, which switches LCCN to hard targets and the anchored prior once the noisy
        validation accuracy shows the classifier memorising. Where the classifier memorises its noisy labels, the chain follows it (z ->
        the observed labels, φ -> the identity) and LCCN with posterior targets memorises
        with CE; where it does not, hard targets and the anchored prior cost accuracy
        (docs/fidelity.md, "Which regime a run is in"). The guard watches the measured
        signal of memorisation, the noisy validation accuracy falling, and switches only
        then: once the learning rate has fallen below the LCCN phase's first one (before,
        epoch-to-epoch swings of 3-4 points are common), when ``guard_patience``
        consecutive epochs end more than ``guard_drop`` below the best noisy validation
        accuracy since, the rest of the run trains on ``guard_targets`` with
        ``prior_strength`` raised to ``guard_prior_strength`` (the warm-up estimate holds
        the noise in φ that the counts have lost). The decision reads only the epoch rows
        (``val_top1``, ``lr``), so every rank and a resumed run make the same one.
        0 (``guard_drop``, default) switches it off. Measured at 0.02 (CPU memorisation
        protocol, seed 0; benchmarks/results/cifar.md): it fires in none of the 40
        recorded runs of the protocol where CE does not memorise, and where CE memorises
        it recovers part of what the defaults lose (symmetric 0.5: 30.0 against 25.1,
        asymmetric 0.5: 55.3 against 53.6, instance-dependent 0.4: 39.8 against 38.7) but
        switches 4-8 epochs after the peak, too late to reach CE at symmetric 0.5 (33.3);
        hence off.
    guard_rise: the memorisation guard's default trigger (0: off): the switch above, at the
        end of the first epoch at a learning rate below the noise phase's first whose
        held-out loss of the observed labels (``val_observed_loss``: ``-log P(ỹ | x)`` on the
        noisy validation split, no noise model) is above its lowest value at that rate or
        lower, while the gap between it and the training pass's loss of the observed labels
        (``observed_loss``) has widened by more than ``guard_rise x H(ỹ)`` since that lowest
        epoch (:func:`~pipeline.core.monitor.overfit_epoch`; ``H(ỹ)``: the entropy of the
        observed labels' class shares, the loss of a classifier that knows nothing of the
        image, which scales the gap to the problem: 2.3 nats for ten balanced classes). It
        needs no estimate of φ: images of the training split and of the validation split
        carry labels from the same noisy distribution, so a classifier that learns what
        generalises fits both alike; one whose training fit runs ahead of its held-out fit of
        the same kind of labels, with the held-out fit no longer improving, is learning the
        training images' own labels, i.e. memorising them, and noise it memorises is what
        then comes back through Eq. 7. (The training loss is the pass's, on augmented
        images in train mode: above the eval-mode loss, so the gap it gives is the smaller.)
        At the phase's first rate the held-out loss swings by tens of percent from one epoch
        to the next with no trend, so those epochs are not watched (a schedule with no decay
        in the noise phase is never guarded; the run says so). Replayed on the recorded CE
        runs (benchmarks/results/guard.md): where CE memorises (the CPU stress protocol, 17
        runs) the gap widens by 0.26-1.41 x H(ỹ) and the trigger fires one to three epochs
        after the learning-rate decay (epoch 14-15 of 40 in 14 of them, after a decay at 12);
        where CE does not (the fidelity protocol, 12 runs) the gap widens by at most 0.019 x
        H(ỹ) and it never fires. Needs a validation split (``val_fraction > 0``).
    guard_floor: the same switch when ``observed_loss`` falls below ``noise_floor``, the
        label noise's entropy H(observed | clean) that the warm-up's φ implies. Off by
        default: it inherits the bias of the warm-up estimate (at asymmetric 0.5 on CIFAR
        the estimate implies 0.56-0.65 nats against a true 0.28, so the classifier crosses
        it at the first learning-rate decay whether it memorises or not), and under
        instance-dependent (real) noise H(observed | x) lies below the class-conditional
        floor, so a classifier that learns the image-dependent noise, not memorising,
        crosses it too.
    guard_sampler: where Eq. 7's class probabilities come from once the guard has switched.
        ``"frozen"`` (default): a copy of the classifier (its weight average when it has
        one) as it was after the epoch with the best noisy validation accuracy from the
        noise phase's start up to the switch (without a validation split: as it is at the
        switch), which no later step trains; ``"live"``: the classifier being trained, as
        before the switch. With the live network the classifier fits its own draws: a
        sample it has begun to memorise gets z = its observed label from Eq. 7, trains on
        it, and memorises it further, whatever φ is (with the true transition held fixed
        the stress protocol still drops 13.8 points from its peak). The frozen copy keeps
        the draws those of a network that had not yet fitted the noise while the trained
        one learns from them; the best noisy-validation epoch rather than the switch's own,
        because at a high learning rate the epoch the loss crosses the floor can be a
        swing down (instance-dependent 0.4 on the stress protocol: 29.1% test at the
        crossing, 42.3% at the best noisy-validation epoch three epochs earlier). It costs
        one forward pass of the copy per step after the switch, and one copy of the
        weights held (and checkpointed) from the noise phase's start.
    teacher: which classifier Eq. 7 reads for P(z | x). ``"live"`` (default): the network
        being trained (the paper), until a memorisation guard fires (then
        :attr:`guard_sampler`'s copy). ``"best"``: the network as it was after the noise phase's
        epoch with the best noisy validation accuracy so far (the last CE epoch
        included), which is the network being trained itself whenever the epoch just
        ended set that best, else a copy kept then that no step trains (re-made at each
        later best; its weight average when it has one; without a validation split the
        live network). Where the classifier memorises its noisy labels, Eq. 7 reading it
        draws each sample back to the label it is memorising (z -> the observed labels,
        φ -> the identity) and LCCN memorises with CE; the held-out accuracy on noisy
        labels is the φ-free measure of that harm, and the teacher stops following the
        classifier exactly when that accuracy stops rising (the noisy validation peak)
        and follows it again when it rises past its best. It costs one forward pass of
        the copy per step in the epochs Eq. 7 reads one, and one copy of the weights held
        (and checkpointed). Measured on CIFAR-10 in seven cells of three seeds each (real
        human labels, CIFAR-10N ``random1`` and ``aggre``, on the protocols where CE
        memorises and where it does not; synthetic 0.2 noise; fine-tuning a network trained
        on clean images; benchmarks/results/cifar_real.md): ``"live"`` ended above
        ``"best"`` in six (by 0.03 to 1.42 points on the mean; 0.14 below when fine-tuning)
        and within 0.5 of CE or above it in all seven, at the final and at the
        noisy-validation-selected epoch; ``"best"`` ended 1.40 below CE on ``aggre`` (9%
        wrong labels) and led at the selected epoch in two cells (by 0.51 and 0.30). Under
        pair flips where CE does not memorise ``"best"`` cost 4.7 points (asymmetric 0.5,
        one seed): the noisy validation accuracy prefers the epochs that undid the flips
        least.
    warmup_weights: the classifier the noise phase starts from (its transition φ_init, the
        initial latent labels, and the network it goes on training). ``"last"`` (default):
        the last cross-entropy epoch's. ``"best"``: the warm-up epoch's with the best noisy
        validation accuracy (its weights, and its weight average's where there is one,
        are loaded into the network at the noise phase's start; the optimiser state is
        kept); without a validation split the last. At a high learning rate the warm-up can
        end on a swing down, and a transition and latent labels read from that classifier
        can empty a latent class: on the digits quickstart's 8-epoch schedule (4 CE, lr
        0.1, 40% pair flips, three seeds; benchmarks/results/label_issues-warmup-best.md)
        ``"best"`` raised the label-issue report's precision at k from 0.56 to 0.83 and
        the cleaned labels from 91.1 / 90.9 / 95.0% to 97.9 / 97.1 / 94.8% right, and the
        clean test accuracy from 0.81 to 0.82 on the mean (seed 1: 0.71 to 0.75-0.80;
        runs of two Ray workers vary). On CIFAR-10N ``random1`` (the memorisation
        protocol, three seeds; benchmarks/results/cifar_real.md) it cost 2.37 points at
        the final epoch and gained 0.29 at the selected one: the network goes on swinging
        at that learning rate from the restored weights. Hence off by default.
        A run warns when its warm-up ends more than two standard errors below its best
        epoch. One copy of the weights is held (and checkpointed) through the warm-up.
    report_epochs: the label-issue report (:mod:`pipeline.track.label_issues`) averages each
        training sample's Eq. 7 posterior over the run's last this many LCCN epochs
        (0: off; memory N x K_latent floats per worker).
    """

    alpha: float | tuple[float, ...] = 1.0
    prior_strength: float = 0.0
    warmup_steps: int = 0
    warmup: str = field(default="anchor", metadata={"choices": WARMUPS})
    warmup_smoothing: float = 0.1
    anchor_quantile: float = 0.97
    init: str = field(default="argmax", metadata={"choices": INITS})
    warmup_prior: str = field(default="model", metadata={"choices": WARMUP_PRIORS})
    targets: str = field(default="posterior", metadata={"choices": TARGETS})
    ramp_epochs: float = 1.0
    anneal: bool = False
    anneal_floor: float = 0.5
    anneal_rate: float = 0.8
    xi: float = 1e-20
    outlier: bool = False
    outlier_prior: float = 0.0
    outlier_warmup: float = 0.5
    outlier_epochs: int = 2
    outlier_threshold: float = 0.5
    use_trusted: bool = False
    refresh_steps: int = 1
    commit_every: int = 8
    report_epochs: int = 5
    guard_drop: float = 0.0
    guard_patience: int = 2
    guard_targets: str = field(default="sample", metadata={"choices": TARGETS})
    guard_prior_strength: float = 1.0
    guard_floor: bool = False
    guard_rise: float = 0.05
    guard_sampler: str = field(default="frozen", metadata={"choices": GUARD_SAMPLERS})
    teacher: str = field(default="live", metadata={"choices": TEACHERS})
    warmup_weights: str = field(default="last", metadata={"choices": WARMUP_WEIGHTS})

    def __post_init__(self) -> None:
        alphas = self.alpha if isinstance(self.alpha, (tuple, list)) else (self.alpha,)
        if isinstance(self.alpha, list):
            object.__setattr__(self, "alpha", tuple(self.alpha))
        if not all(float(a) > 0 for a in alphas):
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {self.warmup!r}")
        if self.warmup_prior not in WARMUP_PRIORS:
            raise ValueError(f"warmup_prior must be one of {WARMUP_PRIORS}, got "
                             f"{self.warmup_prior!r}")
        if self.targets not in TARGETS:
            raise ValueError(f"targets must be one of {TARGETS}, got {self.targets!r}")
        if not (0 <= self.prior_strength < float("inf")):
            raise ValueError(f"prior_strength must be a finite number >= 0, got "
                             f"{self.prior_strength}")
        if not 0 <= self.guard_rise < 1:
            raise ValueError(f"guard_rise must lie in [0, 1), got {self.guard_rise}")
        if not 0 <= self.guard_drop < 1:
            raise ValueError(f"guard_drop must lie in [0, 1), got {self.guard_drop}")
        if isinstance(self.guard_patience, bool) or not isinstance(self.guard_patience, int) \
                or self.guard_patience < 1:
            raise ValueError(f"guard_patience must be an integer >= 1, got "
                             f"{self.guard_patience!r}")
        if self.guard_targets not in TARGETS:
            raise ValueError(f"guard_targets must be one of {TARGETS}, got "
                             f"{self.guard_targets!r}")
        if self.guard_sampler not in GUARD_SAMPLERS:
            raise ValueError(f"guard_sampler must be one of {GUARD_SAMPLERS}, got "
                             f"{self.guard_sampler!r}")
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}")
        if self.warmup_weights not in WARMUP_WEIGHTS:
            raise ValueError(f"warmup_weights must be one of {WARMUP_WEIGHTS}, got "
                             f"{self.warmup_weights!r}")
        if not (0 <= self.guard_prior_strength < float("inf")):
            raise ValueError(f"guard_prior_strength must be a finite number >= 0, got "
                             f"{self.guard_prior_strength}")
        if not (0 <= self.ramp_epochs < float("inf")):
            raise ValueError(f"ramp_epochs must be a finite number >= 0, got {self.ramp_epochs}")
        if not 0 < self.anchor_quantile < 1:
            raise ValueError(f"anchor_quantile must lie in (0, 1), got {self.anchor_quantile}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.anneal_floor <= 1:
            raise ValueError(f"anneal_floor must lie in (0, 1], got {self.anneal_floor}")
        if not 0 < self.xi < 0.5:
            raise ValueError(f"xi must lie in (0, 0.5), got {self.xi}")
        if not 0 <= self.outlier_prior < 1:
            raise ValueError(f"outlier_prior must lie in [0, 1), got {self.outlier_prior}")
        if not 0 <= self.outlier_warmup <= 1:
            raise ValueError(f"outlier_warmup must lie in [0, 1], got {self.outlier_warmup}")
        if isinstance(self.outlier_epochs, bool) or not isinstance(self.outlier_epochs, int) \
                or self.outlier_epochs < 1:
            raise ValueError(f"outlier_epochs must be an integer >= 1, got "
                             f"{self.outlier_epochs!r}")
        if not 0 < self.outlier_threshold < 1:
            raise ValueError(f"outlier_threshold must lie in (0, 1), got "
                             f"{self.outlier_threshold}")
        if isinstance(self.refresh_steps, bool) \
                or not isinstance(self.refresh_steps, int) or self.refresh_steps < 1:
            raise ValueError(f"refresh_steps must be an integer >= 1, got "
                             f"{self.refresh_steps!r}")
        if isinstance(self.commit_every, bool) or not isinstance(self.commit_every, int) \
                or self.commit_every < 1:
            raise ValueError(f"commit_every must be an integer >= 1, got {self.commit_every!r}")
        if isinstance(self.report_epochs, bool) or not isinstance(self.report_epochs, int) \
                or self.report_epochs < 0:
            raise ValueError(f"report_epochs must be an integer >= 0, got {self.report_epochs!r}")


@dataclass(frozen=True)
class BaselineConfig:
    """Options of the classic baselines (:mod:`pipeline.train.methods`: bootstrap, forward,
    sadapt, trevision; the maths is :mod:`pipeline.core.baselines`). Defaults are the authors'.

    bootstrap_beta: β of hard bootstrapping, the observed label's weight against the
        network's own arg max (Reed et al. 2015: 0.8).
    transition: how Forward and T-Revision get ``T[i, j] = P(observed = j | clean = i)``
        at the start of the noise phase. ``"anchor"`` (default; Patrini et al. 2017 and
        Xia et al. 2019): anchor points of the pretrained network at
        ``anchor_quantile``; ``"eq8"``: the soft confusion of the pretrained network
        against the observed labels (the LCCN paper's Eq. 8); ``"file"``: an oracle or
        externally estimated matrix at ``transition_file`` (``.npy``, ``.json``, ``.csv``,
        ``.txt``; :func:`pipeline.core.baselines.load_transition`). S-adaptation always starts
        from Eq. 8 (Goldberger & Ben-Reuven 2017).
    transition_file: the matrix for ``transition="file"`` (an absolute path in a
        distributed run: every worker reads it).
    anchor_quantile: the anchors of class k are the samples whose P(k | x) is at or above
        this quantile (0.97 as Patrini et al. and Xia et al.).
    revision_fraction: T-Revision's revision stage takes this last fraction of the noise
        phase, importance reweighting the rest (the authors: 200 + 200 epochs, 0.5).
    revision_lr, revision_weight_decay: the revision stage's Adam over the network and
        the slack (the authors: 5e-7, 1e-4).
    """

    bootstrap_beta: float = 0.8
    transition: str = field(default="anchor", metadata={"choices": TRANSITIONS})
    transition_file: str | None = None
    anchor_quantile: float = 0.97
    revision_fraction: float = 0.5
    revision_lr: float = 5e-7
    revision_weight_decay: float = 1e-4

    def __post_init__(self) -> None:
        if not 0 <= self.bootstrap_beta <= 1:
            raise ValueError(f"bootstrap_beta must lie in [0, 1], got {self.bootstrap_beta}")
        if self.transition not in TRANSITIONS:
            raise ValueError(f"transition must be one of {TRANSITIONS}, got {self.transition!r}")
        if self.transition == "file" and not self.transition_file:
            raise ValueError("transition 'file' needs transition_file (the matrix's path)")
        if not 0 < self.anchor_quantile < 1:
            raise ValueError(f"anchor_quantile must lie in (0, 1), got {self.anchor_quantile}")
        if not 0 <= self.revision_fraction < 1:
            raise ValueError(f"revision_fraction must lie in [0, 1), got {self.revision_fraction}")
        if not self.revision_lr > 0 or self.revision_weight_decay < 0:
            raise ValueError(f"need revision_lr > 0 and revision_weight_decay >= 0, got "
                             f"{self.revision_lr}, {self.revision_weight_decay}")


def pretrain_count(text: str) -> int | str:
    """``--pretrain-epochs``' value: a count of epochs, or ``"auto"``
    (:attr:`OptimConfig.pretrain_auto`)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"pretrain epochs: expected a whole number or 'auto', got "
                         f"{text!r}") from None


@dataclass(frozen=True)
class OptimConfig:
    """SGD with a step schedule. Epoch counts are total epochs of the run; the first
    ``pretrain_epochs`` train with plain cross-entropy on the observed labels (Algorithm 3,
    line 1) for every method.

    epochs: total epochs of the run, the cross-entropy pre-training included.
    pretrain_epochs: cross-entropy epochs on the observed labels before the method's noise
        phase starts; ``"auto"`` (LCCN): until the noisy validation accuracy stops rising,
        at most half the run (``pretrain_auto``).
    pretrain_auto: ``pretrain_epochs`` is a cap, not a count: the pre-training ends at the
        first epoch from the third on before which the best noisy validation accuracy of
        the last two epochs rose above the best of those before by less than one standard
        error of that accuracy (sqrt(a(1 - a) / n) over the n held-out images), at the latest
        after ``pretrain_epochs`` (:func:`~pipeline.core.monitor.warmup_end_epoch`; read
        from the epoch rows, so every rank and a resumed run decide alike). Setting
        ``pretrain_epochs="auto"`` turns it on with the cap at half of ``epochs``. Methods
        whose schedule is laid out from a fixed count (DivideMix, T-Revision, the
        baselines) refuse it.
    batch_size: the global batch (each of W workers takes ``batch_size / W``).
    lr: the learning rate (of the first phase of a piecewise schedule).
    momentum: SGD's momentum.
    weight_decay: SGD's L2 penalty (see ``norm_weight_decay``).
    milestones: epochs at which the learning rate is multiplied by ``lr_decay``.
    lr_decay: the factor applied at each milestone.
    ema_decay: evaluate an exponential moving average of the weights (0: off, the live
        weights). After global step t the average moves toward the weights by
        ``1 - min(ema_decay, (1 + t) / (10 + t))`` (TensorFlow's ExponentialMovingAverage
        with ``num_updates``); batch-norm statistics are the live network's. Validation,
        test, model selection, the label-issue report's predictions and the pretrained
        predictions that start a noise model (LCCN's and DivideLCCN's phi_init and z,
        Forward's T) use the average; training (DivideMix's division and co-guessing
        included) does not. A checkpoint keeps both: ``models`` (live) and ``emas``. The
        paper's CIFAR code evaluates with 0.9999 (at its lr of 0.5 the live weights of a
        noisy run swing by tens of points from one epoch to the next; the average steadied
        that only partly in 29 epochs measured on a GPU: ``benchmarks/results/gpu.md``).
        Its effective window is about ``1 / (1 - ema_decay)`` steps (the average's weights
        fall to 1/e after that many): 0.9999 averages ~10,000 steps, 26 epochs of CIFAR-10 at
        batch 128 (391 steps an epoch), 0.999 ~1,000 steps (2.6 epochs); pick it from the
        steps of the phase to be averaged, e.g. ``1 - 1 / (steps_per_epoch x epochs)``.
    norm_weight_decay: the weight decay of the normalisation layers' parameters (batch-norm
        scale and shift, and those of group-, layer- and instance-norm) and of every bias;
        None (default): ``weight_decay``, as every other parameter. The paper's CIFAR code
        leaves them out of its L2 penalty (0.0), as do many CIFAR and ImageNet recipes:
        these few parameters set each channel's scale and offset directly, and decaying them
        pulls every channel toward zero output rather than regularising what the network
        computes. The jobs' presets set 0.0 (DivideMix's own recipes keep its authors'
        single penalty); measured on the CPU protocol it moved CE by less than the seed
        noise (benchmarks/results/cifar.md, "The base recipe"). A resumed run must keep the
        value it was started with (the checkpoint's optimiser state holds the groups).
    """

    epochs: int = 30
    pretrain_epochs: int = field(default=10, metadata={"parse": pretrain_count})
    batch_size: int = 128
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    milestones: tuple[int, ...] = ()
    lr_decay: float = 0.1
    ema_decay: float = 0.0
    norm_weight_decay: float | None = None
    pretrain_auto: bool = False

    def __post_init__(self) -> None:
        if self.pretrain_epochs == "auto":  # the cap: half the run
            object.__setattr__(self, "pretrain_auto", True)
            object.__setattr__(self, "pretrain_epochs", max(1, int(self.epochs) // 2))
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"OptimConfig.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.norm_weight_decay is not None and not self.norm_weight_decay >= 0:
            raise ValueError(f"OptimConfig.norm_weight_decay must be >= 0 (or None: "
                             f"weight_decay), got {self.norm_weight_decay}")
        if isinstance(self.milestones, list):
            object.__setattr__(self, "milestones", tuple(self.milestones))
        if self.epochs < 1 or not 0 <= self.pretrain_epochs <= self.epochs:
            raise ValueError(f"need epochs >= 1 and 0 <= pretrain_epochs <= epochs, got "
                             f"{self.epochs} and {self.pretrain_epochs}")
        if self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"batch_size and lr must be positive, got {self.batch_size}, {self.lr}")


def check_bn_momentum(momentum: float) -> float:
    """``momentum`` as a float if it is a batch-norm momentum (0 < m <= 1, PyTorch's
    convention: the new batch's weight), else ValueError naming the value."""
    m = float(momentum)
    if not 0.0 < m <= 1.0:
        raise ValueError(f"bn_momentum must lie in (0, 1] (PyTorch's convention: the weight "
                         f"of the new batch; TensorFlow's decay 0.997 is 0.003), got {momentum}")
    return m


@dataclass(frozen=True)
class ModelConfig:
    """The classifier (:func:`pipeline.train.models.build_model`).

    name: the backbone: a registered name, any timm model (``timm:convnext_tiny``) or
        torchvision model (``tv:resnet18``) (:func:`pipeline.train.models.build_model`).
    in_channels: image channels (3; 1 for grey digits).
    weights: a local file of pretrained weights for a timm or torchvision backbone (read
        with the jobs' ``--pretrained``; ``python -m pipeline.train.models fetch NAME --out
        DIR`` writes one where there is network). None: timm's local cache.
    bn_momentum: momentum of the batch-norm layers' running statistics, in PyTorch's
        convention (the weight of the new batch). None keeps PyTorch's 0.1. The paper's
        CIFAR code (TensorFlow) keeps them with decay 0.997: ``bn_momentum = 0.003``.
    """

    name: str = "small_cnn"
    in_channels: int = 3
    bn_momentum: float | None = None
    weights: str | None = None

    def __post_init__(self) -> None:
        if self.bn_momentum is not None:
            check_bn_momentum(self.bn_momentum)


@dataclass(frozen=True)
class MonitorConfig:
    """The collapse monitor (per epoch of the LCCN phase; see :mod:`pipeline.core.monitor`).

    A chain *collapses* when latent classes merge or vanish, or when the classifier trained
    on its own samples degrades. Each check compares against the state when LCCN started:

    entropy_floor: the entropy of the latent-class histogram falls below this fraction of
        the entropy of the observed-label histogram (classes merging).
    vanish_floor: the smallest latent class holds less than this fraction of the smallest
        observed class (a class vanishing).
    val_drop: accuracy on the noisy validation split falls more than this many points
        (as a fraction) below its value at the start of LCCN (the classifier degrading);
        needs a validation split. Checked only in epochs whose learning rate is at most the
        one the starting network was last trained at: a run restarted from a finished one
        (``--init-from``) is compared once its schedule is back at that rate.
    stop: stop the run (raise :class:`~pipeline.core.monitor.ChainCollapsed`) instead of only
        warning.
    """

    entropy_floor: float = 0.9
    vanish_floor: float = 0.25
    val_drop: float = 0.10
    stop: bool = False

    def __post_init__(self) -> None:
        for name in ("entropy_floor", "vanish_floor", "val_drop"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"monitor {name} must lie in [0, 1], got {v}")


@dataclass(frozen=True)
class DivideConfig:
    """DivideMix and DivideLCCN (methods ``"dividemix"``, ``"divide_lccn"``; see
    docs/methods.md). Their warm-up is ``OptimConfig.pretrain_epochs`` of cross-entropy.

    p_threshold: a sample is in the labelled set when its clean probability (the GMM
        posterior of the low-loss component) exceeds this.
    temperature: sharpening T of co-refined and co-guessed labels.
    mixmatch_alpha: MixMatch's Beta(alpha, alpha) (4 on CIFAR, 0.5 on Clothing1M/WebVision).
    lambda_u: weight of the unlabelled loss, ramped in linearly over ``rampup_epochs``
        after the warm-up (25 on CIFAR-10 at 50% symmetric noise, 0 on the web datasets).
    conf_penalty: add the negative-entropy penalty to the warm-up cross-entropy (DivideMix
        under asymmetric noise and on Clothing1M).
    division_loss: what DivideLCCN divides on once its chains run: ``"lccn"`` (the LCCN
        authors' code: cross-entropy of the LCCN posterior taken as logits) or
        ``"prediction"`` (DivideMix's per-sample cross-entropy of the prediction).
    gmm_seed: the mixture's ``random_state`` is ``gmm_seed + epoch``.
    """

    p_threshold: float = 0.5
    temperature: float = 0.5
    mixmatch_alpha: float = 4.0
    lambda_u: float = 25.0
    rampup_epochs: float = 16.0
    conf_penalty: bool = False
    division_loss: str = field(default="lccn", metadata={"choices": DIVISION_LOSSES})
    gmm_seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.p_threshold <= 1:
            raise ValueError(f"p_threshold must lie in [0, 1], got {self.p_threshold}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not self.mixmatch_alpha > 0:
            raise ValueError(f"mixmatch_alpha must be > 0, got {self.mixmatch_alpha}")
        if self.lambda_u < 0:
            raise ValueError(f"lambda_u must be >= 0, got {self.lambda_u}")
        if not self.rampup_epochs > 0:
            raise ValueError(f"rampup_epochs must be > 0, got {self.rampup_epochs}")
        if self.division_loss not in DIVISION_LOSSES:
            raise ValueError(f"division_loss must be one of {DIVISION_LOSSES}, "
                             f"got {self.division_loss!r}")


SWITCHES = ("auto", "on", "off")
AMPS = ("auto", "bf16", "fp16", "off")
COMPILES = ("off", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class PerfConfig:
    """Fast paths of the training step. ``"auto"`` means on for a CUDA device and off on the
    CPU (where bf16 autocast and channels-last are slower or unsupported by the kernels);
    the CPU path is the reference the exactness tests run.

    amp: autocast of the forward pass (logits and the loss stay float32). ``"bf16"``;
        ``"fp16"`` with a gradient scaler per network (``torch.amp.GradScaler``: the loss
        scaled up before the backward pass so float16 gradients do not underflow, a step
        with an inf/NaN gradient skipped and the scale lowered), for GPUs without bf16;
        ``"auto"``: bf16 on a CUDA device that supports it, else fp16 there, off on the CPU.
    channels_last: NHWC activations (cuDNN's fast convolution layout).
    compile: ``torch.compile`` mode, ``"off"`` by default (compilation costs tens of
        seconds per model and process); falls back to eager with a warning when the
        compiler is unavailable or fails on the first batch.
    cudnn_benchmark: let cuDNN time its convolution algorithms (fixed input sizes).
    data_on_device: in-memory datasets (CIFAR, digits) are copied to the device once, and
        the crop/flip augmentation runs there.
    """

    amp: str = field(default="auto", metadata={"choices": AMPS})
    channels_last: str = field(default="auto", metadata={"choices": SWITCHES})
    compile: str = field(default="off", metadata={"choices": COMPILES})
    cudnn_benchmark: str = field(default="auto", metadata={"choices": SWITCHES})
    data_on_device: str = field(default="auto", metadata={"choices": SWITCHES})

    def __post_init__(self) -> None:
        if self.amp not in AMPS:
            raise ValueError(f"PerfConfig.amp must be one of {AMPS}, got {self.amp!r}")
        if self.compile not in COMPILES:
            raise ValueError(f"PerfConfig.compile must be one of {COMPILES}, got {self.compile!r}")
        for name in ("channels_last", "cudnn_benchmark", "data_on_device"):
            if getattr(self, name) not in SWITCHES:
                raise ValueError(f"PerfConfig.{name} must be one of {SWITCHES}, "
                                 f"got {getattr(self, name)!r}")

    def amp_dtype(self, device: str | object, *, bf16_supported: bool = True) -> str | None:
        """``"bfloat16"``, ``"float16"`` or None (no autocast) on ``device``;
        ``bf16_supported``: whether that device has bf16 (``"auto"`` falls back to fp16)."""
        if self.amp == "off" or (self.amp == "auto" and not str(device).startswith("cuda")):
            return None
        if self.amp == "fp16" or (self.amp == "auto" and not bf16_supported):
            return "float16"
        return "bfloat16"

    def enabled(self, name: str, device: str | object) -> bool:
        """Whether switch ``name`` is on for ``device`` (``"auto"``: on for CUDA only)."""
        value = getattr(self, name)
        if name == "amp":
            value = {"bf16": "on", "fp16": "on"}.get(value, value)
        if value == "auto":
            return str(device).startswith("cuda")
        return value == "on"


@dataclass(frozen=True)
class RunConfig:
    """What to run: ``method`` names a registered method (the registry of
    :mod:`pipeline.train.methods`, checked when the engine builds it): ``"ce"`` (baseline), ``"lccn"``
    (variants via LCCNConfig), ``"dividemix"`` or ``"divide_lccn"`` (two networks, via
    DivideConfig; DivideLCCN's chains take their sampler settings from LCCNConfig), or a
    classic baseline (``"bootstrap"``, ``"forward"``, ``"sadapt"``, ``"trevision"``; options
    in BaselineConfig).

    seed: seeds the network's initialisation, the data order, the Gibbs chains and the
    noisy validation split.
    val_fraction: the noisy validation split, carved from the training label view
    (stratified by observed label, fixed by ``seed``) and never trained on nor counted in
    C. Model selection uses accuracy against its *observed* labels (what a user has); the
    clean test set is for the final report only. 0 disables it.
    """

    method: str = "lccn"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lccn: LCCNConfig = field(default_factory=LCCNConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    divide: DivideConfig = field(default_factory=DivideConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    val_fraction: float = 0.05
    check_invariants: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must lie in [0, 0.5), got {self.val_fraction}")


T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild a (nested) config dataclass from ``asdict`` output; unknown keys are errors."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    kwargs = {}
    for key, value in data.items():
        ftype = names[key].type
        sub = _CONFIGS.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        kwargs[key] = from_dict(sub, value) if sub and isinstance(value, dict) else value
    return cls(**kwargs)


_CONFIGS = {c.__name__: c for c in (LCCNConfig, BaselineConfig, OptimConfig, ModelConfig,
                                    MonitorConfig, DivideConfig, PerfConfig, RunConfig)}


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN/infinite float replaced by None (strict JSON), through dicts,
    lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def scaled_lr_values(lr_values: tuple[float, ...] | list[float], lr: float) -> tuple[float, ...]:
    """A piecewise schedule whose first phase runs at ``lr``, the others scaled alike
    (``(0.5, 0.1, 0.01)`` with lr 0.25 -> ``(0.25, 0.05, 0.005)``); empty stays empty."""
    if not lr_values:
        return ()
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"optim.lr must be a positive number, got {lr!r}")
    return tuple(v * lr / lr_values[0] for v in lr_values)
