"""DivideMix and DivideLCCN: two networks, each trained on the division of the other
(docs/methods.md; the maths is :mod:`pipeline.core.divide`).

Per epoch of the noise phase (after ``OptimConfig.pretrain_epochs`` of cross-entropy on
both networks, the warm-up)::

    begin_epoch:  a per-sample loss pass over the whole training split (eval mode, both
                  networks; every rank its share, gathered by idx: every idx exactly once)
                  -> co_divide per network (GMM, p_threshold)
    train_task:   every batch of the pass (two augmented views per image), for network k
                  in (0, 1), with o = 1 - k (the loop, pipeline.train.loop.run_pass, runs
                  backward and the optimiser step of each network in turn):
                    labelled   = rows that network o's division calls clean (w = p(clean))
                    unlabelled = the other rows
                    targets    labelled: co-refine with w and network k's prediction
                               averaged over the views (DivideLCCN: its LCCN posterior);
                               unlabelled: co-guess from both networks' views
                    MixMatch -> Lx + lambda_u(t) Lu + uniform prior penalty -> network k steps

The split of each batch by the division (rather than DivideMix's separate labelled and
unlabelled loaders) keeps the engine's one training pass: every sample is visited once per
epoch by each network, in the same number of steps on every rank. Network 1's co-guesses
in a batch use network 0 as it is after that batch's step (DivideMix trains network 0 for
a whole epoch first). Evaluation ranks the classes by both networks' summed logits.

DivideLCCN gives each network its own LCCN chain (its own store: an engine
:class:`~pipeline.train.chains.ChainSet` of two chains) and labeler: in every batch network k's
labeler Gibbs-samples z for all rows from network k's averaged prediction and commits
it, and the labelled rows' targets are ``co_refine_lccn`` with the conditional transition
of that chain (the same conditional the draw uses: own count removed, or the refreshed
transition with ``LCCNConfig.refresh_steps`` > 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.core.confusion import transition, transition_error
from pipeline.core.divide import (
    co_divide,
    co_guess,
    co_refine,
    co_refine_lccn,
    conf_penalty,
    division_losses,
    ensemble_topk,
    lccn_division_losses,
    lccn_posterior,
    linear_rampup,
    mixmatch,
    semi_loss,
    transition_columns,
    uniform_prior_penalty,
)
from pipeline.core.monitor import CollapseMonitor, chain_health
from pipeline.core.posterior import STATE_KEY
from pipeline.core.warmup import estimate_phi_init, initial_latents
from pipeline.train.loop import StepInput, Task, noisy_nll_sum, predict
from pipeline.train.methods.base import Method, refuse_ignored, register
from pipeline.train.report import accumulator_for, finish_epoch, record_if_selected
from pipeline.train.session import all_gather_rows


def _mix_seed(seed: int, rank: int, step: int, net: int) -> int:
    """A 63-bit seed for MixMatch's draws at global step ``step`` of ``rank`` for network
    ``net`` (nothing random to checkpoint)."""
    state = np.random.SeedSequence([seed, rank, step, net, 0x646D]).generate_state(1, np.uint64)
    return int(state[0] >> 1)


@register
class DivideMix(Method):
    """State: ``prob_clean`` (two ``(N,)`` float64 vectors over the idx space, network k's
    division: the clean probability of every training sample from network k's losses;
    network 1 - k trains on it) and ``division_epoch`` (the epoch it was made for: a run
    resumed inside that epoch keeps it)."""

    name = "dividemix"
    reads_divide = True
    clips_at_xi = False

    def __init__(self, run, engine) -> None:
        super().__init__(run, engine)
        self.cfg = run.divide
        self.prob_clean: list[Tensor] | None = None
        self.division_epoch = -1
        self._division_stats: dict[str, float] = {}

    # -- networks and phases --------------------------------------------------------------------

    def build_members(self) -> list:
        return [self.engine.make_member(0), self.engine.make_member(1)]

    def in_noise_phase(self, epoch: int) -> bool:
        return epoch >= self.run.optim.pretrain_epochs

    def train_views(self, epoch: int) -> int:
        return 2 if self.in_noise_phase(epoch) else 1

    def begin_epoch(self, epoch: int, steps_per_epoch: int) -> None:
        self._steps = max(1, steps_per_epoch)
        if self.in_noise_phase(epoch) and self.division_epoch != epoch:
            self.divide(epoch)

    # -- co-divide ------------------------------------------------------------------------------

    def sample_losses(self, k: int, logits: Tensor, observed: Tensor) -> Tensor:
        """The per-sample loss network k's division fits: ``-log softmax(logits)[observed]``.
        logits: (M, K); observed: (M,). Returns (M,) float32."""
        return division_losses(logits, observed)

    @torch.no_grad()
    def division_losses(self) -> tuple[Tensor, list[Tensor]]:
        """Both networks' per-sample losses over the whole training split, in eval mode,
        every rank scoring its share and the rows gathered over ranks: ``idx (M,) int64``
        sorted, each training idx exactly once (checked), and one ``(M,)`` float64 loss
        vector per network."""
        eng, data = self.engine, self.engine.data
        nets = [m.eval_model for m in self.members]
        for m in self.members:
            m.model.eval()
        rows = []
        for b in data.train_eval_batches():
            valid = b.valid
            if not valid.any():
                continue
            x = b.images.to(eng.device, non_blocking=True)
            obs = b.observed[valid]
            losses = [self.sample_losses(k, net(x).float()[valid.to(eng.device)].cpu(), obs)
                      for k, net in enumerate(nets)]
            rows.append(torch.stack([b.idx[valid].to(torch.float64),
                                     *(v.to(torch.float64) for v in losses)], 1))
        mine = torch.cat(rows) if rows else torch.zeros((0, 1 + len(nets)), dtype=torch.float64)
        every = all_gather_rows(eng.session, mine)
        idx = every[:, 0].long()
        order = torch.argsort(idx)
        idx, every = idx[order], every[order]
        expected = torch.arange(data.num_samples)
        if data.held_out is not None:
            expected = expected[~torch.from_numpy(data.held_out)]
        if not torch.equal(idx, expected):
            dup = int(idx.numel() - torch.unique(idx).numel())
            raise RuntimeError(f"the division pass scored {idx.numel()} rows ({dup} repeated) "
                               f"for {expected.numel()} training samples: every idx must be "
                               f"scored exactly once")
        return idx, [every[:, 1 + k] for k in range(len(nets))]

    def divide(self, epoch: int) -> None:
        """co_divide on each network's losses; the same result on every rank (the same
        gathered losses and seed)."""
        idx, losses = self.division_losses()
        n = self.engine.data.num_samples
        probs, stats = [], {}
        clean = self.engine.data.clean[idx]
        truly = clean == self.engine.data.observed[idx]
        known = clean >= 0
        for k, loss in enumerate(losses):
            d = co_divide(loss, p_threshold=self.cfg.p_threshold,
                          seed=self.cfg.gmm_seed + epoch)
            p = torch.zeros(n, dtype=torch.float64)
            p[idx] = d.prob_clean
            probs.append(p)
            sel = d.clean & known
            sfx = "" if k == 0 else "_net2"
            stats[f"division_labelled{sfx}"] = float(d.clean.double().mean())
            stats[f"division_precision{sfx}"] = (float(truly[sel].double().mean())
                                                 if sel.any() else float("nan"))
            good = truly & known
            stats[f"division_recall{sfx}"] = (float((d.clean & good).sum() / good.sum())
                                              if good.any() else float("nan"))
        self.prob_clean, self.division_epoch = probs, epoch
        self._division_stats = stats

    def epoch_stats(self) -> dict[str, float]:
        return {"staleness_max": 0.0, **self._division_stats}

    # -- training -------------------------------------------------------------------------------

    def train_task(self, epoch: int) -> Task:
        """Both networks on every batch: the CE warm-up before the noise phase, then
        co-refinement, co-guessing and MixMatch (:meth:`_forward`)."""
        if not self.in_noise_phase(epoch):
            self._division_stats = {}
            return _WarmupTask(self)
        return _DivideTask(self, epoch)

    def _warmup_forward(self, k: int, step: StepInput) -> tuple[Tensor, Tensor]:
        """Cross-entropy on the observed labels of network k (plus the negative-entropy
        penalty with ``DivideConfig.conf_penalty``); the target is the observed label."""
        (y,) = step.rows
        valid = step.valid.float()
        nvalid = max(float(step.batch.valid.sum()), 1.0)
        m = self.members[k]
        m.model.train()
        logits = m.train_model(step.images).float()
        loss = (F.cross_entropy(logits, y, reduction="none") * valid).sum() / nvalid
        if self.cfg.conf_penalty:  # over the real rows only, as the loss
            loss = loss + conf_penalty(logits, weight=valid)
        return loss, y

    def _begin_chain_pass(self) -> None:
        """Hook: DivideLCCN starts its labelers' pass."""

    def _chain_changed(self) -> float:
        return 0.0

    def refine(self, k: int, b: Any, nxt: Any | None, p_bar: Tensor, labelled: Tensor,
               w: Tensor) -> Tensor:
        """Co-refined targets ``(L, K)`` of the labelled rows (``labelled (B,) bool`` on
        the host) of batch ``b`` for network k: ``co_refine(onehot(observed), p_bar, w,
        T)`` with ``p_bar (B, K)`` network k's prediction averaged over the two views and
        ``w (B,)`` the clean probability from the other network's division."""
        dev = p_bar.device
        lab = labelled.to(dev)
        onehot = F.one_hot(b.observed.to(dev)[lab], self.num_classes)
        return co_refine(onehot, p_bar[lab], w.to(dev)[lab], self.cfg.temperature)

    def _forward(self, k: int, step: StepInput, frac: float) -> tuple[Tensor, Tensor]:
        """Network k's loss on batch ``step.batch`` at fractional epoch ``frac`` and the
        training target's class per row ``(B,)`` (-1 for padding rows)."""
        b, nxt = step.batch, step.nxt
        eng, cfg = self.engine, self.cfg
        dev = eng.device
        own, other = self.members[k], self.members[1 - k]
        w = self.prob_clean[1 - k][b.idx].to(torch.float32)          # (B,) host
        labelled = (w > cfg.p_threshold) & b.valid
        unlabelled = ~labelled & b.valid
        dummy = not bool(b.valid.any())
        if dummy:  # a padding-only batch: every rank still steps, with a zero loss
            labelled = labelled.clone()
            labelled[0] = True
        lab, unl = labelled.to(dev), unlabelled.to(dev)
        x1, x2 = self._input(step.images), self._input(b.images2)
        n = x1.shape[0]
        with torch.no_grad():
            # eval_model: the same fast paths without DDP; the mode is the module's
            own.model.train()  # as DivideMix: the trained network guesses in train mode
            p_own = torch.softmax(own.eval_model(torch.cat([x1, x2])).float(), 1)
            p1, p2 = p_own[:n], p_own[n:]
            p_bar = (p1 + p2) / 2
            t_l = self.refine(k, b, nxt, p_bar, labelled, w)
            if bool(unlabelled.any()):
                other.model.eval()
                p_oth = torch.softmax(other.eval_model(torch.cat([x1[unl], x2[unl]])).float(), 1)
                m = int(unlabelled.sum())
                t_u = co_guess([p1[unl], p2[unl]], [p_oth[:m], p_oth[m:]], cfg.temperature)
            else:
                t_u = p_bar[:0]
        gen = torch.Generator().manual_seed(
            _mix_seed(self.run.seed, eng.session.rank, eng.global_step, k))
        mixed = mixmatch(torch.cat([x1[lab], x2[lab]]), torch.cat([t_l, t_l]),
                         torch.cat([x1[unl], x2[unl]]), torch.cat([t_u, t_u]),
                         cfg.mixmatch_alpha, generator=gen)
        own.model.train()
        nl = mixed.n_labelled
        if cfg.lambda_u == 0 and nl:
            # no unlabelled loss (the web presets): as DivideMix's Clothing1M / WebVision
            # code, only the mixed labelled rows (partners from the whole batch) are
            # forwarded and trained on, the prior penalty over them alone
            logits = own.train_model(mixed.inputs[:nl]).float()
            lx = -(F.log_softmax(logits, 1) * mixed.targets[:nl]).sum(1).mean()
            loss = lx + uniform_prior_penalty(logits)
        else:
            logits = own.train_model(mixed.inputs).float()
            zero = logits.sum() * 0.0
            lx, lu = zero, zero
            if nl and nl < logits.shape[0]:
                lx, lu = semi_loss(logits[:nl], mixed.targets[:nl], logits[nl:],
                                   mixed.targets[nl:])
            elif nl:
                lx = -(F.log_softmax(logits, 1) * mixed.targets).sum(1).mean()
            else:
                lu = ((torch.softmax(logits, 1) - mixed.targets) ** 2).mean()
            lam = linear_rampup(frac, self.run.optim.pretrain_epochs, cfg.rampup_epochs,
                                lambda_u=cfg.lambda_u)
            loss = lx + lam * lu + uniform_prior_penalty(logits)
        if dummy or (cfg.lambda_u == 0 and not nl):  # nothing to learn: every rank steps
            loss = loss * 0.0
        target = torch.full((n,), -1, dtype=torch.int64, device=dev)
        if not dummy:
            target[lab] = t_l.argmax(1)
            target[unl] = t_u.argmax(1)
        return loss, target

    def _input(self, images: Tensor) -> Tensor:
        """Images on the device as float network inputs: uint8 batches (a CUDA worker's
        ``LoaderConfig.normalize_on="device"``) are normalised here, since MixMatch mixes
        the normalised inputs."""
        x = images.to(self.engine.device, non_blocking=True)
        if x.dtype == torch.uint8:
            norm = self.engine.options.normalize
            if norm is None:
                raise TypeError("uint8 images reached DivideMix but the engine has no "
                                "normalisation (EngineOptions.normalize)")
            x = norm.to(x.device)(x)
        return x

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"division_prob": self.prob_clean, "division_epoch": self.division_epoch,
                "division_stats": dict(self._division_stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        probs = state.get("division_prob")
        self.prob_clean = None if probs is None else [p.clone() for p in probs]
        self.division_epoch = int(state.get("division_epoch", -1))
        self._division_stats = dict(state.get("division_stats") or {})

    # -- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any], *,
                 noisy: bool = False) -> dict[str, float]:
        """top1/top5 over the batches' labels of the two-network ensemble (classes ranked by
        the sum of both networks' logits) and ``nll`` of the labels under the mean of the
        two softmaxes (no noise model: the ensemble predicts a label itself, ``noisy``
        changes nothing); ``model`` (the engine passes network 0) is not used alone."""
        dev = self.engine.device
        nets = [m.scorer for m in self.members]  # the weight averages, when kept
        for net in nets:
            net.eval()
        hit1 = hit5 = total = 0
        nll = torch.zeros((), dtype=torch.float64, device=dev)  # summed on the device
        for b in batches:
            keep = b.valid & (b.clean >= 0) & (b.clean < self.num_classes)
            if not keep.any():
                continue
            x = b.images.to(dev, non_blocking=True)
            kd = keep.to(dev)
            l1, l2 = (net(x).float()[kd, :self.num_classes] for net in nets)
            labels = b.clean[keep].to(dev)
            hits = ensemble_topk(l1, l2, labels, ks=(1, 5))
            n = int(keep.sum())
            nll += noisy_nll_sum((torch.softmax(l1, 1) + torch.softmax(l2, 1)) / 2, labels, None)
            hit1, hit5, total = hit1 + hits[1], hit5 + hits[5], total + n
        if total == 0:
            return {"top1": float("nan"), "top5": float("nan"), "nll": float("nan"), "n": 0.0}
        return {"top1": hit1 / total, "top5": hit5 / total, "nll": float(nll) / total,
                "nll_plain": float(nll) / total,
                "n": float(total)}


