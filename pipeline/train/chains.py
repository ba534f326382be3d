"""The Gibbs chain's backends, as the engine sees them.

- :class:`LocalChain`: the chain's state in this process, an in-process
  :class:`~pipeline.core.confusion_store.ConfusionStore` made when the noise phase starts;
- :class:`SharedChain`: a client of the run's fenced store actor (the actor itself and the
  Ray plumbing live in :mod:`pipeline.cluster`; this module only calls the client it is given);
- :class:`ChainSet`: one of those per network, for a method with ``num_chains > 1``;
- :class:`DistLabeler`: the labeler of a shared chain, re-seeded from (seed, rank, step)
  before each step so that no generator state has to be checkpointed.

Imports: :mod:`pipeline.core` and :mod:`pipeline.train.labeler` / :mod:`.session`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.core.confusion_store import ConfusionStore
from pipeline.train.labeler import GibbsLabeler, SampleStats
from pipeline.train.session import Session


def chain_seed(seed: int, chain: int) -> int:
    """The Gibbs seed of chain ``chain`` > 0 of a run with several chains (chain 0 uses
    ``seed`` itself)."""
    state = np.random.SeedSequence([seed, chain, 0x63686E]).generate_state(1, np.uint64)
    return int(state[0] >> 1)


def _step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for the Gibbs step ``step`` of ``rank`` (independent streams)."""
    state = np.random.SeedSequence([seed, rank, step, 0x6C63636E]).generate_state(1, np.uint64)
    return int(state[0] >> 1)


