"""Synthetic label noise and real annotator labels, as label views over one set of shards.

Every function here is pure numpy: it maps clean labels (plus a seed) to a
:class:`~pipeline.core.labels.LabelView` and never touches images, Ray or files other than the
``key,label`` file that :func:`from_csv` reads.

Conventions (see ``pipeline/core/labels.py``):

- ``clean: (N,) int64`` in ``[0, K)`` for the synthetic models (the dataset's clean labels);
  a view's ``clean`` is ``K`` for an out-of-distribution sample and ``-1`` where unknown.
- ``transition: (K, K)`` or ``(K + 1, K)`` float64, ``T[k, j] = P(observed = j | clean = k)``;
  rows sum to 1 (the outlier row ``K`` is zero when there is no outlier). It is the TRUE
  matrix the noise process samples from, not the realised one
  (:meth:`LabelView.realised_transition` gives that).
- ``spec``: a plain JSON-able dict, normalised (every default filled in) so that
  ``make_view(view.spec, clean, K)`` rebuilds the same view.

Randomness: every function takes an explicit integer ``seed``. The generator is
``default_rng(SeedSequence([seed, tag]))`` with a fixed tag per function, so that the same
seed used for, say, the noise and the trusted subset gives independent streams.

The ``spec`` form accepted by :func:`make_view` (what Ray Tune and the jobs pass)::

    {"kind": "clean"}                                   observed = clean, T = I
    {"kind": "dataset"}                                 the dataset's labels as they are
    {"kind": "symmetric", "rate": 0.5, "seed": 0, "include_true": True, "exact": False}
    {"kind": "asymmetric", "rate": 0.4, "seed": 0, "swap_cat_dog": False, "exact": False}
    {"kind": "pair_flip", "mapping": {"9": 1, "2": 0}, "rate": 0.4, "seed": 0, "exact": False}
    {"kind": "cifar100_superclass", "rate": 0.4, "seed": 0, "exact": False}
    {"kind": "open_set", "fraction": 0.2, "seed": 0, "noise": {<closed-set spec>}}
        (or "count": 10000 instead of "fraction"; optional "pixel_seed", default "seed")
    {"kind": "csv", "path": "labels.csv", "missing": "raise"}  (optional "sha256" is checked;
        "column": "random1" reads that column of a file with a header, as CIFAR-10N's)
    {"kind": "instance", "rate": 0.4, "seed": 0, "norm_std": 0.1}
        (instance-dependent, Xia et al. 2020; needs the images as features=)

and any of them may carry ``"trusted": {"fraction": 0.1, "seed": 0, "per_class": True}``
(or ``"count"``; optional ``"include_ood": True``; ``"outliers": 500`` adds that many
labelled out-of-distribution samples to a count of in-distribution ones) to mark an LCCN+
trusted subset, or ``"trusted": {"keys": "clean_train_key_list.txt"}``: the samples whose
dataset key is listed (Clothing1M's clean-train list).
"""

from __future__ import annotations

import csv
import hashlib
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.labels import LabelView
from pipeline.core import csvrows

# CIFAR-10 class indices (standard order: airplane automobile bird cat deer dog frog horse ship
# truck). The paper's asymmetric map: truck->automobile, bird->airplane, deer->horse, cat->dog.
CIFAR10_ASYM_MAP: dict[int, int] = {9: 1, 2: 0, 4: 7, 3: 5}

# CIFAR-100 fine label (alphabetical fine-label order, 0 = apple ... 99 = worm) -> coarse label
# (alphabetical super-class order, 0 = aquatic_mammals ... 19 = vehicles_2). 20 x 5 members.
CIFAR100_COARSE: np.ndarray = np.array([
    4, 1, 14, 8, 0, 6, 7, 7, 18, 3, 3, 14, 9, 18, 7, 11, 3, 9, 7, 11,
    6, 11, 5, 10, 7, 6, 13, 15, 3, 15, 0, 11, 1, 10, 12, 14, 16, 9, 11, 5,
    5, 19, 8, 8, 15, 13, 14, 17, 18, 10, 16, 4, 17, 4, 2, 0, 17, 4, 18, 17,
    10, 3, 2, 12, 12, 16, 12, 1, 9, 19, 2, 10, 0, 1, 16, 12, 9, 13, 15, 13,
    16, 19, 2, 4, 6, 19, 5, 5, 8, 19, 18, 1, 2, 15, 6, 0, 17, 8, 14, 13,
], dtype=np.int64)
CIFAR100_COARSE.setflags(write=False)

MISSING_POLICIES = ("raise", "keep")


# -- helpers ---------------------------------------------------------------------------------


def _check_seed(seed: Any, name: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"{name} must be a non-negative int, got {seed!r}")
    return int(seed)


def _rng(seed: int, tag: str) -> np.random.Generator:
    """A generator for ``seed`` whose stream also depends on the calling function's ``tag``."""
    seed = _check_seed(seed)
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(tag.encode())]))


def _check_rate(rate: Any, name: str = "rate") -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number in [0, 1], got {rate!r}")
    rate = float(rate)
    if not (0.0 <= rate <= 1.0):  # also rejects nan
        raise ValueError(f"{name} must be in [0, 1], got {rate!r}")
    return rate


def _check_k(num_classes: Any) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
            or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
    return int(num_classes)


