"""The per-worker side of LCCN: sample a batch's latent labels against a replica of C.

:class:`GibbsLabeler` keeps a local replica of the global counts and its own copy of ``z``;
a *store* (the :class:`~pipeline.core.confusion_store.ConfusionStore` itself in one process,
or a proxy to the Ray actor that holds it) takes the sampled labels and answers with what
the replica misses. There is one protocol, :meth:`ConfusionStore.push`:

- at the start of an epoch (:meth:`GibbsLabeler.prefetch`) the labeler sends what it has
  buffered and takes the store's whole ``z`` and C (the replica starts the epoch exact);
- in the epoch every sample belongs to one worker, so ``z_old`` of its next batches is its
  own copy, and it applies its own moves to its replica as it makes them (Eq. 7 of the next
  batch sees them at once, as in a one-process chain);
- every ``LCCNConfig.commit_every`` steps it sends the buffered labels in one call, whose
  reply (taken once it has arrived, or before the next send, or at
  :meth:`GibbsLabeler.flush`) brings the other workers' moves.

Per step::

    z_old = own copy of z[idx];   C_local = replica (own moves applied, others' as received)
    z_new = Eq. 7 (probs, observed, z_old, C_local)        or phi_init during warm-up
    apply own moves to C_local and z;  every n steps: store.push(buffered labels)

Staleness = the other workers' steps whose moves a reply brought (0 with one worker: in
one process the replica is C exactly at every step, whatever ``commit_every``). Trusted
samples (LCCN+) keep their clean label and send no count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from pipeline.core.config import LCCNConfig
from pipeline.core.confusion import apply_delta_, apply_moves_host, as_alpha, transition
from pipeline.core.confusion_store import Sync
from pipeline.core.sampler import (
    HOST_MAX_LATENT,
    anneal_gamma,
    check_range,
    conditional_transition,
    gibbs_draw,
    gibbs_draw_host,
    gibbs_posterior,
    sample_categorical,
)
from pipeline.core.sampler import numba as host_kernel
from pipeline.core.warmup import anchored_prior, warmup_prior
from pipeline.train.fastpath import to_device


class Store(Protocol):
    """The in-process ConfusionStore, or a proxy to the actor holding it. ``push`` may
    return a :class:`Sync` or a handle that ``resolve`` turns into one (so the round trip
    overlaps the next steps); a proxy may offer ``done(handle)`` (has the reply arrived?)."""

    def push(self, idx: Tensor, z_new: Tensor, *, since: int, worker: str, seq: int,
             steps: int = 1, full_z: bool = False) -> Any: ...
    def layout(self) -> tuple[Tensor, Tensor]: ...


@dataclass
class SampleStats:
    gamma: float
    warmup: bool
    staleness: int   # commits by other workers the replica had not seen when it last synced
    changed: float | Tensor  # fraction of the batch whose latent label moved (a 0-d device
    #                          tensor when the labeler runs on an accelerator: no host sync)
    wait: float      # seconds blocked on the store before sampling
    posterior: Tensor | None = None  # (B, K_latent) the Eq. 7 conditional each z was drawn
    #                                  from (one-hot at the clean label for trusted samples)
    ramp: float = 1.0  # weight of the LCCN target against the observed label
    #                    (LCCNConfig.ramp_epochs)


class GibbsLabeler:
    """Samples latent labels for batches of one worker.

    counts: (K_latent, K) int64 initial replica of C at version ``version``;
    trusted: (N,) bool lookup by idx (LCCN+), clean: (N,) int64 lookup by idx;
    phi_init: (K_latent, K) warm-up transition, rows sum to 1.
    max_steps: steps of the LCCN phase (annealing, the outlier warm-up);
    steps_per_epoch: steps of one of its epochs, the unit of ``cfg.ramp_epochs`` (default:
    ``max_steps``, the phase counted as one epoch).
    device: where the replica of C lives and Eq. 7 runs (default: the device of
    ``counts``). On an accelerator nothing in :meth:`sample` waits for the device: the
    range checks run on the host copies of ``observed`` and ``z_old``, the draws come
    from a generator on that device (seeded by a draw from ``generator``), and the
    returned ``z`` stays on the device (the caller copies it to the host for
    :meth:`commit`, e.g. with :class:`pipeline.train.fastpath.HostStage`).
    """

    def __init__(self, cfg: LCCNConfig, store: Store, counts: Tensor, version: int, *,
                 phi_init: Tensor, max_steps: int, generator: torch.Generator,
                 trusted: Tensor | None = None, clean: Tensor | None = None,
                 worker: str = "0", device: torch.device | str | None = None,
                 compile_mode: str = "off", steps_per_epoch: int | None = None) -> None:
        self.cfg, self.store = cfg, store
        dev = torch.device(device) if device is not None else counts.device
        self.device = dev
        self.counts = counts.clone().to(dev)
        self.version = version
        self.k_latent, self.num_classes = counts.shape
        self.phi_init = phi_init.to(dev, torch.float64).contiguous()
        # the Dirichlet prior of phi's rows: the paper's alpha, anchored at phi_init by
        # cfg.prior_strength pseudo-counts per row of the counted total (fixed for the run:
        # C's total never changes, so a resumed labeler gets the same prior)
        self.alpha = anchored_prior(as_alpha(cfg.alpha, self.num_classes).to(dev),
                                    self.phi_init, int(self.counts.sum()),
                                    float(getattr(cfg, "prior_strength", 0.0))).contiguous()
        # the host kernel's prior, a (K_latent, K) array made once (not at every step)
        self._alpha_host = np.ascontiguousarray(np.broadcast_to(
            self.alpha.cpu().numpy(), (self.k_latent, self.num_classes)))
        self.max_steps = max(1, max_steps)
        self.steps_per_epoch = max(1, steps_per_epoch if steps_per_epoch is not None
                                   else max_steps)
        if generator.device.type != dev.type:
            # one stream per device: Eq. 7's draws on an accelerator come from a generator
            # there, seeded by a draw from the given one. Its state then decides the seed:
            # two labelers over one generator (DivideLCCN's two chains in one process) get
            # two streams, and a labeler made again after a resume (generator restored from
            # the checkpoint) does not replay the stream of the phase's start
            device_gen = torch.Generator(device=dev)
            device_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
            generator = device_gen
        self.generator = generator
        # compile_mode != "off": the device core of the step (pipeline.core.sampler.gibbs_draw)
        # runs through torch.compile (one CUDA graph with "reduce-overhead") for batches
        # without trusted samples; eager on any compiler failure
        self._draw = None
        self._draw_failed: str | None = None
        self._gamma: tuple[float, Tensor] | None = None  # (gamma, its device copy)
        if compile_mode != "off" and hasattr(torch, "compile"):
            self._draw = torch.compile(gibbs_draw, mode=None if compile_mode == "default"
                                       else compile_mode)
        self.trusted = trusted if cfg.use_trusted else None
        self.clean = clean
        # the CPU fast path: one compiled call per batch (pipeline.core.sampler.gibbs_draw_host)
        self._host = (dev.type == "cpu" and host_kernel and self.counts.dtype == torch.int64
                      and self.k_latent <= HOST_MAX_LATENT)
        # cfg.refresh_steps > 1: the refreshed transition and the step it was taken at
        self._phi_snap: Tensor | None = None
        self._phi_snap_step = -1
        self.worker = worker
        self.seq = 0
        self.step_count = 0
        self._pending: tuple[Tensor, Tensor] | None = None  # (idx, z_old) of the next batch
        self._inflight: Any = None  # the reply of the push in flight (a Sync or a handle)
        self._staleness = 0
        # the store's z and layout, the buffered (idx, z_new) of the steps not sent yet, and
        # the moves applied to the replica since the last push was sent
        self.commit_every = int(getattr(cfg, "commit_every", 1))
        self._z: Tensor | None = None
        self._observed: Tensor | None = None
        self._counted: Tensor | None = None
        self._buf: list[tuple[Tensor, Tensor]] = []
        self._moves: list[tuple[Tensor, Tensor, Tensor]] = []

    def gamma(self) -> float:
        if not self.cfg.anneal:
            return 1.0
        return anneal_gamma(self.step_count, self.max_steps, floor=self.cfg.anneal_floor,
                            rate=self.cfg.anneal_rate)

    def ramp(self) -> float:
        """Weight of the LCCN target in the loss at this step: rises linearly from 0 to 1
        over the first ``cfg.ramp_epochs`` epochs of the LCCN phase (1 when it is 0)."""
        if self.cfg.ramp_epochs <= 0:
            return 1.0
        return min(1.0, (self.step_count + 1) / (self.cfg.ramp_epochs * self.steps_per_epoch))

    def outlier_proposal(self, probs: Tensor) -> Tensor:
        """LCCN*'s outlier warm-up: ``probs (B, K + 1)`` as Eq. 7 reads them in this step.

        Over the first ``cfg.outlier_warmup`` fraction of the LCCN phase the classifier's
        probabilities are mixed with a point mass on the outlier class,
        ``(1 - ε) P(· | x) + ε e_K`` with ``ε = cfg.outlier_prior``: cross-entropy
        pre-training on the K observed classes only ever lowers the outlier logit, so
        without it Eq. 7 (whose outlier term is ``P(K | x) φ[K, j]``) would almost never
        propose the outlier class and LCCN* would stay LCCN. Unchanged otherwise (and
        for ``K_latent = K``)."""
        cfg = self.cfg
        if (self.k_latent == self.num_classes or cfg.outlier_prior <= 0
                or self.step_count >= cfg.outlier_warmup * self.max_steps):
            return probs
        eps = float(cfg.outlier_prior)
        mixed = probs.detach() * (1.0 - eps)
        mixed[:, -1] += eps
        return mixed

    def transition(self, warm: bool) -> Tensor | None:
        """The transition Eq. 7 reads in this step in place of the collapsed conditional:
        ``phi_init`` during the warm-up; with ``cfg.refresh_steps`` n > 1,
        ``(C + α) / rowsum`` of the replica as it was at the last refresh (taken every n
        steps); None (the exact conditional of the current counts) otherwise."""
        if warm:
            return self.phi_init
        n = self.cfg.refresh_steps
        if n <= 1:
            return None
        if self._phi_snap is None or self.step_count - self._phi_snap_step >= n:
            self._phi_snap = transition(self.counts, self.alpha)
            self._phi_snap_step = self.step_count
        return self._phi_snap

    def prefetch(self, idx: Tensor) -> None:
        """Before the first :meth:`sample` of an epoch: send what is buffered and take the
        store's whole ``z`` and C (the replica starts the epoch exact)."""
        self._resolve(wait=True)
        if self._observed is None:
            observed, counted = self.store.layout()
            self._observed, self._counted = observed.long().contiguous(), counted.bool()
        self._send(full_z=True, since=-1)
        self._resolve(wait=True)
        self._pending = (idx, self._z[idx])

    def _resolve(self, wait: bool = False) -> float:
        """Take the reply of the push in flight, if any, with ``wait`` or once it has
        arrived (the store client's ``done``), so a slow store never stalls a step;
        returns the seconds waited."""
        if self._inflight is None:
            return 0.0
        reply = self._inflight
        if (not wait and not isinstance(reply, Sync)
                and hasattr(self.store, "done") and not self.store.done(reply)):
            return 0.0
        self._inflight = None
        t0 = time.perf_counter()
        sync = reply if isinstance(reply, Sync) else self.store.resolve(reply)
        waited = time.perf_counter() - t0
        self._absorb(sync)
        return waited

    def _absorb(self, sync: Sync) -> None:
        """Bring the replica up to a push reply: the other workers' moves, or the whole C
        plus our own moves made since the push was sent (they are not in it yet)."""
        if sync.counts is not None:
            self.counts.copy_(sync.counts)
            for obs, old, new in self._moves:
                apply_delta_(self.counts, obs, old, new)
        elif sync.delta_obs.numel():
            apply_delta_(self.counts, sync.delta_obs, sync.delta_old, sync.delta_new)
        if sync.z.numel():
            self._z = sync.z.to(torch.int64, copy=True)
        self.version = sync.version
        if sync.others >= 0:
            self._staleness = sync.others

    def _send(self, *, full_z: bool = False, since: int | None = None) -> None:
        """Push the buffered steps' labels in one call (the reply is taken later)."""
        if self._buf:
            idx = torch.cat([b[0] for b in self._buf])
            z_new = torch.cat([b[1] for b in self._buf])
        else:
            idx = z_new = torch.empty(0, dtype=torch.int64)
        reply = self.store.push(idx, z_new, since=self.version if since is None else since,
                                worker=self.worker, seq=self.seq, steps=len(self._buf),
                                full_z=full_z)
        self._inflight = reply
        self.seq += 1
        self._buf, self._moves = [], []

    def _apply_own(self, idx: Tensor, z_new: Tensor) -> None:
        """Our own moves, into the replica and our copy of z at once (counted samples)."""
        idx, z_new = idx.long(), z_new.long()
        if self._host:   # one compiled call on the host tensors
            move = apply_moves_host(self.counts, self._z, self._observed, self._counted, idx,
                                    z_new)
            if move is not None:
                self._moves.append(move)
            return
        keep = self._counted[idx]
        if not bool(keep.all()):
            idx, z_new = idx[keep], z_new[keep]
        z_old = self._z[idx]
        moved = z_old != z_new
        if bool(moved.any()):
            move = (self._observed[idx][moved], z_old[moved], z_new[moved])
            apply_delta_(self.counts, *move)
            self._moves.append(move)
        self._z[idx] = z_new

    def sample(self, probs: Tensor, observed: Tensor, idx: Tensor) -> tuple[Tensor, SampleStats]:
        """Latent labels ``(B,) int64`` for a batch whose ``z`` was prefetched or requested
        with the previous commit.

        probs: (B, K_latent) classifier probabilities; observed, idx: (B,) int64.
        Trusted samples return their clean label.
        """
        waited = self._resolve()
        if self._pending is None or (self._pending[0] is not idx
                                     and not torch.equal(self._pending[0], idx)):
            raise RuntimeError("sample() needs the batch's z first: call prefetch(idx) or "
                               "commit(..., next_idx=idx) for this batch")
        z_old = self._pending[1]
        warm = self.step_count < self.cfg.warmup_steps
        phi = self.transition(warm)
        if warm:
            probs = warmup_prior(self.cfg.warmup_prior, probs, self.phi_init)
        probs = self.outlier_proposal(probs)
        counted = None
        if self.trusted is not None:
            counted = ~self.trusted[idx]
        gamma = self.gamma()
        # gibbs_step, with the posterior kept: the same draws from the same generator
        dev = self.device
        if counted is None and self._draw is not None and self._draw_failed is None:
            fast = self._sample_compiled(probs, observed, z_old, gamma, phi)
            if fast is not None:
                z_new, post, changed = fast
                return z_new, SampleStats(gamma, warm, self._staleness, changed, waited, post,
                                          self.ramp())
        if self._host:
            return self._sample_host(probs, observed, idx, z_old, gamma, warm, counted, waited,
                                     phi)
        # host tensors (observed, z_old, counted) are range-checked where they are and then
        # copied; probs stay where the model put them when that is the replica's device
        post = gibbs_posterior(probs.detach().to(dev), observed.cpu(), z_old, self.counts,
                               self.alpha, gamma=gamma, phi=phi, counted=counted)
        z_new = sample_categorical(post, generator=self.generator)
        if counted is not None and self.clean is not None:
            counted_d = counted.to(dev, non_blocking=True)
            clean_d = self.clean[idx].to(dev, non_blocking=True)
            z_new = torch.where(counted_d, z_new, clean_d)
            onehot = torch.nn.functional.one_hot(clean_d, self.k_latent)
            post = torch.where(counted_d.unsqueeze(1), post, onehot.to(post.dtype))
        if not z_new.numel():
            changed: float | Tensor = 0.0
        else:
            changed = (z_new != z_old.to(dev, non_blocking=True)).float().mean()
            if dev.type == "cpu":
                changed = float(changed)
        return z_new, SampleStats(gamma, warm, self._staleness, changed, waited, post,
                                  self.ramp())

    def _sample_host(self, probs: Tensor, observed: Tensor, idx: Tensor, z_old: Tensor,
                     gamma: float, warm: bool, counted: Tensor | None, waited: float,
                     phi: Tensor | None = None) -> tuple[Tensor, SampleStats]:
        """The CPU path for up to ``HOST_MAX_LATENT`` latent classes: Eq. 7 and the draw in
        one compiled call on numpy views of the replica
        (:func:`~pipeline.core.sampler.gibbs_draw_host`), the uniforms from the labeler's
        generator as :func:`~pipeline.core.sampler.sample_categorical` draws them."""
        m = idx.shape[0]
        u = torch.rand(m, generator=self.generator, dtype=torch.float64)
        z_prev = z_old.cpu().numpy().astype(np.int64, copy=False)
        keep = None if counted is None else counted.numpy()
        post, z_new, moved = gibbs_draw_host(
            probs.detach().cpu().numpy(), observed.cpu().numpy().astype(np.int64, copy=False),
            z_prev, self.counts.numpy(), self._alpha_host, u.numpy(), gamma=gamma,
            phi=None if phi is None else phi.numpy(), counted=keep)
        if keep is not None and self.clean is not None:
            fixed = ~keep   # trusted samples: their clean label, a one-hot posterior
            clean = self.clean[idx].numpy()[fixed]
            z_new[fixed] = clean
            post[fixed] = 0.0
            post[np.flatnonzero(fixed), clean] = 1.0
            moved = int(np.count_nonzero(z_new != z_prev))
        return torch.from_numpy(z_new), SampleStats(gamma, warm, self._staleness,
                                                    moved / m if m else 0.0, waited,
                                                    torch.from_numpy(post), self.ramp())

    def conditional(self, observed: Tensor, idx: Tensor) -> Tensor:
        """The conditional transition term the next :meth:`sample` of this batch uses,
        ``(B, K_latent)`` float64 on the labeler's device: ``phi[:, observed]`` of
        :meth:`transition` during the warm-up and, with ``cfg.refresh_steps`` > 1, after it;
        else :func:`~pipeline.core.sampler.conditional_transition` of the replica of C with each
        sample's own count removed (DivideLCCN's co-refinement reads it).
        Needs the batch's z, like :meth:`sample`."""
        self._resolve()
        if self._pending is None or not torch.equal(self._pending[0], idx):
            raise RuntimeError("conditional() needs the batch's z first: call prefetch(idx) "
                               "or commit(..., next_idx=idx) for this batch")
        obs = observed.cpu().long()
        if obs.numel() and (int(obs.min()) < 0 or int(obs.max()) >= self.num_classes):
            raise ValueError(f"observed labels must lie in [0, {self.num_classes}), got range "
                             f"[{int(obs.min())}, {int(obs.max())}]")
        obs = obs.to(self.device)
        phi = self.transition(self.step_count < self.cfg.warmup_steps)
        if phi is not None:
            return phi.T[obs]
        counted = None if self.trusted is None else (~self.trusted[idx]).to(self.device)
        return conditional_transition(obs, self._pending[1].to(self.device), self.counts,
                                      self.alpha, counted=counted)

    def _sample_compiled(self, probs: Tensor, observed: Tensor, z_old: Tensor, gamma: float,
                         phi: Tensor | None) -> tuple[Tensor, Tensor, float | Tensor] | None:
        """The compiled device core (same law and, up to float reassociation, the same
        draws as the eager path); None after a compiler failure (warned once)."""
        dev = self.device
        observed = observed.cpu()
        m = observed.shape[0]
        if m:  # the range checks, on the host copies
            check_range("observed labels", observed, self.num_classes)
            check_range("z_old", z_old, self.k_latent)
        u = torch.rand(m, 1, generator=self.generator, dtype=torch.float64, device=dev)
        if self._gamma is None or self._gamma[0] != gamma:  # a launch only when it changes
            self._gamma = (gamma, torch.full((), gamma, dtype=torch.float64, device=dev))
        # observed and z_old travel in one packed pinned copy
        obs_d, z_old_d = to_device((observed, z_old), dev)
        try:
            post, z_new, changed = self._draw(
                probs.detach().to(dev), obs_d, z_old_d, self.counts, self.alpha,
                self._gamma[1], u, phi)
        except Exception as exc:  # the compiler stack raises many types
            import warnings
            self._draw_failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            warnings.warn(f"compiled Gibbs step failed, running eagerly: {self._draw_failed}",
                          RuntimeWarning, stacklevel=3)
            return None
        return z_new, post, (float(changed) if dev.type == "cpu" else changed)

    def commit(self, idx: Tensor, z_new: Tensor, next_idx: Tensor | None) -> None:
        """Apply the batch's moves to the replica and to the own copy of ``z``, buffer its
        labels, take ``z`` of ``next_idx``, and send the buffer once it holds
        ``commit_every`` steps (without waiting for the reply: a later :meth:`sample`,
        send or :meth:`flush` takes it)."""
        nxt = next_idx if next_idx is not None else idx[:0]
        if self._z is None:
            raise RuntimeError("commit() needs prefetch() first")
        self._apply_own(idx, z_new)
        self._buf.append((idx.long(), z_new.long()))
        self.step_count += 1
        self._pending = (nxt, self._z[nxt])
        if len(self._buf) >= self.commit_every:
            self._resolve(wait=True)  # one call in flight at a time (sent n steps ago)
            self._send()

    def flush(self) -> float:
        """Wait for the last commit (end of an epoch, before a checkpoint): everything
        committed so far is applied by the store when this returns."""
        waited = self._resolve(wait=True)
        if self._buf:
            self._send()
            waited += self._resolve(wait=True)
        return waited
