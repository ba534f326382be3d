"""Synthetic noise models, real-annotator label files and the label-view CLI.

Statistical checks use fixed seeds and 4-5 standard-error bounds, so they are
deterministic and would catch a wrong rate or a transposed transition.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from pipeline.core import noise as nz
from pipeline.core.labels import LabelView
from pipeline.data.manifest import Manifest, ShardInfo, sample_key, sha256_file
from shards import labelview

N = 50_000

# CIFAR-100 fine labels in the standard (alphabetical) order and the official super-class
# table (https://www.cs.toronto.edu/~kriz/cifar.html), written by name: an independent
# check of the hard-coded index map.
CIFAR100_FINE = (
    "apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus "
    "butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach "
    "couch crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster "
    "house kangaroo keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree "
    "motorcycle mountain mouse mushroom oak_tree orange orchid otter palm_tree pear "
    "pickup_truck pine_tree plain plate poppy porcupine possum rabbit raccoon ray road "
    "rocket rose sea seal shark shrew skunk skyscraper snail snake spider squirrel "
    "streetcar sunflower sweet_pepper table tank telephone television tiger tractor train "
    "trout tulip turtle wardrobe whale willow_tree wolf woman worm"
).split()
CIFAR100_SUPER = {  # coarse labels in alphabetical order 0..19
    "aquatic_mammals": "beaver dolphin otter seal whale",
    "fish": "aquarium_fish flatfish ray shark trout",
    "flowers": "orchid poppy rose sunflower tulip",
    "food_containers": "bottle bowl can cup plate",
    "fruit_and_vegetables": "apple mushroom orange pear sweet_pepper",
    "household_electrical_devices": "clock keyboard lamp telephone television",
    "household_furniture": "bed chair couch table wardrobe",
    "insects": "bee beetle butterfly caterpillar cockroach",
    "large_carnivores": "bear leopard lion tiger wolf",
    "large_man-made_outdoor_things": "bridge castle house road skyscraper",
    "large_natural_outdoor_scenes": "cloud forest mountain plain sea",
    "large_omnivores_and_herbivores": "camel cattle chimpanzee elephant kangaroo",
    "medium_mammals": "fox porcupine possum raccoon skunk",
    "non-insect_invertebrates": "crab lobster snail spider worm",
    "people": "baby boy girl man woman",
    "reptiles": "crocodile dinosaur lizard snake turtle",
    "small_mammals": "hamster mouse rabbit shrew squirrel",
    "trees": "maple_tree oak_tree palm_tree pine_tree willow_tree",
    "vehicles_1": "bicycle bus motorcycle pickup_truck train",
    "vehicles_2": "lawn_mower rocket streetcar tank tractor",
}


@pytest.fixture
def clean10() -> np.ndarray:
    return np.random.default_rng(123).integers(0, 10, N)


@pytest.fixture
def clean100() -> np.ndarray:
    return np.random.default_rng(456).integers(0, 100, N)


def assert_rate(realised: float, p: float, n: int, *, sigmas: float = 4.0) -> None:
    se = math.sqrt(p * (1 - p) / n)
    assert abs(realised - p) <= sigmas * se + 1e-12, (realised, p, se)


def assert_transition_close(view: LabelView, *, sigmas: float = 5.0) -> None:
    """Every entry of the realised transition within ``sigmas`` binomial SEs (+1/n_k) of T."""
    t = view.transition
    real = view.realised_transition(k_latent=t.shape[0])
    n_k = np.bincount(view.clean[view.clean >= 0], minlength=t.shape[0])[: t.shape[0]]
    rows = n_k > 0
    tol = sigmas * np.sqrt(t * (1 - t) / np.maximum(n_k, 1)[:, None]) + 1.0 / np.maximum(
        n_k, 1)[:, None]
    err = np.abs(real - t)
    assert (err[rows] <= tol[rows]).all(), float((err - tol)[rows].max())
    # where T is 0 or 1 the process is deterministic: the realised entry must match exactly
    exact = rows[:, None] & ((t == 0) | (t == 1))
    assert (real[exact] == t[exact]).all()


def assert_rows_stochastic(t: np.ndarray) -> None:
    assert (t >= 0).all()
    np.testing.assert_allclose(t.sum(1), 1.0, atol=1e-12)


# -- symmetric -------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.2, 0.5, 0.8])
def test_symmetric_include_true_matches_dividemix_convention(clean10, rate):
    v = nz.symmetric(clean10, 10, rate, seed=0)
    t = (1 - rate) * np.eye(10) + rate / 10
    np.testing.assert_allclose(v.transition, t)
    assert_rows_stochastic(v.transition)
    assert_rate(v.noise_rate(), rate * 9 / 10, N)
    assert_transition_close(v)
    np.testing.assert_array_equal(v.clean, clean10)
    assert v.spec == {"kind": "symmetric", "rate": rate, "seed": 0, "include_true": True,
                      "exact": False}


@pytest.mark.parametrize("rate", [0.2, 0.6])
def test_symmetric_exclude_true_flips_to_other_classes(clean10, rate):
    v = nz.symmetric(clean10, 10, rate, include_true=False, seed=1)
    assert v.transition[0, 0] == pytest.approx(1 - rate)
    assert v.transition[0, 1] == pytest.approx(rate / 9)
    assert_rows_stochastic(v.transition)
    assert_rate(v.noise_rate(), rate, N)
    assert_transition_close(v)


def test_symmetric_k100_rate(clean100):
    v = nz.symmetric(clean100, 100, 0.5, seed=2)
    assert_rate(v.noise_rate(), 0.5 * 99 / 100, N)
    # each row's realised flip rate near 0.495 (500 samples per row, ~0.022 SE)
    real = v.realised_transition()
    assert np.abs((1 - np.diag(real)) - 0.495).max() < 5 * math.sqrt(0.25 / 400)


def test_symmetric_exact_resamples_a_fixed_count_per_class(clean10):
    v = nz.symmetric(clean10, 10, 0.5, include_true=False, seed=3, exact=True)
    n_k = np.bincount(clean10, minlength=10)
    flipped = np.bincount(clean10[v.observed != clean10], minlength=10)
    np.testing.assert_array_equal(flipped, np.rint(0.5 * n_k))


# -- pair flips ------------------------------------------------------------------------------


@pytest.mark.parametrize("swap", [False, True])
def test_asymmetric_cifar10(clean10, swap):
    rate = 0.4
    v = nz.asymmetric_cifar10(clean10, rate, swap_cat_dog=swap, seed=0)
    src_dst = {9: 1, 2: 0, 4: 7, 3: 5, **({5: 3} if swap else {})}
    t = np.eye(10)
    for s, d in src_dst.items():
        t[s, s], t[s, d] = 1 - rate, rate
    np.testing.assert_array_equal(v.transition, t)
    assert_transition_close(v)
    # only the mapped classes change, and only to their target
    changed = v.observed != clean10
    assert set(np.unique(clean10[changed])) == set(src_dst)
    for s, d in src_dst.items():
        assert (v.observed[changed & (clean10 == s)] == d).all()
    p = rate * len(src_dst) / 10  # classes are ~uniform
    n_mapped = np.isin(clean10, list(src_dst)).sum()
    assert_rate(changed[np.isin(clean10, list(src_dst))].mean(), rate, n_mapped)
    assert abs(v.noise_rate() - p) < 0.01
    assert v.spec["kind"] == "asymmetric" and v.spec["swap_cat_dog"] is swap


def test_pair_flip_exact_hits_the_rate_per_class(clean10):
    v = nz.pair_flip(clean10, 10, {0: 1, 1: 0}, 0.3, seed=0, exact=True)
    real = v.realised_transition()
    n_k = np.bincount(clean10, minlength=10)
    assert real[0, 1] == pytest.approx(np.rint(0.3 * n_k[0]) / n_k[0])
    assert real[1, 0] == pytest.approx(np.rint(0.3 * n_k[1]) / n_k[1])
    assert (v.observed[clean10 >= 2] == clean10[clean10 >= 2]).all()


@pytest.mark.parametrize("mapping, match", [
    ({3: 3}, "to itself"), ({0: 10}, "outside"), ({}, "non-empty"), ({"a": 1}, "not int"),
    ({0: 1.5}, "not int"), ({"1": 2, 1: 3}, "twice"),
])
def test_pair_flip_rejects_bad_mappings(clean10, mapping, match):
    with pytest.raises(ValueError, match=match):
        nz.pair_flip(clean10, 10, mapping, 0.3, seed=0)


def test_synthetic_noise_rejects_bad_inputs(clean10):
    with pytest.raises(ValueError, match="rate must be in"):
        nz.symmetric(clean10, 10, 1.2, seed=0)
    with pytest.raises(ValueError, match="outside"):
        nz.symmetric(np.array([0, 10]), 10, 0.2, seed=0)
    with pytest.raises(ValueError, match="integers"):
        nz.symmetric(np.array([0.0, 1.0]), 10, 0.2, seed=0)
    with pytest.raises(ValueError, match="seed"):
        nz.symmetric(clean10, 10, 0.2, seed=-1)


# -- CIFAR-100 super-classes -----------------------------------------------------------------


def test_cifar100_coarse_map_is_the_official_table():
    assert len(CIFAR100_FINE) == 100 and CIFAR100_FINE == sorted(CIFAR100_FINE)
    expected = np.full(100, -1)
    for g, (name, members) in enumerate(CIFAR100_SUPER.items()):
        for fine in members.split():
            expected[CIFAR100_FINE.index(fine)] = g
    np.testing.assert_array_equal(nz.CIFAR100_COARSE, expected)
    np.testing.assert_array_equal(np.bincount(nz.CIFAR100_COARSE), np.full(20, 5))


def test_cifar100_next_in_superclass_is_circular_by_fine_index():
    nxt = nz.cifar100_next_in_superclass()
    fine = CIFAR100_FINE.index
    # aquatic mammals, ascending fine index: beaver 4, dolphin 30, otter 55, seal 72, whale 95
    assert [nxt[fine(a)] for a in ("beaver", "dolphin", "otter", "seal", "whale")] == [
        fine("dolphin"), fine("otter"), fine("seal"), fine("whale"), fine("beaver")]
    assert sorted(nxt) == list(range(100)) and sorted(nxt.values()) == list(range(100))
    for a, b in nxt.items():
        assert a != b and nz.CIFAR100_COARSE[a] == nz.CIFAR100_COARSE[b]


def test_cifar100_superclass_noise(clean100):
    v = nz.cifar100_superclass(clean100, 0.4, seed=0, coarse=nz.CIFAR100_COARSE[clean100])
    assert_rate(v.noise_rate(), 0.4, N)
    assert_transition_close(v)
    changed = v.observed != clean100
    np.testing.assert_array_equal(nz.CIFAR100_COARSE[v.observed], nz.CIFAR100_COARSE[clean100])
    nxt = nz.cifar100_next_in_superclass()
    assert (v.observed[changed] == np.array([nxt[c] for c in clean100[changed]])).all()
    assert v.spec == {"kind": "cifar100_superclass", "rate": 0.4, "seed": 0, "exact": False}


def test_cifar100_superclass_checks_coarse_labels(clean100):
    coarse = nz.CIFAR100_COARSE[clean100].copy()
    coarse[7] = (coarse[7] + 1) % 20
    with pytest.raises(ValueError, match="idx 7: coarse label"):
        nz.cifar100_superclass(clean100, 0.4, seed=0, coarse=coarse)


# -- open set --------------------------------------------------------------------------------


def test_open_set_marks_a_fraction_as_outliers(clean10):
    v = nz.open_set(clean10, 10, 0.2, seed=0)
    assert v.ood.sum() == 10_000
    assert (v.clean[v.ood] == 10).all() and (v.clean[~v.ood] == clean10[~v.ood]).all()
    np.testing.assert_array_equal(v.observed, clean10)  # labels stay the original ones
    assert v.transition.shape == (11, 10)
    np.testing.assert_array_equal(v.transition[:10], np.eye(10))
    hist = np.bincount(clean10[v.ood], minlength=10) / 10_000
    np.testing.assert_allclose(v.transition[10], hist)
    assert_rows_stochastic(v.transition)
    np.testing.assert_allclose(v.realised_transition(), v.transition)
    assert v.noise_rate() == pytest.approx(0.2)
    assert v.spec["pixel_seed"] == 0


def test_open_set_on_top_of_closed_set_noise(clean10):
    spec = {"kind": "open_set", "count": 10_000, "seed": 5,
            "noise": {"kind": "asymmetric", "rate": 0.4, "seed": 1}}
    v = nz.make_view(spec, clean10, 10)
    base = nz.asymmetric_cifar10(clean10, 0.4, seed=1)
    np.testing.assert_array_equal(v.observed, base.observed)  # OOD keep their noisy label
    np.testing.assert_array_equal(v.transition[:10], base.transition)
    np.testing.assert_allclose(v.transition[10],
                               np.bincount(base.observed[v.ood], minlength=10) / 10_000)
    assert v.ood.sum() == 10_000
    assert_transition_close(v)


def test_open_set_zero_fraction_has_an_empty_outlier_row(clean10):
    v = nz.open_set(clean10, 10, 0.0, seed=0)
    assert not v.ood.any() and (v.transition[10] == 0).all()


def test_shuffle_pixels_is_a_deterministic_permutation():
    img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    before = img.copy()
    a = nz.shuffle_pixels(img, idx=7, seed=0)
    np.testing.assert_array_equal(img, before)
    assert a.shape == img.shape and a.dtype == np.uint8
    np.testing.assert_array_equal(a, nz.shuffle_pixels(img, idx=7, seed=0))
    assert not np.array_equal(a, img)
    assert not np.array_equal(a, nz.shuffle_pixels(img, idx=8, seed=0))
    assert not np.array_equal(a, nz.shuffle_pixels(img, idx=7, seed=1))
    # the same pixels (RGB triples kept together), only moved
    px = lambda x: np.sort(x.reshape(-1, 3).view([("", np.uint8)] * 3), axis=0)  # noqa: E731
    np.testing.assert_array_equal(px(a), px(img))
    with pytest.raises(ValueError, match="image must be"):
        nz.shuffle_pixels(np.zeros(5, np.uint8), idx=0, seed=0)


# -- key,label files -------------------------------------------------------------------------


@pytest.fixture
def keys() -> list[str]:
    # Clothing1M-style keys hold a comma
    return [f"images/{i % 10}/{i:02d}/{1000 + i},{7 * i}.jpg" for i in range(200)]


def test_from_csv_round_trip(tmp_path, keys):
    labels = np.random.default_rng(0).integers(0, 14, len(keys))
    path = nz.write_csv(tmp_path / "labels.csv", keys, labels)
    clean = np.where(np.arange(len(keys)) % 3 == 0, labels, -1)
    v = nz.from_csv(path, keys, 14, clean=clean)
    np.testing.assert_array_equal(v.observed, labels)
    np.testing.assert_array_equal(v.clean, clean)
    assert v.noise_rate() == 0.0 and v.transition is None
    assert v.spec["sha256"] == sha256_file(path) and v.spec["listed"] == len(keys)
    # headerless, unquoted keys with commas, shuffled order and blank lines also read
    order = np.random.default_rng(1).permutation(len(keys))
    (tmp_path / "raw.csv").write_text(
        "\n".join(f"{keys[i]},{labels[i]}" for i in order) + "\n\n")
    v2 = nz.from_csv(tmp_path / "raw.csv", keys, 14)
    np.testing.assert_array_equal(v2.observed, labels)


@pytest.mark.parametrize("body, line, match", [
    ("key,label\nk0,1\nk1\n", 3, "malformed line"),
    ("k0,1\nk1,x\n", 2, "not an integer"),
    ("key,label\nk0,1\n\nk1,14\n", 4, "outside"),
    ("k0,1\nk1,-1\n", 2, "outside"),
    ("k0,1\nk1,2\nnope,3\n", 3, "not a sample of this split"),
    ("key,label\nk0,1\nk1,2\nk0,3\n", 4, r"listed twice \(first on line 2\)"),
    ('k0,1\n"k1,2\n', 2, "a quote opened on line 2 is never closed"),
])
def test_from_csv_errors_name_file_and_line(tmp_path, body, line, match):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(ValueError, match=match) as e:
        nz.from_csv(path, ["k0", "k1", "k2"], 14, missing="keep", default=[0, 0, 0])
    assert f"{path}:{line}:" in str(e.value)


def test_from_csv_reads_one_column_of_several_label_sets(tmp_path):
    """``column``: a file holding several annotators' labels (CIFAR-10N's key,aggre,random1)
    reads the named column, joined on the key; the spec records it and make_view rebuilds
    the same view from the spec."""
    path = tmp_path / "human.csv"
    path.write_text("key,aggre,random1\nk2,3,4\nk0,1,1\nk1,2,9\n")
    v = nz.from_csv(path, ["k0", "k1", "k2"], 10, clean=[1, 2, 3], column="random1")
    np.testing.assert_array_equal(v.observed, [1, 9, 4])
    assert v.spec["column"] == "random1" and v.noise_rate() == pytest.approx(2 / 3)
    again = nz.make_view(v.spec, [1, 2, 3], 10, keys=["k0", "k1", "k2"])
    np.testing.assert_array_equal(again.observed, v.observed)
    np.testing.assert_array_equal(nz.from_csv(path, ["k0", "k1", "k2"], 10,
                                              column="aggre").observed, [1, 2, 3])
    with pytest.raises(ValueError, match=rf"{path}:1: header .*no 'key' and 'worse'"):
        nz.from_csv(path, ["k0", "k1", "k2"], 10, column="worse")
    path.write_text("key,aggre,random1\nk0,1,1\nk1,2\n")
    with pytest.raises(ValueError, match=rf"{path}:3: 2 fields, the header has 3"):
        nz.from_csv(path, ["k0", "k1"], 10, column="aggre")


def test_from_csv_missing_samples(tmp_path):
    path = tmp_path / "part.csv"
    path.write_text("k0,5\nk2,6\n")
    with pytest.raises(ValueError, match=r"1 of 3 samples are not listed .*idx 1, key 'k1'"):
        nz.from_csv(path, ["k0", "k1", "k2"], 10)
    with pytest.raises(ValueError, match="needs default"):
        nz.from_csv(path, ["k0", "k1", "k2"], 10, missing="keep")
    v = nz.from_csv(path, ["k0", "k1", "k2"], 10, missing="keep", default=[1, 2, 3])
    np.testing.assert_array_equal(v.observed, [5, 2, 6])
    assert v.spec["listed"] == 2
    with pytest.raises(ValueError, match="appears at idx 0 and idx 2"):
        nz.from_csv(path, ["k0", "k1", "k0"], 10)
    with pytest.raises(ValueError, match="sha256"):
        nz.from_csv(path, ["k0", "k1", "k2"], 10, missing="keep", default=[1, 2, 3],
                    expect_sha256="0" * 64)


# -- trusted subset --------------------------------------------------------------------------


def test_trusted_subset_per_class_is_proportional(clean10):
    v = nz.trusted_subset(nz.open_set(clean10, 10, count=10_000, seed=0), count=5_500, seed=0)
    assert v.trusted.sum() == 5_500
    n_k = np.bincount(v.clean, minlength=11)
    got = np.bincount(v.clean[v.trusted], minlength=11)
    assert (np.abs(got - 5_500 * n_k / N) < 1).all()  # largest remainder rounding
    assert got[10] == 1_100  # the outlier class is its own stratum
    no_ood = nz.trusted_subset(v, 0.1, seed=0, include_ood=False)
    assert not (no_ood.trusted & no_ood.ood).any() and no_ood.trusted.sum() == 4_000
    assert no_ood.spec["trusted"]["fraction"] == 0.1


def test_trusted_subset_only_among_known_clean(tmp_path):
    clean = np.array([-1, 0, 1, -1, 2, 0, 1, 2, -1, 0])
    v = LabelView(observed=np.zeros(10, np.int64), clean=clean, num_classes=3)
    t = nz.trusted_subset(v, count=7, seed=0, per_class=False)
    assert t.trusted.sum() == 7 and (t.clean[t.trusted] >= 0).all()
    with pytest.raises(ValueError, match="exceeds the 7 samples"):
        nz.trusted_subset(v, count=8, seed=0)
    with pytest.raises(ValueError, match="exactly one of"):
        nz.trusted_subset(v, 0.5, count=3, seed=0)


def test_trusted_clean_samples_and_labelled_outliers_as_in_the_paper(clean10):
    """The paper's semi-supervised open-set setting: 5,000 clean samples and 500 labelled
    outliers, counted separately (a plain count would split by stratum instead)."""
    spec = {"kind": "open_set", "count": 10_000, "seed": 0,
            "trusted": {"count": 5_000, "outliers": 500, "seed": 0}}
    v = nz.make_view(spec, clean10, 10)
    assert int((v.trusted & ~v.ood).sum()) == 5_000 and int((v.trusted & v.ood).sum()) == 500
    assert (v.clean[v.trusted & v.ood] == 10).all()
    got = np.bincount(v.clean[v.trusted & ~v.ood], minlength=10)
    n_k = np.bincount(v.clean[~v.ood], minlength=10)
    assert (np.abs(got - 5_000 * n_k / n_k.sum()) < 1).all()  # stratified by class
    again = nz.make_view(json.loads(json.dumps(v.spec)), clean10, 10)
    assert np.array_equal(again.trusted, v.trusted) and again.spec == v.spec
    with pytest.raises(ValueError, match="trusted outliers 10001 exceeds the 10000"):
        nz.make_view({**spec, "trusted": {"count": 0, "outliers": 10_001, "seed": 0}},
                     clean10, 10)


def test_trusted_by_key_list(tmp_path):
    """Clothing1M's LCCN+: the samples whose key is in the clean-train list are trusted;
    listed keys outside the split are ignored, a listed sample without a clean label is an
    error naming it."""
    keys = [f"images/0/{i:02d}/x{i}.jpg" for i in range(8)]
    clean = np.array([3, -1, 0, 1, -1, 2, 2, -1])
    v = LabelView(observed=np.array([3, 1, 1, 1, 0, 2, 0, 2]), clean=clean, num_classes=4)
    listed = tmp_path / "clean_train_key_list.txt"
    listed.write_text("\n".join([keys[0], keys[3], keys[6], "images/9/99/elsewhere.jpg"]))
    t = nz.make_view({"kind": "dataset", "trusted": {"keys": str(listed)}}, clean, 4,
                     keys=keys, observed=v.observed)
    assert np.flatnonzero(t.trusted).tolist() == [0, 3, 6]
    assert t.spec["trusted"] == {"keys": str(listed)}
    listed.write_text(keys[1])  # no clean label
    with pytest.raises(ValueError, match=r"idx 1, key 'images/0/01/x1.jpg'"):
        nz.trusted_by_keys(v, keys, listed)
    with pytest.raises(ValueError, match="needs keys="):
        nz.make_view({"kind": "clean", "trusted": {"keys": str(listed)}}, np.zeros(8, int), 4)


# -- seeds, specs, make_view -----------------------------------------------------------------


SPECS = [
    {"kind": "symmetric", "rate": 0.5, "seed": 0},
    {"kind": "symmetric", "rate": 0.5, "seed": 0, "include_true": False, "exact": True},
    {"kind": "asymmetric", "rate": 0.4, "seed": 0, "swap_cat_dog": True},
    {"kind": "pair_flip", "mapping": {"0": 1, "1": 2}, "rate": 0.4, "seed": 0},
    {"kind": "open_set", "fraction": 0.2, "seed": 0,
     "noise": {"kind": "symmetric", "rate": 0.3, "seed": 2}},
    {"kind": "asymmetric", "rate": 0.4, "seed": 0,
     "trusted": {"fraction": 0.1, "seed": 0, "per_class": True}},
]


def _same(a: LabelView, b: LabelView) -> bool:
    return (np.array_equal(a.observed, b.observed) and np.array_equal(a.clean, b.clean)
            and np.array_equal(a.trusted, b.trusted) and np.array_equal(a.ood, b.ood))


@pytest.mark.parametrize("spec", SPECS)
def test_seeds_reproduce_and_specs_round_trip(tmp_path, clean10, spec):
    v = nz.make_view(spec, clean10, 10)
    assert _same(v, nz.make_view(spec, clean10, 10))
    other = json.loads(json.dumps(spec))
    (other.get("noise") or other)["seed"] = 99
    if "trusted" in other:
        other["trusted"]["seed"] = 99
    w = nz.make_view(other, clean10, 10)
    assert not np.array_equal(v.observed, w.observed)
    if "trusted" in spec:
        assert not np.array_equal(v.trusted, w.trusted)
    # the recorded spec is plain JSON and rebuilds the same view
    again = nz.make_view(json.loads(json.dumps(v.spec)), clean10, 10)
    assert _same(v, again) and again.spec == v.spec
    loaded = LabelView.load(v.save(tmp_path / "v.npz"))
    assert _same(v, loaded) and loaded.spec == v.spec
    np.testing.assert_array_equal(loaded.transition, v.transition)


def test_a_saved_view_is_readable_by_others_and_a_truncated_one_is_named(clean10, tmp_path):
    """The .npz takes the umask's mode (not mkstemp's 0600: a cluster's other nodes and users
    read it); a cut file is refused with its path, not a zipfile traceback."""
    import os
    import stat

    path = nz.make_view({"kind": "symmetric", "rate": 0.2, "seed": 0}, clean10, 10) \
        .save(tmp_path / "v.npz")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    cut = tmp_path / "cut.npz"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{cut}: not a readable label view"):
        LabelView.load(cut)


def test_make_view_clean_and_dataset(clean10):
    v = nz.make_view({"kind": "clean"}, clean10, 10)
    assert v.noise_rate() == 0 and (v.transition == np.eye(10)).all()
    obs = (clean10 + 1) % 10
    web_clean = np.where(np.arange(N) % 2 == 0, clean10, -1)
    d = nz.make_view({"kind": "dataset"}, web_clean, 10, observed=obs)
    np.testing.assert_array_equal(d.observed, obs)
    assert d.noise_rate() == 1.0 and d.transition is None


@pytest.mark.parametrize("spec, match", [
    ({"kind": "gaussian", "rate": 0.1}, "'gaussian' is not one of"),
    ({"rate": 0.1}, "kind None is not one of"),
    ({"kind": "symmetric", "rate": 1.5, "seed": 0}, r"rate must be in \[0, 1\], got 1.5"),
    ({"kind": "symmetric", "rate": -0.1, "seed": 0}, "got -0.1"),
    ({"kind": "symmetric", "rate": "0.4", "seed": 0}, "must be a number"),
    ({"kind": "symmetric", "rate": float("nan"), "seed": 0}, "got nan"),
    ({"kind": "symmetric", "rate": 0.4}, r"missing key\(s\) \['seed'\]"),
    ({"kind": "symmetric", "rat": 0.4, "seed": 0}, r"unknown key\(s\) \['rat'\]"),
    ({"kind": "symmetric", "rate": 0.4, "seed": 1.0}, "seed must be a non-negative int"),
    ({"kind": "symmetric", "rate": 0.4, "seed": 0, "include_true": "yes"}, "true or false"),
    ({"kind": "asymmetric", "rate": 0.4, "seed": 0, "swap": True}, r"unknown key\(s\) \['swap'\]"),
    ({"kind": "cifar100_superclass", "rate": 0.4, "seed": 0}, "needs num_classes=100"),
    ({"kind": "open_set", "seed": 0}, "exactly one of 'fraction' or 'count'"),
    ({"kind": "open_set", "seed": 0, "fraction": 0.1, "count": 5}, "exactly one of"),
    ({"kind": "open_set", "seed": 0, "count": N + 1}, "count must be an int"),
    ({"kind": "open_set", "seed": 0, "fraction": 0.1, "noise": {"kind": "open_set"}},
     "'noise' must be a closed-set spec"),
    ({"kind": "csv", "path": "x.csv"}, "needs keys="),
    ({"kind": "dataset"}, "needs observed="),
    ({"kind": "clean", "trusted": {"fraction": 2.0, "seed": 0}}, "trusted fraction must be in"),
    ({"kind": "clean", "trusted": {"fraction": 0.1}}, r"'trusted': missing key\(s\) \['seed'\]"),
    ({"kind": "clean", "trusted": 0.1}, "'trusted' must be a dict"),
])
def test_make_view_validation(clean10, spec, match):
    with pytest.raises(ValueError, match=match):
        nz.make_view(spec, clean10, 10)


def test_make_view_rejects_non_dict_and_unknown_clean(clean10):
    with pytest.raises(ValueError, match="spec must be a dict"):
        nz.make_view("symmetric", clean10, 10)
    with pytest.raises(ValueError, match="clean label -1 at idx 0"):
        nz.make_view({"kind": "symmetric", "rate": 0.1, "seed": 0}, np.array([-1, 2]), 10)


def test_make_view_csv(tmp_path, keys):
    labels = np.arange(len(keys)) % 14
    path = nz.write_csv(tmp_path / "l.csv", keys, labels)
    v = nz.make_view({"kind": "csv", "path": str(path)}, np.full(len(keys), -1), 14, keys=keys)
    np.testing.assert_array_equal(v.observed, labels)
    again = nz.make_view(v.spec, np.full(len(keys), -1), 14, keys=keys)
    np.testing.assert_array_equal(again.observed, labels)
    text = path.read_text()
    assert f'"{keys[0]}",0\n' in text  # keys with commas are quoted
    path.write_text(text.replace(f'"{keys[0]}",0\n', f'"{keys[0]}",1\n'))
    with pytest.raises(ValueError, match="sha256"):
        nz.make_view(v.spec, np.full(len(keys), -1), 14, keys=keys)


# -- the CLI on a tiny split -----------------------------------------------------------------


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def make_split(root, *, dataset: str, labels, clean, per_shard: int, extra=None,
               skip_idx: int | None = None, classes=None):
    """Write ``root/<shards>`` + manifest.json; ``extra(idx)`` adds json fields."""
    root.mkdir(parents=True, exist_ok=True)
    n = len(labels)
    shards = []
    for s, start in enumerate(range(0, n, per_shard)):
        name = f"train-{s:06d}.tar"
        count = 0
        with wds.TarWriter(str(root / name)) as w:
            for i in range(start, min(start + per_shard, n)):
                if i == skip_idx:
                    continue
                meta = {"idx": i, "label": int(labels[i]), "clean": int(clean[i]),
                        "key": f"img/{i},{i * 3}.jpg", **(extra(i) if extra else {})}
                w.write({"__key__": sample_key(i), "png": _png(i % 256), "json": meta})
                count += 1
        shards.append(ShardInfo(name=name, num_samples=count, sha256=sha256_file(root / name),
                                bytes=(root / name).stat().st_size))
    Manifest(dataset=dataset, split="train",
             classes=list(classes or [f"c{k}" for k in range(10)]), shards=shards).save(root)
    return root


@pytest.fixture
def cifar_split(tmp_path):
    labels = np.random.default_rng(0).integers(0, 10, 60)
    return make_split(tmp_path / "cifar10" / "train", dataset="cifar10", labels=labels,
                      clean=labels, per_shard=32, classes=labelview.CIFAR10_CLASSES), labels


def test_asymmetric_maps_cifar10_classes_by_name(tmp_path, capsys):
    """A split whose CIFAR-10 classes are in another order gets the flips of the names
    (truck->automobile, ...), not of the standard indices; other names are refused."""
    names = list(reversed(labelview.CIFAR10_CLASSES))  # truck=0, ..., airplane=9
    labels = np.repeat(np.arange(10), 40)
    split = make_split(tmp_path / "rev" / "train", dataset="cifar10", labels=labels,
                       clean=labels, per_shard=100, classes=names)
    view = labelview.build_view(split, {"kind": "asymmetric", "rate": 0.4, "seed": 0})
    t = view.transition
    ix = {n: names.index(n) for n in names}
    for src, dst in labelview.CIFAR10_ASYM_BY_NAME.items():
        assert t[ix[src], ix[dst]] == pytest.approx(0.4), (src, dst)
        flipped = view.observed[view.clean == ix[src]]
        assert set(np.unique(flipped)) == {ix[src], ix[dst]}
    for unflipped in ("airplane", "automobile", "dog", "frog", "horse", "ship"):
        assert t[ix[unflipped], ix[unflipped]] == 1.0
        assert (view.observed[view.clean == ix[unflipped]] == ix[unflipped]).all()
    # the same view is rebuilt from its spec on the same split
    assert labelview.build_view(split, view.spec).observed.tolist() == view.observed.tolist()
    # classes that are not the CIFAR-10 names: refused, naming them (exit code 2 on the CLI)
    other = make_split(tmp_path / "other" / "train", dataset="cifar10", labels=labels,
                       clean=labels, per_shard=100)
    with pytest.raises(ValueError, match=r"CIFAR-10 map by class name.*'c0'"):
        labelview.build_view(other, {"kind": "asymmetric", "rate": 0.4, "seed": 0})
    assert labelview.main(["--split-dir", str(other), "--spec",
                           '{"kind": "asymmetric", "rate": 0.4, "seed": 0}',
                           "--out", str(tmp_path / "v.npz")]) == 2
    assert "CIFAR-10 map by class name" in capsys.readouterr().err


def test_read_split_labels(cifar_split):
    split, labels = cifar_split
    lab = labelview.read_split_labels(split, checksums=True)
    np.testing.assert_array_equal(lab["idx"], np.arange(60))
    np.testing.assert_array_equal(lab["label"], labels)
    assert lab["key"][5] == "img/5,15.jpg" and "coarse" not in lab


def test_cli_writes_a_view_that_loads(cifar_split, tmp_path, capsys):
    split, labels = cifar_split
    out = tmp_path / "views" / "asym.npz"
    spec = {"kind": "asymmetric", "rate": 0.4, "seed": 0}
    assert labelview.main(["--split-dir", str(split), "--spec", json.dumps(spec),
                           "--trusted", '{"count": 6, "seed": 1}', "--out", str(out)]) == 0
    v = LabelView.load(out)
    expected = nz.trusted_subset(nz.asymmetric_cifar10(labels, 0.4, seed=0), count=6, seed=1)
    assert _same(v, expected) and v.spec == expected.spec
    np.testing.assert_array_equal(v.clean, labels)
    printed = capsys.readouterr().out
    assert f"realised {expected.noise_rate():.4f}" in printed and "true T[k, j]" in printed


def test_cli_csv_and_idx_keys(cifar_split, tmp_path):
    split, labels = cifar_split
    noisy = (labels + 1) % 10
    csv_path = nz.write_csv(tmp_path / "l.csv", [f"img/{i},{i * 3}.jpg" for i in range(60)],
                            noisy)
    out = tmp_path / "csv.npz"
    assert labelview.main(["--split-dir", str(split), "--csv", str(csv_path),
                           "--out", str(out)]) == 0
    v = LabelView.load(out)
    np.testing.assert_array_equal(v.observed, noisy)
    assert v.noise_rate() == 1.0
    idx_csv = nz.write_csv(tmp_path / "i.csv", [sample_key(i) for i in range(30)], noisy[:30])
    assert labelview.main(["--split-dir", str(split), "--csv", str(idx_csv), "--csv-key", "idx",
                           "--missing", "keep", "--out", str(out)]) == 0
    v = LabelView.load(out)
    np.testing.assert_array_equal(v.observed, np.r_[noisy[:30], labels[30:]])


def test_cli_web_dataset_uses_label_and_clean(tmp_path, capsys):
    labels = np.arange(40) % 10
    clean = np.where(np.arange(40) < 10, (labels + 1) % 10, -1)
    split = make_split(tmp_path / "web", dataset="clothing1m", labels=labels, clean=clean,
                       per_shard=25)
    out = tmp_path / "web.npz"
    assert labelview.main(["--split-dir", str(split), "--out", str(out)]) == 0
    v = LabelView.load(out)
    np.testing.assert_array_equal(v.observed, labels)
    np.testing.assert_array_equal(v.clean, clean)
    assert v.noise_rate() == 1.0 and v.spec == {"kind": "dataset"}
    spec = '{"kind": "symmetric", "rate": 0.2, "seed": 0}'
    assert labelview.main(["--split-dir", str(split), "--spec", spec, "--out", str(out)]) == 2
    assert "needs clean labels" in capsys.readouterr().err
    # forcing labels-are-clean on it is refused since its clean field disagrees
    assert labelview.main(["--split-dir", str(split), "--labels-are-clean", "--spec", spec,
                           "--out", str(out)]) == 2
    assert "idx 0 has label 0 but clean 1" in capsys.readouterr().err


def test_read_split_labels_checks_counts_and_density(tmp_path):
    labels = np.arange(20) % 10
    split = make_split(tmp_path / "gap", dataset="cifar10", labels=labels, clean=labels,
                       per_shard=10, skip_idx=3)
    # the manifest records what was written, so idx 3 is absent and N is 19: not dense
    with pytest.raises(ValueError, match="idx 19 is outside"):
        labelview.read_split_labels(split)
    split = make_split(tmp_path / "count", dataset="cifar10", labels=labels, clean=labels,
                       per_shard=10)
    man = Manifest.load(split)
    bad = Manifest(dataset=man.dataset, split=man.split, classes=man.classes,
                   shards=[man.shards[0], ShardInfo(**{**man.shards[1].__dict__,
                                                       "num_samples": 11})])
    bad.save(split)
    with pytest.raises(ValueError, match="train-000001.tar: 10 samples, manifest says 11"):
        labelview.read_split_labels(split)


def test_read_split_labels_coarse_and_cifar100_cli(tmp_path):
    fine = np.random.default_rng(0).integers(0, 100, 30)
    split = make_split(tmp_path / "c100", dataset="cifar100", labels=fine, clean=fine,
                       per_shard=16, extra=lambda i: {"coarse": int(nz.CIFAR100_COARSE[fine[i]])})
    man = Manifest.load(split)
    Manifest(dataset="cifar100", split="train", classes=[f"f{k}" for k in range(100)],
             shards=man.shards).save(split)
    lab = labelview.read_split_labels(split)
    np.testing.assert_array_equal(lab["coarse"], nz.CIFAR100_COARSE[fine])
    out = tmp_path / "c100.npz"
    spec = '{"kind": "cifar100_superclass", "rate": 0.5, "seed": 0}'
    assert labelview.main(["--split-dir", str(split), "--spec", spec, "--out", str(out)]) == 0
    v = LabelView.load(out)
    np.testing.assert_array_equal(nz.CIFAR100_COARSE[v.observed], nz.CIFAR100_COARSE[fine])


def test_transition_tables_name_their_rows():
    """A noise process is read clean -> observed, a learned phi latent -> observed; the
    columns line up under either header."""
    from pipeline.core.noise import format_transition

    t = np.array([[0.9, 0.1], [0.2, 0.8]])
    for rows in ("clean", "latent"):
        lines = format_transition(t, rows=rows).splitlines()
        assert lines[0].split()[0] == f"{rows}\\obs"
        assert lines[1].split() == ["0", "0.90", "0.10"]
        assert len({len(line) for line in lines}) == 1