def _check_clean(clean: Any, num_classes: int, *, allow_unknown: bool = False) -> np.ndarray:
    """``clean`` as a fresh ``(N,) int64`` array in ``[0, K)`` (or ``[-1, K]`` if allowed)."""
    arr = np.asarray(clean)
    if arr.ndim != 1:
        raise ValueError(f"clean labels must be (N,), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"clean labels must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=True)
    lo, hi = (-1, num_classes) if allow_unknown else (0, num_classes - 1)
    bad = np.flatnonzero((arr < lo) | (arr > hi))
    if bad.size:
        raise ValueError(
            f"clean label {int(arr[bad[0]])} at idx {int(bad[0])} is outside [{lo}, {hi}]"
            + ("" if allow_unknown else " (synthetic noise needs a known in-distribution label)")
        )
    return arr


def _select(clean: np.ndarray, rate: float, rng: np.random.Generator, *, exact: bool,
            eligible: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask of samples the noise acts on.

    ``exact=False``: each (eligible) sample independently with probability ``rate``.
    ``exact=True``: exactly ``round(rate * n_c)`` samples of each clean class ``c``, chosen
    uniformly (the realised row rates then equal ``rate`` up to rounding).
    """
    n = len(clean)
    if eligible is None:
        eligible = np.ones(n, bool)
    if not exact:
        return (rng.random(n) < rate) & eligible
    cand = np.flatnonzero(eligible)
    return _stratified_pick(clean, cand, lambda counts: np.rint(rate * counts).astype(np.int64),
                            rng)


def _stratified_pick(strata: np.ndarray, cand: np.ndarray, quota_fn,
                     rng: np.random.Generator) -> np.ndarray:
    """Mask picking, uniformly without replacement, ``quota_fn(counts)[s]`` of ``cand`` per
    stratum ``s = strata[cand]`` (``strata`` values are non-negative ints)."""
    mask = np.zeros(len(strata), bool)
    if cand.size == 0:
        return mask
    s = strata[cand]
    counts = np.bincount(s)
    quota = np.asarray(quota_fn(counts), np.int64)
    order = np.lexsort((rng.random(cand.size), s))  # by stratum, random within
    s_sorted = s[order]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(cand.size) - starts[s_sorted]
    mask[cand[order[rank < quota[s_sorted]]]] = True
    return mask


def _class_histogram(labels: np.ndarray, num_classes: int) -> np.ndarray:
    h = np.bincount(labels, minlength=num_classes).astype(np.float64)
    return h / h.sum() if h.sum() > 0 else h


# -- closed-set synthetic noise --------------------------------------------------------------


def clean_view(clean: Any, num_classes: int) -> LabelView:
    """No noise: ``observed = clean``, ``T = I``."""
    k = _check_k(num_classes)
    c = _check_clean(clean, k)
    return LabelView(observed=c.copy(), clean=c, num_classes=k,
                     transition=np.eye(k), spec={"kind": "clean"})


def symmetric(clean: Any, num_classes: int, rate: float, *, include_true: bool = True,
              seed: int, exact: bool = False) -> LabelView:
    """Symmetric (uniform) noise.

    ``include_true=True`` (DivideMix's convention): with probability ``rate`` the label is
    replaced by a class drawn uniformly from all ``K`` (possibly the true one), so
    ``T = (1 - rate) I + rate / K * 1 1^T`` and the expected realised flip rate is
    ``rate * (K - 1) / K``. ``include_true=False``: with probability ``rate`` the label moves
    to one of the ``K - 1`` other classes uniformly, ``T[k, k] = 1 - rate``,
    ``T[k, j != k] = rate / (K - 1)``.

    ``exact=True`` resamples exactly ``round(rate * n_c)`` samples of each class ``c``
    (DivideMix draws a fixed count ``rate * N`` over the whole set) instead of Bernoulli draws.

    clean: ``(N,)`` int in ``[0, K)``. Returns a view with ``transition (K, K)``.
    """
    k = _check_k(num_classes)
    c = _check_clean(clean, k)
    rate = _check_rate(rate)
    rng = _rng(seed, "symmetric")
    hit = _select(c, rate, rng, exact=exact)
    obs = c.copy()
    if include_true:
        obs[hit] = rng.integers(0, k, size=int(hit.sum()))
        t = (1.0 - rate) * np.eye(k) + rate / k
    else:
        obs[hit] = (c[hit] + rng.integers(1, k, size=int(hit.sum()))) % k
        t = (1.0 - rate) * np.eye(k) + rate / (k - 1) * (1.0 - np.eye(k))
    spec = {"kind": "symmetric", "rate": rate, "seed": int(seed),
            "include_true": bool(include_true), "exact": bool(exact)}
    return LabelView(observed=obs, clean=c, num_classes=k, transition=t, spec=spec)


def pair_flip(clean: Any, num_classes: int, mapping: Mapping[Any, Any], rate: float, *,
              seed: int, exact: bool = False) -> LabelView:
    """Class-pair flips: a sample of class ``src`` is relabelled ``mapping[src]`` with
    probability ``rate``; classes not in ``mapping`` never change.

    ``T[src, src] = 1 - rate``, ``T[src, mapping[src]] = rate``, other rows identity.
    ``mapping`` keys may be ints or decimal strings (JSON object keys).
    clean: ``(N,)`` int in ``[0, K)``. Returns a view with ``transition (K, K)``.
    """
    k = _check_k(num_classes)
    c = _check_clean(clean, k)
    rate = _check_rate(rate)
    pairs = _check_mapping(mapping, k)
    rng = _rng(seed, "pair_flip")
    lut = np.arange(k)
    t = np.eye(k)
    for src, dst in pairs.items():
        lut[src] = dst
        t[src, src] = 1.0 - rate
        t[src, dst] = rate
    hit = _select(c, rate, rng, exact=exact, eligible=np.isin(c, list(pairs)))
    obs = c.copy()
    obs[hit] = lut[c[hit]]
    spec = {"kind": "pair_flip", "mapping": {str(s): d for s, d in sorted(pairs.items())},
            "rate": rate, "seed": int(seed), "exact": bool(exact)}
    return LabelView(observed=obs, clean=c, num_classes=k, transition=t, spec=spec)


def _check_mapping(mapping: Any, k: int) -> dict[int, int]:
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(f"mapping must be a non-empty dict src -> dst, got {mapping!r}")
    out: dict[int, int] = {}
    for src, dst in mapping.items():
        try:
            s = int(src)
            if isinstance(src, bool) or (isinstance(src, str) and str(s) != src.strip()):
                raise ValueError
            if isinstance(dst, bool) or not isinstance(dst, (int, np.integer)):
                raise ValueError
            d = int(dst)
        except (TypeError, ValueError):
            raise ValueError(f"mapping entry {src!r}: {dst!r} is not int -> int") from None
        if not (0 <= s < k and 0 <= d < k):
            raise ValueError(f"mapping entry {s} -> {d} is outside [0, {k})")
        if s == d:
            raise ValueError(f"mapping entry {s} -> {d} maps a class to itself")
        if s in out:
            raise ValueError(f"mapping has class {s} twice")
        out[s] = d
    return out


def asymmetric_cifar10(clean: Any, rate: float, *, swap_cat_dog: bool = False, seed: int,
                       exact: bool = False) -> LabelView:
    """The paper's CIFAR-10 asymmetric noise: truck(9)->automobile(1), bird(2)->airplane(0),
    deer(4)->horse(7), cat(3)->dog(5), each with probability ``rate``; ``swap_cat_dog=True``
    also flips dog(5)->cat(3) (the convention of Patrini et al. / DivideMix code).

    clean: ``(N,)`` int in ``[0, 10)``. Returns a view with ``transition (10, 10)``.
    """
    mapping = dict(CIFAR10_ASYM_MAP)
    if swap_cat_dog:
        mapping[5] = 3
    v = pair_flip(clean, 10, mapping, rate, seed=seed, exact=exact)
    spec = {"kind": "asymmetric", "rate": v.spec["rate"], "seed": int(seed),
            "swap_cat_dog": bool(swap_cat_dog), "exact": bool(exact)}
    return _with_spec(v, spec)


def cifar100_next_in_superclass() -> dict[int, int]:
    """Fine class -> the next fine class circularly (ascending fine index) in its super-class."""
    out: dict[int, int] = {}
    for g in range(20):
        members = np.flatnonzero(CIFAR100_COARSE == g)
        for a, b in zip(members, np.roll(members, -1)):
            out[int(a)] = int(b)
    return out


def cifar100_superclass(clean: Any, rate: float, *, seed: int, coarse: Any = None,
                        exact: bool = False) -> LabelView:
    """CIFAR-100 asymmetric noise: with probability ``rate`` a label moves to the next fine
    class circularly (by ascending fine index) within its true super-class (the 20 coarse
    classes of CIFAR-100, :data:`CIFAR100_COARSE`).

    Note: many public implementations (Patrini et al.'s code and its descendants) flip
    within blocks of 5 consecutive fine indices, which are NOT the super-classes; this uses
    the real ones.

    clean: ``(N,)`` int in ``[0, 100)``; coarse: optional ``(N,)`` per-sample coarse labels
    from the dataset, checked against the map. Returns a view with ``transition (100, 100)``.
    """
    c = _check_clean(clean, 100)
    if coarse is not None:
        check_cifar100_coarse(c, coarse)
    v = pair_flip(c, 100, cifar100_next_in_superclass(), rate, seed=seed, exact=exact)
    spec = {"kind": "cifar100_superclass", "rate": v.spec["rate"], "seed": int(seed),
            "exact": bool(exact)}
    return _with_spec(v, spec)


def check_cifar100_coarse(clean: Any, coarse: Any) -> None:
    """Raise ``ValueError`` naming the first idx whose coarse label disagrees with the map."""
    c = _check_clean(clean, 100)
    g = np.asarray(coarse)
    if g.shape != c.shape:
        raise ValueError(f"coarse must have the shape of clean {c.shape}, got {g.shape}")
    bad = np.flatnonzero(CIFAR100_COARSE[c] != g)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"idx {i}: coarse label {int(g[i])} disagrees with fine label {int(c[i])} "
            f"(expected coarse {int(CIFAR100_COARSE[c[i]])}); {bad.size} samples disagree "
            "- is this CIFAR-100 in the standard label order?"
        )


# -- open-set noise --------------------------------------------------------------------------


def open_set(clean: Any, num_classes: int, fraction: float | None = None, *, seed: int,
             count: int | None = None, base: LabelView | None = None,
             pixel_seed: int | None = None) -> LabelView:
    """Open-set noise: ``fraction`` of the samples (or exactly ``count``), chosen uniformly
    without replacement, become out-of-distribution: ``ood=True``, ``clean=K``; their image
    is replaced at read time by :func:`shuffle_pixels` with ``seed=spec["pixel_seed"]``.
    Their observed label stays what it was (the original label, or ``base.observed``).

    ``base``: an optional closed-set view of the same ``clean`` (e.g. asymmetric noise) whose
    observed labels and transition rows the in-distribution samples keep; the paper's
    open-set table combines 10,000 OOD images with closed-set noise at rate ``r`` (our
    reading of Section 4.1).

    Returns a view with ``transition (K + 1, K)``: rows ``[0, K)`` are ``base.transition``
    (identity without ``base``), row ``K`` is the histogram of the chosen samples' observed
    labels (all zero if none is chosen).
    """
    k = _check_k(num_classes)
    c = _check_clean(clean, k)
    n = len(c)
    if (fraction is None) == (count is None):
        raise ValueError("open_set needs exactly one of fraction or count")
    if fraction is not None:
        m = int(round(_check_rate(fraction, "fraction") * n))
    else:
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) \
                or not (0 <= count <= n):
            raise ValueError(f"count must be an int in [0, {n}], got {count!r}")
        m = int(count)
    if base is None:
        obs, t_in, base_spec = c.copy(), np.eye(k), None
    else:
        if base.num_classes != k or not np.array_equal(base.clean, c):
            raise ValueError("base view must be over the same clean labels and num_classes")
        if base.transition is None or base.transition.shape != (k, k) or base.has_outliers \
                or base.trusted.any():
            raise ValueError("base view must be closed-set noise with a (K, K) transition "
                             "and no trusted samples (add those to the open-set view)")
        obs, t_in, base_spec = base.observed.copy(), base.transition, dict(base.spec)
    rng = _rng(seed, "open_set")
    chosen = rng.choice(n, size=m, replace=False) if m else np.zeros(0, np.int64)
    ood = np.zeros(n, bool)
    ood[chosen] = True
    clean_out = c.copy()
    clean_out[ood] = k
    t = np.vstack([t_in, _class_histogram(obs[ood], k)[None, :]])
    spec: dict[str, Any] = {"kind": "open_set", "seed": int(seed),
                            "pixel_seed": int(seed if pixel_seed is None else pixel_seed)}
    if fraction is not None:
        spec["fraction"] = float(fraction)
    else:
        spec["count"] = m
    if base_spec is not None:
        spec["noise"] = base_spec
    _check_seed(spec["pixel_seed"], "pixel_seed")
    return LabelView(observed=obs, clean=clean_out, num_classes=k, ood=ood, transition=t,
                     spec=spec)


def shuffle_pixels(image: np.ndarray, *, idx: int, seed: int) -> np.ndarray:
    """The open-set image of sample ``idx``: its pixel positions permuted.

    image: ``(H, W, C)`` (or ``(H, W)``) array, typically uint8. The same ``(idx, seed)``
    and image size give the same permutation; channels of a pixel move together. Returns a
    new array of the same shape and dtype; the input is not modified.
    """
    img = np.asarray(image)
    if img.ndim not in (2, 3):
        raise ValueError(f"image must be (H, W, C) or (H, W), got shape {img.shape}")
    if isinstance(idx, bool) or not isinstance(idx, (int, np.integer)) or idx < 0:
        raise ValueError(f"idx must be a non-negative int, got {idx!r}")
    h, w = img.shape[:2]
    rng = _rng(seed, f"shuffle_pixels/{int(idx)}")
    perm = rng.permutation(h * w)
    flat = img.reshape(h * w, -1)
    return np.ascontiguousarray(flat[perm].reshape(img.shape))


# -- real annotator labels -------------------------------------------------------------------


def from_csv(path: str | os.PathLike, keys: Sequence[str], num_classes: int, *,
             clean: Any = None, missing: str = "raise", default: Any = None,
             expect_sha256: str | None = None, column: str | None = None) -> LabelView:
    """Observed labels from a ``key,label`` file (real annotator noise).

    Format: one ``key,label`` per line; an optional first line ``key,label`` (header); blank
    lines are skipped; fields are stripped; a key may be CSV-quoted, and since the label is
    the last field a key with unquoted commas (Clothing1M's ``images/7/88/3396,2782.jpg``)
    also reads. ``keys[i]`` is the key of sample ``idx = i``.

    column: read a file of several label sets instead (CIFAR-10N's ``key,aggre,random1``):
    its first line is a header naming ``key`` and ``column``, every row has as many fields
    as the header, and the label is that column's field.

    Raises ``ValueError`` naming ``path:line`` for a malformed line, a label outside
    ``[0, K)``, a key that is not in ``keys``, or a key given twice.

    missing: what to do with samples the file does not list. ``"raise"`` (the default: a
    file covering only part of the split is most often a key-format mismatch, and silent
    fallback would train on the wrong labels) or ``"keep"``: use ``default[idx]`` (the
    dataset's own label, required then).

    clean: optional ``(N,)`` clean labels (``-1`` unknown, ``K`` outlier); all ``-1`` if None.
    The view's ``transition`` is None (the true process is unknown; see
    ``realised_transition`` on samples with a clean label). The spec records the file's
    sha256; ``expect_sha256`` makes a changed file an error.
    """
    path = Path(path)
    k = _check_k(num_classes)
    if missing not in MISSING_POLICIES:
        raise ValueError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")
    keys = [str(x) for x in keys]
    n = len(keys)
    index: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key in index:
            raise ValueError(f"keys: key {key!r} appears at idx {index[key]} and idx {i}")
        index[key] = i
    clean_arr = (np.full(n, -1, np.int64) if clean is None
                 else _check_clean(clean, k, allow_unknown=True))
    if len(clean_arr) != n:
        raise ValueError(f"clean has {len(clean_arr)} labels but keys has {n}")

    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if expect_sha256 is not None and expect_sha256 != digest:
        raise ValueError(f"{path}: sha256 {digest} != expected {expect_sha256} (file changed?)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None

    obs = np.full(n, -1, np.int64)
    seen_at = np.zeros(n, np.int64)  # line number where idx was set (0 = not yet)
    first = True
    header: list[str] | None = None
    try:
        for line, row in csvrows.rows(text.splitlines(keepends=True), path, header=False):
            fields = [f.strip() for f in row]
            if not fields or fields == [""]:
                continue
            if first:
                first = False
                if column is not None:
                    header = [f.lower() for f in fields]
                    if "key" not in header or column.lower() not in header:
                        raise ValueError(f"{path}:{line}: header {','.join(fields)!r} has no "
                                         f"'key' and {column!r} columns")
                    continue
                if [f.lower() for f in fields] == ["key", "label"]:
                    continue
            if header is not None:
                if len(fields) != len(header):
                    raise ValueError(f"{path}:{line}: {len(fields)} fields, the header has "
                                     f"{len(header)}")
                key, lab = fields[header.index("key")], fields[header.index(column.lower())]
            elif len(fields) < 2:
                raise ValueError(f"{path}:{line}: malformed line {','.join(row)!r} "
                                 "(expected key,label)")
            else:
                key, lab = ",".join(fields[:-1]), fields[-1]
            try:
                label = int(lab)
            except ValueError:
                raise ValueError(f"{path}:{line}: label {lab!r} is not an integer") from None
            if not 0 <= label < k:
                raise ValueError(f"{path}:{line}: label {label} is outside [0, {k})")
            i = index.get(key)
            if i is None:
                raise ValueError(f"{path}:{line}: key {key!r} is not a sample of this split")
            if seen_at[i]:
                raise ValueError(f"{path}:{line}: key {key!r} is listed twice "
                                 f"(first on line {seen_at[i]})")
            seen_at[i] = line
            obs[i] = label
    except csvrows.CSVFormatError as e:  # an unterminated quote, a line csv cannot read
        raise ValueError(str(e)) from None

    absent = np.flatnonzero(obs < 0)
    if absent.size:
        if missing == "raise":
            raise ValueError(
                f"{path}: {absent.size} of {n} samples are not listed (first: idx "
                f"{int(absent[0])}, key {keys[absent[0]]!r}); pass missing='keep' to use the "
                "dataset's labels for them"
            )
        if default is None:
            raise ValueError("missing='keep' needs default= (the dataset's labels)")
        dflt = _check_clean(default, k)
        if len(dflt) != n:
            raise ValueError(f"default has {len(dflt)} labels but keys has {n}")
        obs[absent] = dflt[absent]
    spec = {"kind": "csv", "path": str(path), "sha256": digest, "missing": missing,
            "listed": int(n - absent.size)}
    if column is not None:
        spec["column"] = column
    return LabelView(observed=obs, clean=clean_arr, num_classes=k, spec=spec)


def write_csv(path: str | os.PathLike, keys: Sequence[str], labels: Any) -> Path:
    """Write a ``key,label`` file (with header) that :func:`from_csv` reads back."""
    path = Path(path)
    labels = np.asarray(labels)
    if len(keys) != len(labels):
        raise ValueError(f"{len(keys)} keys but {len(labels)} labels")
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["key", "label"])
        for key, lab in zip(keys, labels.tolist()):
            w.writerow([key, int(lab)])
    return path


# -- trusted subset (LCCN+) ------------------------------------------------------------------


def trusted_subset(view: LabelView, fraction: float | None = None, *, seed: int,
                   count: int | None = None, per_class: bool = True,
                   include_ood: bool = True, outliers: int | None = None) -> LabelView:
    """Mark a subset of the samples with a known clean label as trusted (LCCN+).

    Exactly one of ``fraction`` (of the samples with a known clean label) or ``count``.
    Candidates: ``clean >= 0`` (and ``clean < K`` unless ``include_ood``: an outlier's
    known "label" is the outlier class K). ``per_class=True`` stratifies by clean label
    (the outlier class is its own stratum): each class gets its proportional share,
    rounded by largest remainder so the total is exact. The new mask replaces
    ``view.trusted``; the spec gains ``"trusted": {...}``.

    ``outliers``: the paper's semi-supervised open-set setting (5,000 clean samples and
    500 labelled outliers on CIFAR): ``fraction``/``count`` then pick among the
    in-distribution samples only and, independently, exactly ``outliers`` of the
    out-of-distribution samples (``clean == K``) are trusted too.
    """
    k = view.num_classes
    cand_mask = view.clean >= 0
    if not include_ood or outliers is not None:
        cand_mask &= view.clean < k
    cand = np.flatnonzero(cand_mask)
    if (fraction is None) == (count is None):
        raise ValueError("trusted_subset needs exactly one of fraction or count")
    if fraction is not None:
        m = int(round(_check_rate(fraction, "trusted fraction") * cand.size))
    else:
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"trusted count must be a non-negative int, got {count!r}")
        m = int(count)
        if m > cand.size:
            raise ValueError(f"trusted count {m} exceeds the {cand.size} samples with a "
                             "known clean label")
    rng = _rng(seed, "trusted")
    if per_class:
        strata = np.where(cand_mask, view.clean, 0)

        def quota(counts: np.ndarray) -> np.ndarray:
            share = m * counts / max(cand.size, 1)
            q = np.floor(share).astype(np.int64)
            rest = m - int(q.sum())
            if rest:
                q[np.argsort(-(share - q), kind="stable")[:rest]] += 1
            return q

        trusted = _stratified_pick(strata, cand, quota, rng)
    else:
        trusted = np.zeros(len(view), bool)
        trusted[rng.choice(cand, size=m, replace=False)] = True
    tspec: dict[str, Any] = {"seed": int(seed), "per_class": bool(per_class),
                             "include_ood": bool(include_ood)}
    if fraction is not None:
        tspec["fraction"] = float(fraction)
    else:
        tspec["count"] = m
    if outliers is not None:
        if isinstance(outliers, bool) or not isinstance(outliers, (int, np.integer)) \
                or outliers < 0:
            raise ValueError(f"trusted outliers must be a non-negative int, got {outliers!r}")
        ood = np.flatnonzero(view.clean == k)
        if outliers > ood.size:
            raise ValueError(f"trusted outliers {outliers} exceeds the {ood.size} "
                             f"out-of-distribution samples of the view")
        pick = _rng(seed, "trusted_outliers").choice(ood, size=int(outliers), replace=False)
        trusted[pick] = True
        tspec["outliers"] = int(outliers)
    spec = {**view.spec, "trusted": tspec}
    return LabelView(observed=view.observed, clean=view.clean, num_classes=k, trusted=trusted,
                     ood=view.ood, transition=view.transition, spec=spec)


def read_key_list(path: str | os.PathLike) -> list[str]:
    """The keys of a key-list file, one per line (e.g. Clothing1M's
    ``clean_train_key_list.txt``; surrounding blanks and empty lines ignored)."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"trusted key list {p}: cannot read it ({e})") from None
    keys = [line.strip() for line in lines if line.strip()]
    if not keys:
        raise ValueError(f"trusted key list {p}: no key in it")
    return keys


def trusted_by_keys(view: LabelView, keys: Sequence[str], path: str | os.PathLike,
                    *, listed: Sequence[str] | None = None) -> LabelView:
    """Mark as trusted the samples whose key (``keys[idx]``) is in the key list at
    ``path`` (or ``listed``) and whose clean label is known: Clothing1M's LCCN+ takes its
    trusted set from ``clean_train_key_list.txt``, over the noisy training split whose
    ``clean`` field carries the clean label of every annotated image. A listed key that is
    not in the split is ignored (the clean-train list also names images outside the noisy
    split); a listed sample without a clean label is an error naming it. The spec gains
    ``"trusted": {"keys": path}``."""
    if len(keys) != len(view):
        raise ValueError(f"{len(keys)} keys for a view of {len(view)} samples")
    wanted = set(read_key_list(path) if listed is None else listed)
    hit = np.fromiter((key in wanted for key in keys), bool, count=len(keys))
    unknown = np.flatnonzero(hit & (view.clean < 0))
    if unknown.size:
        i = int(unknown[0])
        raise ValueError(f"trusted key list {path}: {unknown.size} listed samples have no "
                         f"clean label in the view (first: idx {i}, key {keys[i]!r})")
    spec = {**view.spec, "trusted": {"keys": str(path)}}
    return LabelView(observed=view.observed, clean=view.clean, num_classes=view.num_classes,
                     trusted=hit, ood=view.ood, transition=view.transition, spec=spec)


def _with_spec(v: LabelView, spec: dict[str, Any]) -> LabelView:
    return LabelView(observed=v.observed, clean=v.clean, num_classes=v.num_classes,
                     trusted=v.trusted, ood=v.ood, transition=v.transition, spec=spec)


# -- instance-dependent noise ----------------------------------------------------------------


def instance_dependent(clean: Any, features: Any, num_classes: int, rate: float, *, seed: int,
                       norm_std: float = 0.1) -> LabelView:
    """Instance-dependent label noise, the generator of Xia et al. 2020 ("Part-dependent
    label noise: towards instance-dependent label noise", NeurIPS), the common stand-in for
    human annotation noise ("IDN-r").

    Each sample n draws a flip rate ``q_n`` from a normal of mean ``rate`` and std
    ``norm_std`` truncated to [0, 1]; one Gaussian projection ``W[c] (d, K)`` per clean
    class c maps the sample's features to scores over the K classes; the true class's
    score is removed and the rest softmaxed, so the flip target depends on the image:
    ``P(observed = j | x_n) = q_n softmax(x_n W[c_n])_j`` for ``j != c_n``, ``1 - q_n`` for
    ``j = c_n``. The expected realised flip rate is the mean of the truncated normal
    (``rate`` for 0.1 <= rate <= 0.9 at the default std).

    clean: (N,) int in [0, K); features: (N, d) float, e.g. the flattened, normalised
    images (as in the reference code). There is no class-level transition that generates
    this noise; the view's ``transition`` is the *realised* ``T[k, j]`` (rows sum to 1).
    """
    from scipy.stats import (
        truncnorm,  # scikit-learn's dependency; only this generator needs it
    )

    k = _check_k(num_classes)
    c = _check_clean(clean, k)
    rate = _check_rate(rate)
    x = np.asarray(features, dtype=np.float32).reshape(len(c), -1)
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x).all(1))[0])
        raise ValueError(f"features of idx {bad} are not finite")
    if not norm_std > 0:
        raise ValueError(f"norm_std must be > 0, got {norm_std}")
    rng = _rng(seed, "instance")
    q = truncnorm.rvs(-rate / norm_std, (1 - rate) / norm_std, loc=rate, scale=norm_std,
                      size=len(c), random_state=rng)
    w = rng.standard_normal((k, x.shape[1], k)).astype(np.float32)
    p = np.empty((len(c), k), dtype=np.float64)
    for cls in range(k):
        rows = np.flatnonzero(c == cls)
        if rows.size == 0:
            continue
        a = (x[rows] @ w[cls]).astype(np.float64)                       # (n_c, K)
        a[:, cls] = -np.inf
        a = np.exp(a - a.max(1, keepdims=True))
        a /= a.sum(1, keepdims=True)
        a *= q[rows, None]
        a[:, cls] = 1.0 - q[rows]
        p[rows] = a
    u = rng.random(len(c))[:, None]
    obs = np.minimum((p.cumsum(1) < u).sum(1), k - 1).astype(np.int64)
    t = np.zeros((k, k))
    np.add.at(t, (c, obs), 1.0)
    t /= np.maximum(t.sum(1, keepdims=True), 1.0)
    spec = {"kind": "instance", "rate": rate, "seed": int(seed), "norm_std": float(norm_std)}
    return LabelView(observed=obs, clean=c, num_classes=k, transition=t, spec=spec)


# -- spec dispatch ---------------------------------------------------------------------------

_CLOSED_KINDS = ("clean", "symmetric", "asymmetric", "pair_flip", "cifar100_superclass")
KINDS = (*_CLOSED_KINDS, "dataset", "open_set", "csv", "instance")
_KEYS: dict[str, tuple[set[str], set[str]]] = {  # kind -> (required, optional) keys
    "clean": (set(), set()),
    "dataset": (set(), set()),
    "symmetric": ({"rate", "seed"}, {"include_true", "exact"}),
    "asymmetric": ({"rate", "seed"}, {"swap_cat_dog", "exact"}),
    "pair_flip": ({"mapping", "rate", "seed"}, {"exact"}),
    "cifar100_superclass": ({"rate", "seed"}, {"exact"}),
    "open_set": ({"seed"}, {"fraction", "count", "noise", "pixel_seed"}),
    "csv": ({"path"}, {"missing", "sha256", "listed", "column"}),
    "instance": ({"rate", "seed"}, {"norm_std"}),
}
_TRUSTED_KEYS = ({"seed"}, {"fraction", "count", "per_class", "include_ood", "outliers"})


def _check_keys(d: Mapping[str, Any], required: set[str], optional: set[str], what: str) -> None:
    unknown = sorted(set(d) - required - optional)
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; allowed: "
                         f"{sorted(required | optional)}")
    absent = sorted(required - set(d))
    if absent:
        raise ValueError(f"{what}: missing key(s) {absent}")