class DistLabeler(GibbsLabeler):
    """:class:`GibbsLabeler` whose generator is re-seeded from (seed, rank, LCCN step) before
    each step (no generator state to checkpoint) and that records the largest staleness."""

    def __init__(self, *args: Any, seed: int, rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed, self.rank = seed, rank
        self.max_staleness = 0

    def sample(self, probs: Tensor, observed: Tensor, idx: Tensor) -> tuple[Tensor, SampleStats]:
        self.generator.manual_seed(_step_seed(self.seed, self.rank, self.step_count))
        z, stats = super().sample(probs, observed, idx)
        self.max_staleness = max(self.max_staleness, stats.staleness)
        return z, stats


# -- chain backends -----------------------------------------------------------------------------


class LocalChain:
    """The Gibbs chain's state in this process: a :class:`ConfusionStore` made when the
    noise phase starts; labelers draw from the engine's ``generator``."""

    shared = False
    # set by the Engine: where the replica of C and the Gibbs step live, and whether the
    # step's device core is compiled (PerfConfig.compile)
    device: torch.device | None = None
    compile_mode: str = "off"

    def __init__(self, observed: Tensor, num_classes: int, *, generator: torch.Generator,
                 check_invariants: bool = True, held_out: np.ndarray | None = None) -> None:
        self.observed, self.num_classes = observed, num_classes
        self.generator, self.check_invariants = generator, check_invariants
        # the noisy validation split: in the idx space, never counted (as in SharedChain)
        self.held_out = (None if held_out is None or not held_out.any()
                         else torch.from_numpy(np.asarray(held_out, dtype=bool)))
        self.store: ConfusionStore | None = None

    def open(self, state: dict | None, session: Session) -> None:
        if state is not None:
            self.store = ConfusionStore.from_state_dict(state)

    def start(self, idx: Tensor, z0: Tensor, *, k_latent: int, trusted: Tensor | None,
              clean: Tensor) -> None:
        """Initial assignment ``z0`` of samples ``idx`` (all the training samples, in one
        process); held-out samples keep their observed label as ``z`` and are not counted."""
        z = self.observed.clone()
        z[idx] = z0
        counted = None
        if trusted is not None:
            z = torch.where(trusted, clean, z)
            counted = ~trusted
        if self.held_out is not None:
            counted = ~self.held_out if counted is None else counted & ~self.held_out
        self.store = ConfusionStore(self.observed, z, k_latent, self.num_classes,
                                    counted=counted)

    def labeler(self, cfg: Any, *, phi_init: Tensor, max_steps: int, trusted: Tensor | None,
                clean: Tensor, steps_per_epoch: int) -> GibbsLabeler:
        """The worker's labeler over the in-process store (no other worker: ``commit_every``
        as configured)."""
        labeler = GibbsLabeler(cfg, self.store, self.store.counts, self.store.version,
                               phi_init=phi_init, max_steps=max_steps, generator=self.generator,
                               trusted=trusted, clean=clean, device=self.device,
                               compile_mode=self.compile_mode, steps_per_epoch=steps_per_epoch)
        # a store restored from a checkpoint has seen this worker's commits up to last_seq:
        # continue the sequence (a restarted one would be refused as duplicates)
        labeler.seq = self.store.last_seq.get(labeler.worker, -1) + 1
        return labeler

    def read(self) -> dict | None:
        """The chain state now (rank 0): counts, z, observed, counted, version."""
        if self.store is None:
            return None
        if self.check_invariants:
            self.store.check()
        return self.store.state_dict()

    def stats(self) -> dict[str, float]:
        return {}


class SharedChain:
    """The chain in the run's fenced store actor (:mod:`pipeline.cluster.store_actor`): rank 0
    opens it (restoring the checkpointed C and z) and every rank joins its fence."""

    shared = True
    # set by the Engine: where the replica of C and the Gibbs step live, and whether the
    # step's device core is compiled (PerfConfig.compile)
    device: torch.device | None = None
    compile_mode: str = "off"

    def __init__(self, client: Any, session: Session, *, seed: int,
                 held_out: np.ndarray | None = None) -> None:
        self.client, self.session, self.seed = client, session, seed
        self.held_out = held_out if held_out is not None and held_out.any() else None
        self.fence = ""
        # the labeler made last: a method that makes another within the same attempt (the
        # memorisation guard's switch) continues its commit sequence
        self._made: GibbsLabeler | None = None

    def open(self, state: dict | None, session: Session) -> None:
        if session.rank == 0:
            self.fence = self.client.open(state)
        session.barrier()
        if session.rank != 0:
            self.fence = self.client.join()

    def _check_not_counted(self, state: dict) -> None:
        """Refuse a store that counts samples of the noisy validation split in C."""
        if self.held_out is None:
            return
        bad = np.flatnonzero(state["counted"].numpy() & self.held_out)
        if bad.size:
            raise ValueError(f"the store counts {bad.size} samples of the noisy validation "
                             f"split (idx {bad[:5].tolist()}...): create it with "
                             f"pipeline.cluster.ray_train."
                             f"initial_assignment_placeholder(view, run)")

    def start(self, idx: Tensor, z0: Tensor, *, k_latent: int, trusted: Tensor | None,
              clean: Tensor) -> None:
        """Commit this rank's initial assignment (the store ignores samples it does not
        count: trusted and held-out ones), then wait for every rank's."""
        self.client.commit(idx, z0, worker=f"init.rank{self.session.rank}.{self.fence[:8]}",
                           seq=0)
        self.session.barrier()

    def labeler(self, cfg: Any, *, phi_init: Tensor, max_steps: int, trusted: Tensor | None,
                clean: Tensor, steps_per_epoch: int) -> GibbsLabeler:
        """This rank's labeler over the store actor. ``commit_every`` is capped at a quarter
        of an epoch's steps, so a replica never misses most of an epoch of the other
        workers' labels (tiny runs, e.g. smoke tests)."""
        cfg = replace(cfg, commit_every=min(cfg.commit_every, max(1, steps_per_epoch // 4)))
        counts, version = self.client.snapshot()
        rank = self.session.rank
        labeler = DistLabeler(cfg, self.client, counts, version, phi_init=phi_init,
                              max_steps=max_steps, generator=torch.Generator(), trusted=trusted,
                              clean=clean, worker=f"rank{rank}.{self.fence[:8]}", seed=self.seed,
                              rank=rank, device=self.device, compile_mode=self.compile_mode,
                              steps_per_epoch=steps_per_epoch)
        prev = self._made
        if prev is not None and prev.worker == labeler.worker:
            # the store has seen the earlier labeler's commits under this worker name: a
            # sequence restarted at 0 would be refused as duplicates (the guard's switch
            # lost every commit until the new sequence passed the old one)
            labeler.seq = prev.seq
        self._made = labeler
        return labeler

    def read(self) -> dict | None:
        """The chain state (rank 0; the store checks its invariants), with no held-out
        sample counted."""
        state = self.client.check_state()
        self._check_not_counted(state)
        return state

    def stats(self) -> dict[str, float]:
        return {f"store_{key}": v for key, v in self.client.stats().items()
                if key in ("duplicates", "refused", "busy_s")}


class ChainSet:
    """One chain per network (DivideLCCN: each network keeps its own C and z, see
    docs/methods.md), behind the single-chain interface the engine uses: ``open`` gives
    chain i ``state["chains"][i]``; ``read`` returns ``{"chains": [state_0, ...],
    "version": sum of the versions}`` (None before any chain started). ``chains[i]`` is
    what a method starts and draws labelers from."""

    def __init__(self, chains: list[Any]) -> None:
        if len(chains) < 2:
            raise ValueError(f"a ChainSet holds two or more chains, got {len(chains)}")
        self.chains = list(chains)
        self.shared = any(c.shared for c in self.chains)

    def __len__(self) -> int:
        return len(self.chains)

    def __getitem__(self, i: int) -> Any:
        return self.chains[i]

    # the engine sets these once; every chain's labelers follow them
    @property
    def device(self) -> torch.device | None:
        return self.chains[0].device

    @device.setter
    def device(self, value: torch.device | None) -> None:
        for c in self.chains:
            c.device = value

    @property
    def compile_mode(self) -> str:
        return self.chains[0].compile_mode

    @compile_mode.setter
    def compile_mode(self, value: str) -> None:
        for c in self.chains:
            c.compile_mode = value

    def open(self, state: dict | None, session: Session) -> None:
        states = [None] * len(self.chains) if state is None else list(state["chains"])
        if len(states) != len(self.chains):
            raise ValueError(f"the checkpoint holds {len(states)} chains; this run has "
                             f"{len(self.chains)}")
        for c, st in zip(self.chains, states):
            c.open(st, session)

    def read(self) -> dict | None:
        states = [c.read() for c in self.chains]
        if all(st is None for st in states):
            return None
        return {"chains": states,
                "version": sum(int(st["version"]) for st in states if st is not None)}

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, c in enumerate(self.chains):
            out.update({f"{key}_chain{i}": v for key, v in c.stats().items()})
        return out


def chain_counts(state: dict | None) -> Tensor | None:
    """The counts C of a chain state (a :class:`ChainSet`'s: the first network's), or
    None."""
    if state is None:
        return None
    if "chains" in state:
        return chain_counts(state["chains"][0])
    return state["counts"]