class _WarmupTask(Task):
    """DivideMix's warm-up pass: each network's cross-entropy in turn on every batch."""

    def __init__(self, method: DivideMix) -> None:
        self.method = method
        self.optimizers = [m.optimizer for m in method.members]
        self.known_below = method.num_classes

    def rows(self, batch: Any) -> tuple[Tensor, ...]:
        return (batch.observed,)

    def forward(self, k: int, step: StepInput) -> tuple[Tensor, Tensor]:
        return self.method._warmup_forward(k, step)


class _DivideTask(Task):
    """A noise-phase pass: network 0 then network 1 on every batch (:meth:`DivideMix._forward`);
    label recovery is network 0's target (co-refined or co-guessed) against the clean
    label."""

    def __init__(self, method: DivideMix, epoch: int) -> None:
        self.method, self.epoch = method, epoch
        self.optimizers = [m.optimizer for m in method.members]
        self.known_below = method.num_classes

    def begin(self) -> None:
        self.method._begin_chain_pass()

    def forward(self, k: int, step: StepInput) -> tuple[Tensor, Tensor]:
        return self.method._forward(k, step, self.epoch + step.index / self.method._steps)

    def end(self) -> dict[str, float]:
        return {"changed": self.method._chain_changed()}


@register
class DivideLCCN(DivideMix):
    """DivideMix with one LCCN chain per network. Extra state: ``phi_init`` (one per
    network, None until the noise phase starts), ``lccn_steps`` (each labeler's step
    count), the collapse monitor's reference accuracy. The chains (C and z) live in the
    engine's :class:`~pipeline.train.chains.ChainSet`."""

    name = "divide_lccn"
    needs_chain = True
    num_chains = 2
    # it trains on DivideMix's co-refined targets (with the chain's conditional), so
    # neither LCCN's target nor its ramp reaches it (annealing does: it tempers the draws)
    ignores = ("lccn.targets", "lccn.ramp_epochs", "lccn.guard_drop", "lccn.guard_patience",
               "lccn.guard_targets", "lccn.guard_prior_strength", "lccn.guard_floor",
               "lccn.guard_sampler", "lccn.guard_rise", "lccn.teacher", "lccn.warmup_weights")
    ignores_why = ("its division (a two-component mixture on each sample's loss, every "
                   "epoch) keeps the samples a network fits without learning them out of "
                   "the other network's labelled set, and its chains read the networks' "
                   "co-guessed predictions: LCCN's memorisation guard and teacher do not "
                   "apply, and its warm-up is DivideMix's")

    def __init__(self, run, engine) -> None:
        super().__init__(run, engine)
        lc = run.lccn
        if lc.outlier or lc.use_trusted:
            raise ValueError("divide_lccn runs plain LCCN chains: LCCNConfig.outlier "
                             "(LCCN*) and use_trusted (LCCN+) are not supported with it")
        refuse_ignored(type(self), run)
        chain = engine.chain
        if chain is not None and len(getattr(chain, "chains", [chain])) != self.num_chains:
            raise ValueError(f"divide_lccn needs {self.num_chains} chains (one per network, "
                             f"an engine.ChainSet); got {type(chain).__name__}")
        self.lc = lc
        self.monitor = CollapseMonitor(run.monitor)
        self.phi_init: list[Tensor] | None = None
        self.lccn_steps = [0, 0]
        self.labelers: list[Any] | None = None
        self._changed: list[float] = []
        # the label-issue report: both chains' posteriors, averaged together
        self.report = accumulator_for(run, engine, k_latent=self.num_classes)
        self._sink = None

    def noise_phase_started(self) -> bool:
        return self.phi_init is not None

    def start_noise_phase(self, epoch: int) -> dict[str, float]:
        """Each network's chain: phi_init from its own predictions (all-reduced
        statistics) and the initial assignment of this rank's samples; the monitor's
        reference (the ensemble's noisy validation accuracy)."""
        eng, data = self.engine, self.engine.data
        phis, out = [], {}
        for k, m in enumerate(self.members):
            probs, idx, _ = predict(m.scorer, data.train_eval_batches(), device=eng.device)
            observed = data.observed[idx]
            phi = estimate_phi_init(self.lc, probs, observed, self.num_classes,
                                    self.num_classes, reduce=eng.reduce_cpu)
            z0 = initial_latents(self.lc, observed, probs, phi)
            eng.chain[k].start(idx, z0, k_latent=self.num_classes, trusted=None,
                               clean=data.clean)
            phis.append(phi)
            sfx = "" if k == 0 else "_net2"
            out[f"init_transition_error{sfx}"] = transition_error(phi, data.transition)
        self.phi_init = phis
        self.monitor.start(eng.val_top1(), lr=eng.trained_lr())
        return out

    def begin_epoch(self, epoch: int, steps_per_epoch: int) -> None:
        if self.in_noise_phase(epoch) and self.labelers is None:
            o = self.run.optim
            self.labelers = []
            for k in range(len(self.members)):
                lab = self.engine.chain[k].labeler(
                    self.lc, phi_init=self.phi_init[k],
                    max_steps=(o.epochs - o.pretrain_epochs) * steps_per_epoch,
                    trusted=None, clean=self.engine.data.clean,
                    steps_per_epoch=steps_per_epoch)
                lab.step_count = self.lccn_steps[k]
                self.labelers.append(lab)
        super().begin_epoch(epoch, steps_per_epoch)

    def sample_losses(self, k: int, logits: Tensor, observed: Tensor) -> Tensor:
        """Once the chains run (``DivideConfig.division_loss="lccn"``): the LCCN authors'
        loss, cross-entropy of the posterior ``q ∝ softmax(logits) · phi_k[:, observed]``
        taken as logits, with ``phi_k = (C_k + alpha) / rowsum`` of network k's chain."""
        if self.cfg.division_loss != "lccn" or self.labelers is None:
            return super().sample_losses(k, logits, observed)
        phi = transition(self.labelers[k].counts.cpu(), self.labelers[k].alpha.cpu())
        q = lccn_posterior(torch.softmax(logits.double(), 1), transition_columns(phi, observed))
        return lccn_division_losses(q, observed)

    def train_task(self, epoch: int) -> Task:
        self._sink = self.report.sink(epoch) if self.in_noise_phase(epoch) else None
        return super().train_task(epoch)

    def end_pass(self, epoch: int) -> None:
        if self.in_noise_phase(epoch):
            finish_epoch(self.report, self.engine, epoch, [m.scorer for m in self.members])

    def scored(self, epoch: int, row: dict[str, float]) -> None:
        """The label-issue report keeps the selected epoch's held-out predictions."""
        if self.in_noise_phase(epoch):
            record_if_selected(self.report, self.engine, [m.scorer for m in self.members], row)

    def _begin_chain_pass(self) -> None:
        self._changed = []
        self._prefetched = [False] * len(self.members)

    def refine(self, k: int, b: Any, nxt: Any | None, p_bar: Tensor, labelled: Tensor,
               w: Tensor) -> Tensor:
        """Network k's chain steps on the whole batch (the Gibbs draw of z from ``p_bar``
        and the chain's conditional, committed with the next batch's idx), and the
        labelled rows' targets are ``co_refine_lccn(onehot(observed), p_bar, cond, w, T)``
        with ``cond`` that conditional (:meth:`GibbsLabeler.conditional`), read before the
        draw."""
        lab_k = self.labelers[k]
        if not self._prefetched[k]:  # the pass's first batch
            lab_k.prefetch(b.idx)
            self._prefetched[k] = True
        cond = lab_k.conditional(b.observed, b.idx)                     # (B, K) float64
        z, st = lab_k.sample(p_bar, b.observed, b.idx)
        if self._sink is not None:
            self._sink(b.idx[b.valid], st.posterior[b.valid.to(st.posterior.device)])
        lab_k.commit(b.idx[b.valid], z.cpu()[b.valid], nxt.idx if nxt is not None else None)
        self.lccn_steps[k] = lab_k.step_count
        self._changed.append(float(st.changed))
        dev = p_bar.device
        labd = labelled.to(dev)
        onehot = F.one_hot(b.observed.to(dev)[labd], self.num_classes)
        return co_refine_lccn(onehot, p_bar[labd], cond.to(dev)[labd], w.to(dev)[labd],
                              self.cfg.temperature)

    def _chain_changed(self) -> float:
        return float(np.mean(self._changed)) if self._changed else 0.0

    def epoch_stats(self) -> dict[str, float]:
        out = super().epoch_stats()
        if self.labelers is not None:
            out["staleness_max"] = float(max(getattr(lab, "max_staleness", 0)
                                             for lab in self.labelers))
            for lab in self.labelers:
                if hasattr(lab, "max_staleness"):
                    lab.max_staleness = 0
        return out

    def flush(self) -> None:
        if self.labelers is not None:
            for k, lab in enumerate(self.labelers):
                lab.flush()
                self.lccn_steps[k] = lab.step_count
        self.report.merge(self.engine.reduce_cpu)  # collective; a no-op at an epoch end

    def observe_chain(self, state: dict | None, *, epoch: int,
                      row: dict[str, float] | None) -> dict[str, float]:
        """Each network's transition error (``transition_error``: network 0's,
        ``transition_error_net2``) and ``chain_gap``, the mean |phi_0 - phi_1| of the two
        chains (both estimate the same noise); at an epoch end each chain's health
        (network 1's keys with ``_net2``) and the monitor's verdict (``collapse``: either
        chain)."""
        nan = float("nan")
        if state is None or self.phi_init is None:
            return {"transition_error": nan}
        states = state["chains"]
        phis = [transition(s["counts"]) for s in states]
        truth = self.engine.data.transition
        out = {"transition_error": transition_error(phis[0], truth),
               "transition_error_net2": transition_error(phis[1], truth),
               "chain_gap": float((phis[0] - phis[1]).abs().mean())}
        if row is None:
            return out
        stop = None if self.engine.options.raise_on_collapse else False
        val = row.get("val_top1", nan)
        collapse = False
        for k, (s, phi) in enumerate(zip(states, phis)):
            health = chain_health(s["z"], s["observed"], self.num_classes, self.num_classes,
                                  counted=s["counted"], phi=phi, phi_init=self.phi_init[k])
            sfx = "" if k == 0 else "_net2"
            out.update({f"{key}{sfx}": v for key, v in health.items()})
            collapse |= bool(self.monitor.check(health, val, epoch=epoch, lr=row.get("lr"),
                                                stop=stop))
        out["val_compared"] = float(self.monitor.compares(row.get("lr")))
        out["collapse"] = float(collapse)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "lccn_step": max(self.lccn_steps),
                "lccn_steps": list(self.lccn_steps), "phi_init": self.phi_init,
                **self.monitor.state_dict(),
                STATE_KEY: self.report.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.lccn_steps = [int(s) for s in state.get("lccn_steps", [0, 0])]
        self.phi_init = state.get("phi_init")
        self.monitor.load_state_dict(state)
        self.report.load_state_dict(state.get(STATE_KEY))
