"""The training recipes of the jobs, as data: each is a point of the RunConfig (keys are the
field paths of :data:`pipeline.core.options.FLAGS`, ``"optim.lr"``), applied with
:func:`pipeline.core.options.apply_point`, the setter a command-line option goes through;
a field a recipe does not name keeps the library's default. So an option has one schema
(its config field) and one default (the field's, or a recipe's value of it).

A dataset's recipe (the paper's Sec. 4.1.3, shared by every method that follows the
paper's schedule) is in :data:`RECIPES`; a method's own on a dataset (DivideMix's, which
DivideMix and DivideLCCN follow) in :data:`METHOD_RECIPES`. The table in docs/methods.md
("Presets") is :func:`presets_table`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pipeline.core.config import RunConfig
from pipeline.core.options import apply_point, value_at
from pipeline.train.methods import get_method, registered


@dataclass(frozen=True)
class Recipe:
    """A named set of config values.

    point: RunConfig field path -> value (``"method"`` is the job's default method).
    transform: the shard/transform preset of its images (:mod:`pipeline.data.transforms`).
    lr_values: learning rate per phase between ``optim.milestones`` (empty: ``optim.lr``
        decayed by ``optim.lr_decay`` at each milestone): the jobs' ``--lr-values``.
    pretrained: ImageNet weights for the backbone: the jobs' ``--pretrained``.
    scratch_pretrain_share: with ``pretrained`` and a backbone trained from scratch
        (``--no-pretrained``), this share of the epochs are the cross-entropy warm-up instead
        of ``optim.pretrain_epochs`` (unless ``--pretrain-epochs`` is given): a network from
        scratch is still learning fast after the few epochs an ImageNet one needs.
    note: what a user should know of it; source: where the numbers come from.
    """

    name: str
    point: Mapping[str, Any]
    transform: str
    lr_values: tuple[float, ...] = ()
    pretrained: bool = False
    scratch_pretrain_share: float | None = None
    note: str = ""
    source: str = ""

    def run(self) -> RunConfig:
        """The library's RunConfig with the recipe's values (its checks applied)."""
        return apply_point(RunConfig(), self.point)

    def get(self, path: str) -> Any:
        """The recipe's value of the field ``path`` (the library default where it names
        none)."""
        return value_at(self.run(), path)

    @property
    def method(self) -> str:
        return self.get("method")


# normalisation layers and biases out of the L2 penalty, as the paper's released code (its
# CIFAR recipe) and most CIFAR/ImageNet recipes (OptimConfig.norm_weight_decay)
_NORM_WD = {"optim.norm_weight_decay": 0.0}

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    # PreAct ResNet-32, SGD 0.9, wd 5e-4, batch 128, 120 epochs, lr 0.5 / 0.1 / 0.01 split at
    # epochs 40 and 80; warm-up 20,000 steps with Eq. 8 (CIFAR-10) or the identity
    # (CIFAR-100); alpha 1. Our choices: the first lr phase (40 epochs) is the CE pre-training;
    # the warm-up transition is the anchor-point estimate, not Eq. 8 (--warmup eq8 for the
    # paper's), and the classifier trains on the posterior (--targets sample for the
    # paper's): the library defaults, which do not collapse from a weak start (docs/fidelity.md)
    *(Recipe(name, transform="cifar", point={
        "model.name": "preact_resnet32", "optim.batch_size": 128, "optim.lr": 0.5,
        "optim.epochs": 120, "optim.pretrain_epochs": 40, "optim.weight_decay": 5e-4,
        "optim.milestones": (40, 80), **_NORM_WD, "lccn.warmup_steps": 20_000,
        "lccn.warmup": warmup}, lr_values=(0.5, 0.1, 0.01),
        note="the first 40 epochs (lr 0.5) are the CE pre-training",
        source="LCCN paper Sec. 4.1.3 (CIFAR); Tables 2-4, OTS")
      for name, warmup in (("cifar10", "anchor"), ("cifar100", "identity"))),
    # ResNet-50 (ImageNet weights), batch 32, lr 0.001 fixed, 5 epochs, wd 1e-3, warm-up
    # 40,000 steps, power annealing on. Our choices: 1 of the 5 epochs is CE pre-training;
    # anchor warm-up and posterior targets as above.
    Recipe("clothing1m", transform="clothing1m", pretrained=True, point={
        "model.name": "resnet50", "optim.batch_size": 32, "optim.lr": 0.001, "optim.epochs": 5,
        "optim.pretrain_epochs": 1, "optim.weight_decay": 1e-3, **_NORM_WD,
        "lccn.warmup_steps": 40_000, "lccn.warmup": "anchor", "lccn.anneal": True},
        note="1 of the 5 epochs is CE pre-training",
        source="LCCN paper Sec. 4.1.3 (Clothing1M); Table 5, OTS"),
    # Inception-ResNet-v2, batch 64, lr 0.01 divided by 10 after 40 epochs, annealing on.
    # The paper gives neither the epoch count nor wd nor warm-up: ours are 80, 5e-4, 40,000.
    # The method is DivideLCCN with DivideMix's WebVision settings (MixMatch alpha 0.5,
    # lambda_u 0; docs/methods.md).
    Recipe("webvision", transform="webvision", point={
        "method": "divide_lccn", "model.name": "inception_resnet_v2", "optim.batch_size": 64,
        "optim.lr": 0.01, "optim.epochs": 80, "optim.pretrain_epochs": 10,
        "optim.weight_decay": 5e-4, "optim.milestones": (40,), **_NORM_WD,
        "lccn.warmup_steps": 40_000, "lccn.warmup": "anchor", "lccn.anneal": True,
        "divide.mixmatch_alpha": 0.5, "divide.lambda_u": 0.0},
        note="80 epochs (10 CE), wd 5e-4 and 40,000 warm-up steps are our choices",
        source="LCCN paper Sec. 4.1.3 (WebVision) and Table 7; MixMatch alpha, lambda_u: "
               "DivideMix's WebVision settings"),
    # one's own images (jobs/train.py): an ImageNet backbone fine-tuned from its weights at
    # the usual fine-tuning rate; the job sets the chain's warm-up from the data (half an
    # epoch's steps per worker) and the transform from --image-size
    Recipe("images", transform="imagenet224", pretrained=True, point={
        "model.name": "resnet50", "optim.batch_size": 64, "optim.lr": 0.01, "optim.epochs": 30,
        "optim.pretrain_epochs": 3, "optim.weight_decay": 5e-4, "optim.milestones": (20,),
        **_NORM_WD, "lccn.warmup_steps": 0, "lccn.warmup": "anchor"},
        scratch_pretrain_share=1 / 3,
        note="the job sets the warm-up to half an epoch's steps unless --warmup-steps is "
             "given; with --no-pretrained a third of the epochs are CE",
        source="ours (jobs/train.py, one's own images)"),
    # the quickstart: scikit-learn digits, small CNN on the CPU
    # targets "sample": on 1,257 digits a small CNN memorises the noisy labels, and the
    # sampled z (which relabels) beats the posterior target (which follows the labels once
    # memorised): +8.2 vs +2.4 points over CE on three seeds; no ramp: 8 CE epochs make a
    # strong start here, and the ramp costs most of the gain (docs/fidelity.md)
    Recipe("digits", transform="digits", point={
        "model.name": "small_cnn", "model.in_channels": 1, "optim.batch_size": 32,
        "optim.lr": 0.1, "optim.epochs": 30, "optim.pretrain_epochs": 8,
        "optim.weight_decay": 5e-4, "optim.milestones": (20,), "lccn.warmup_steps": 0,
        "lccn.warmup": "anchor", "lccn.targets": "sample", "lccn.ramp_epochs": 0.0},
        source="ours (the CPU quickstart; docs/fidelity.md)"),
)}


def _dividemix(dataset: str, *, note: str, source: str, **point: Any) -> Recipe:
    """DivideMix's own schedule on ``dataset`` (its authors' code), which DivideMix and,
    per the LCCN paper's tables, DivideLCCN follow; the LCCN sampler settings stay the
    dataset's. DivideMix's code decays every parameter (one SGD weight decay) and runs no
    per-phase rates."""
    base = RECIPES[dataset]
    return replace(base, point={**base.point, "optim.norm_weight_decay": None, **point},
                   lr_values=(), note=note, source=source)


_DM_CIFAR = "DivideMix (Li et al. 2020) Sec. 4.1 and its code (Train_cifar.py); LCCN " \
            "paper Table 2: DivideLCCN follows DivideMix's schedule"
_DM_CLOTHING = "DivideMix Sec. 4.1 and its code (Train_clothing1M.py); LCCN paper " \
               "Table 5 (DivideLCCN on its schedule)"

# (dataset, method) -> the method's own recipe where it differs from the dataset's (every
# other method follows the dataset's: the LCCN paper's "OTS", Tables 1-4)
METHOD_RECIPES: dict[tuple[str, str], Recipe] = {}
for _m in ("dividemix", "divide_lccn"):
    METHOD_RECIPES[("cifar10", _m)] = _dividemix(
        "cifar10", **{"method": _m, "model.name": "preact_resnet18", "optim.batch_size": 64,
                      "optim.lr": 0.02, "optim.epochs": 300, "optim.pretrain_epochs": 10,
                      "optim.milestones": (150,)},
        note="lambda_u 25 is DivideMix's for 50% symmetric noise (0/25/50/150 by level); "
             "add --conf-penalty under asymmetric noise", source=_DM_CIFAR)
    METHOD_RECIPES[("cifar100", _m)] = _dividemix(
        "cifar100", **{"method": _m, "model.name": "preact_resnet18", "optim.batch_size": 64,
                       "optim.lr": 0.02, "optim.epochs": 300, "optim.pretrain_epochs": 30,
                       "optim.milestones": (150,), "divide.lambda_u": 150.0},
        note="lambda_u 150 is DivideMix's for 50% symmetric noise (25/150 by level)",
        source=_DM_CIFAR)
    METHOD_RECIPES[("clothing1m", _m)] = _dividemix(
        "clothing1m", **{"method": _m, "optim.batch_size": 32, "optim.lr": 0.002,
                         "optim.epochs": 80, "optim.pretrain_epochs": 1,
                         "optim.milestones": (40,), "divide.mixmatch_alpha": 0.5,
                         "divide.lambda_u": 0.0, "divide.conf_penalty": True},
        note="an epoch is the whole split here, not DivideMix's 1,000 sampled batches",
        source=_DM_CLOTHING)
METHOD_RECIPES[("webvision", "dividemix")] = _dividemix(
    "webvision", **{"method": "dividemix", "optim.batch_size": 32, "optim.pretrain_epochs": 1},
    note="", source="DivideMix Sec. 4.1 and its code (Train_webvision.py)")


def recipe(dataset: str, method: str) -> Recipe:
    """The recipe ``method`` runs on ``dataset`` with: its own where it has one
    (:data:`METHOD_RECIPES`), else the dataset's (:data:`RECIPES`)."""
    return METHOD_RECIPES.get((dataset, method), RECIPES[dataset])