def _flag(d: Mapping[str, Any], name: str, default: bool, what: str) -> bool:
    v = d.get(name, default)
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{what}: {name} must be true or false, got {v!r}")
    return bool(v)


def make_view(spec: Mapping[str, Any], clean: Any, num_classes: int, *,
              keys: Sequence[str] | None = None, coarse: Any = None,
              observed: Any = None, features: Any = None) -> LabelView:
    """Build a label view from a plain-data ``spec`` (see the module docstring for kinds).

    clean: ``(N,)`` clean labels. The synthetic kinds need every label in ``[0, K)``;
    ``"dataset"`` and ``"csv"`` accept ``-1`` (unknown) and ``K`` (outlier).
    keys: ``(N,)`` sample keys, needed by ``"csv"``. coarse: optional CIFAR-100 coarse
    labels, checked by ``"cifar100_superclass"``. observed: the dataset's own labels, needed
    by ``"dataset"`` and by ``"csv"`` with ``"missing": "keep"``. features: ``(N, d)``
    per-sample features (the flattened images), needed by ``"instance"``.

    Raises ``ValueError`` naming the offending key or value. The returned ``view.spec`` is
    the normalised spec: ``make_view(view.spec, ...)`` rebuilds the same view.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"spec must be a dict, got {type(spec).__name__}: {spec!r}")
    spec = dict(spec)
    trusted = spec.pop("trusted", None)
    if spec.get("kind") == "instance":
        _check_keys({k: v for k, v in spec.items() if k != "kind"}, *_KEYS["instance"],
                    "spec kind 'instance'")
        if features is None:
            raise ValueError("spec kind 'instance' needs features= (the images, (N, d))")
        view = instance_dependent(clean, features, num_classes, spec["rate"],
                                  seed=spec["seed"], norm_std=spec.get("norm_std", 0.1))
    else:
        view = _make_base(spec, clean, num_classes, keys=keys, coarse=coarse,
                          observed=observed)
    if trusted is not None:
        view = apply_trusted(view, trusted, keys=keys)
    return view


def apply_trusted(view: LabelView, trusted: Mapping[str, Any], *,
                  keys: Sequence[str] | None = None) -> LabelView:
    """Mark the trusted subset that a spec's ``"trusted"`` entry asks for (a fraction or a
    count with a seed, or a key list, which needs ``keys``: the key of each idx) on
    ``view``; ``ValueError`` naming the bad entry otherwise."""
    if not isinstance(trusted, Mapping):
        raise ValueError(f"spec 'trusted' must be a dict, got {trusted!r}")
    if "keys" in trusted:
        _check_keys(trusted, {"keys"}, set(), "spec 'trusted'")
        if keys is None:
            raise ValueError("spec 'trusted' with 'keys' needs keys= (the key of each idx)")
        return trusted_by_keys(view, keys, trusted["keys"])
    _check_keys(trusted, *_TRUSTED_KEYS, "spec 'trusted'")
    return trusted_subset(
        view, trusted.get("fraction"), seed=trusted["seed"], count=trusted.get("count"),
        per_class=_flag(trusted, "per_class", True, "spec 'trusted'"),
        include_ood=_flag(trusted, "include_ood", True, "spec 'trusted'"),
        outliers=trusted.get("outliers"))


def _make_base(spec: dict[str, Any], clean: Any, num_classes: int, *, keys, coarse,
               observed) -> LabelView:
    kind = spec.get("kind")
    if kind not in _KEYS:
        raise ValueError(f"spec kind {kind!r} is not one of {list(KINDS)}")
    what = f"spec kind {kind!r}"
    required, optional = _KEYS[kind]
    _check_keys({k: v for k, v in spec.items() if k != "kind"}, required, optional, what)
    k = _check_k(num_classes)
    exact = _flag(spec, "exact", False, what)
    if kind == "clean":
        return clean_view(clean, k)
    if kind == "symmetric":
        return symmetric(clean, k, spec["rate"], seed=spec["seed"], exact=exact,
                         include_true=_flag(spec, "include_true", True, what))
    if kind == "asymmetric":
        if k != 10:
            raise ValueError(f"{what} is the CIFAR-10 map and needs num_classes=10, got {k} "
                             "(use 'cifar100_superclass' or 'pair_flip')")
        return asymmetric_cifar10(clean, spec["rate"], seed=spec["seed"], exact=exact,
                                  swap_cat_dog=_flag(spec, "swap_cat_dog", False, what))
    if kind == "pair_flip":
        return pair_flip(clean, k, spec["mapping"], spec["rate"], seed=spec["seed"],
                         exact=exact)
    if kind == "cifar100_superclass":
        if k != 100:
            raise ValueError(f"{what} needs num_classes=100, got {k}")
        return cifar100_superclass(clean, spec["rate"], seed=spec["seed"], coarse=coarse,
                                   exact=exact)
    if kind == "dataset":
        if observed is None:
            raise ValueError(f"{what} needs observed= (the dataset's labels)")
        c = _check_clean(clean, k, allow_unknown=True)
        return LabelView(observed=observed, clean=c, num_classes=k, spec={"kind": "dataset"})
    if kind == "open_set":
        base = None
        if "noise" in spec:
            sub = spec["noise"]
            if not isinstance(sub, Mapping) or sub.get("kind") not in _CLOSED_KINDS \
                    or "trusted" in sub:
                raise ValueError(f"{what}: 'noise' must be a closed-set spec (kind one of "
                                 f"{list(_CLOSED_KINDS)}, no 'trusted'), got {sub!r}")
            base = _make_base(dict(sub), clean, k, keys=keys, coarse=coarse, observed=observed)
        if ("fraction" in spec) == ("count" in spec):
            raise ValueError(f"{what}: give exactly one of 'fraction' or 'count'")
        return open_set(clean, k, spec.get("fraction"), count=spec.get("count"),
                        seed=spec["seed"], base=base, pixel_seed=spec.get("pixel_seed"))
    # csv
    if keys is None:
        raise ValueError(f"{what} needs keys= (the key of each idx)")
    missing = spec.get("missing", "raise")
    return from_csv(spec["path"], keys, k, clean=clean, missing=missing, default=observed,
                    expect_sha256=spec.get("sha256"), column=spec.get("column"))


# -- reporting -------------------------------------------------------------------------------


def summary(view: LabelView) -> dict[str, Any]:
    """Plain-float figures of a view: sizes, realised vs expected noise rate, and how far
    the realised transition is from the true one (over samples with a known clean label).

    ``expected_rate`` = sum over known samples of ``P(observed != clean)`` under
    ``view.transition`` (an outlier is always counted as noisy); None without a transition.
    """
    k = view.num_classes
    known = view.clean >= 0
    out: dict[str, Any] = {
        "num_samples": len(view), "num_classes": k, "known_clean": int(known.sum()),
        "ood": int(view.ood.sum()), "trusted": int(view.trusted.sum()),
        "realised_rate": view.noise_rate(), "expected_rate": None,
        "max_abs_transition_error": None,
    }
    t = view.transition
    if t is not None and known.any():
        kl = t.shape[0]
        diag = np.append(np.diag(t[:k]), [0.0] * (kl - k))
        counts = np.bincount(view.clean[known], minlength=kl)[:kl]
        out["expected_rate"] = float((counts * (1.0 - diag)).sum() / counts.sum())
        real = view.realised_transition(k_latent=kl)
        rows = counts > 0
        out["max_abs_transition_error"] = float(np.abs(real - t)[rows].max()) if rows.any() \
            else 0.0
    return out


def format_transition(t: np.ndarray, *, digits: int = 2, max_classes: int = 20,
                      rows: str = "clean") -> str:
    """A text table of ``t[k, j]`` (rows = ``rows`` class k: ``"clean"`` for a noise
    process, ``"latent"`` for a learned phi; columns = observed j), or, for more than
    ``max_classes`` columns, the diagonal range and the largest off-diagonal entries."""
    k = t.shape[1]
    if k <= max_classes:
        width = digits + 3
        corner = rows + "\\obs"
        head = f"{corner:>10} " + " ".join(f"{j:>{width}d}" for j in range(k))
        lines = [head]
        for r in range(t.shape[0]):
            name = "out" if r == k else str(r)
            lines.append(f"{name:>10} " + " ".join(f"{x:{width}.{digits}f}" for x in t[r]))
        return "\n".join(lines)
    d = np.diag(t[:k])
    off = t.copy()
    off[np.arange(k), np.arange(k)] = 0.0
    top = np.argsort(-off, axis=None)[:10]
    pairs = ", ".join(f"{r}->{c}: {off[r, c]:.{digits}f}"
                      for r, c in zip(*np.unravel_index(top, off.shape)) if off[r, c] > 0)
    return (f"diagonal in [{d.min():.{digits}f}, {d.max():.{digits}f}], "
            f"largest off-diagonal: {pairs or 'none'}")