PRESET_COLUMNS = ("dataset", "methods", "model", "epochs (CE / warm-up)", "batch", "lr",
                  "lr schedule", "wd", "LCCN: α, δ, warm-up", "DivideMix: α_mix, λu, τ, T",
                  "source")


def _row(name: str, methods: list[str], r: Recipe) -> str:
    """One line of :func:`presets_table`: recipe ``r`` of dataset ``name``, run by
    ``methods``."""
    run = r.run()
    o, lc, d = run.optim, run.lccn, run.divide
    if r.lr_values:
        sched = " / ".join(f"{v:g}" for v in r.lr_values) + " from epochs " + \
            ", ".join(["0", *map(str, o.milestones)])
    elif o.milestones:
        sched = f"/{1 / o.lr_decay:g} at " + ", ".join(map(str, o.milestones))
    else:
        sched = "fixed"
    # the DivideMix column where a method of the row reads DivideConfig, the LCCN column
    # where the recipe's method has a chain
    dm = (f"{d.mixmatch_alpha:g}, {d.lambda_u:g}, {d.p_threshold:g}, {d.temperature:g}"
          + (", conf. penalty" if d.conf_penalty else "")
          if any(get_method(m).reads_divide for m in methods) else "—")
    lccn = (f"{lc.alpha:g}, {lc.warmup_steps:,} steps, {lc.warmup}"
            + (", annealing" if lc.anneal else "")
            if get_method(run.method).needs_chain else "—")
    model = run.model.name + (" (ImageNet weights)" if r.pretrained else "")
    note = f" {r.note[0].upper()}{r.note[1:]}." if r.note else ""
    wd = f"{o.weight_decay:g}" + ("" if o.norm_weight_decay is None else
                                  f" ({o.norm_weight_decay:g} on norm layers, biases)")
    return "| " + " | ".join((
        name, ", ".join(methods), model, f"{o.epochs} ({o.pretrain_epochs})",
        str(o.batch_size), f"{o.lr:g}", sched, wd, lccn, dm, r.source + "." + note)) + " |"


def presets_table() -> str:
    """The Markdown table of every recipe (docs/methods.md, "Presets")."""
    rows = ["| " + " | ".join(PRESET_COLUMNS) + " |", "|" + "---|" * len(PRESET_COLUMNS)]
    for name, r in RECIPES.items():
        own = {m: METHOD_RECIPES[(name, m)] for (d, m) in METHOD_RECIPES if d == name}
        rows.append(_row(name, [m for m in registered() if m not in own], r))
        rows += [_row(name, [m], mr) for m, mr in own.items()]
    return "\n".join(rows) + "\n"
