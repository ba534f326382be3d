"""Options declared once (pipeline/core/options.py): every config flag gets its type,
choices, default and help from its dataclass field, reads back into the same RunConfig,
and no program declares one of them by hand."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from pipeline.core.config import LCCNConfig, OptimConfig, RunConfig
from pipeline.core.options import (
    FLAGS,
    UNSET,
    _owner,
    add_option_groups,
    add_options,
    apply_options,
    field_doc,
)
from pipeline.train.methods import registered

REPO = Path(__file__).resolve().parents[1]

# flags of a config field's name that some program declares by hand for something else
OTHER_MEANINGS = {
    ("benchmarks/bench_loader.py", "--batch-size"): "the loader's own batch, no run",
    ("pipeline/track/predict.py", "--batch-size"): "images per forward pass, no run",
    ("benchmarks/bench_actor.py", "--commit-every"): "a list of values to sweep",
    ("benchmarks/bench_actor.py", "--seed"): "the synthetic load's seed",
    ("benchmarks/bench_sampler.py", "--seed"): "the synthetic posteriors' seed",
    ("benchmarks/bench_step.py", "--seed"): "the synthetic batches' seed",
    ("tune/sweep.py", "--seed"): "the seed of Tune's random search",
}


def test_every_flag_names_a_documented_field():
    assert len(set(FLAGS.values())) == len(FLAGS)  # one flag per field
    for flag, path in FLAGS.items():
        cls, name = _owner(path)
        assert field_doc(cls, name), f"{cls.__name__}.{name} ({flag}) has no docstring entry"


def test_a_flag_takes_its_type_choices_default_and_help_from_the_field():
    p = argparse.ArgumentParser()
    add_options(p, FLAGS)
    acts = {a.option_strings[0]: a for a in p._actions if a.option_strings}
    assert acts["--targets"].choices == ("sample", "posterior", "map")
    assert acts["--targets"].default == LCCNConfig().targets
    assert acts["--epochs"].type is int and acts["--lr"].type is float
    assert acts["--milestones"].nargs == "*" and acts["--milestones"].type is int
    assert acts["--bn-momentum"].type is float and acts["--bn-momentum"].default is None
    assert isinstance(acts["--anneal"], argparse.BooleanOptionalAction)
    assert "LCCNConfig.warmup_steps" in acts["--warmup-steps"].help
    assert acts["--warmup-steps"].help.startswith("δ, LCCN steps during which")
    # the library defaults parse back into the library's RunConfig
    assert apply_options(RunConfig(), p.parse_args([])) == RunConfig()
    with pytest.raises(SystemExit):
        p.parse_args(["--warmup", "nonsense"])  # not among the field's choices


def test_parsed_flags_set_their_fields_and_bad_values_are_the_configs_errors():
    p = argparse.ArgumentParser()
    add_options(p, ["--epochs", "--pretrain-epochs", "--milestones", "--alpha", "--anneal",
                    "--stop-on-collapse", "--model", "--seed"],
                defaults={"--epochs": 7, "--alpha": UNSET})
    args = p.parse_args(["--milestones", "3", "5", "--anneal", "--stop-on-collapse",
                         "--model", "resnet50", "--seed", "4", "--pretrain-epochs", "2"])
    assert args.alpha is None  # unset: left to the program (a recipe)
    run = apply_options(RunConfig(), args)
    assert (run.optim.epochs, run.optim.pretrain_epochs, run.optim.milestones) == (7, 2, (3, 5))
    assert run.lccn.anneal and run.monitor.stop and run.model.name == "resnet50"
    assert run.seed == 4 and run.lccn.alpha == LCCNConfig().alpha
    with pytest.raises(ValueError, match="pretrain_epochs"):
        apply_options(RunConfig(), p.parse_args(["--pretrain-epochs", "9"]))
    with pytest.raises(ValueError, match="not among the flags added"):
        add_options(argparse.ArgumentParser(), ["--lr"], defaults={"--epochs": 3})


def test_help_groups_follow_the_config_classes():
    p = argparse.ArgumentParser()
    add_option_groups(p, ["--lr", "--alpha", "--epochs"], defaults={"--lr": 0.5})
    titles = [g.title for g in p._action_groups]
    assert any(t.startswith("OptimConfig: SGD with a step schedule") for t in titles)
    assert any(t.startswith("LCCNConfig: The LCCN sampler") for t in titles)
    assert p.parse_args([]).lr == 0.5 and OptimConfig().lr != 0.5


def test_the_jobs_method_list_is_the_registry():
    from lccn_jobs.datasets import CIFAR

    p = CIFAR.get_args_parser()
    (method,) = [a for a in p._actions if "--method" in a.option_strings]
    assert tuple(method.choices) == registered()


def _literal_flags(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            out |= {a.value for a in node.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def test_no_program_declares_a_config_flag_by_hand():
    """jobs, the quickstart, the benchmarks, Tune and the library add config flags only
    through pipeline.core.options; a flag of the same name with another meaning is listed
    in OTHER_MEANINGS."""
    found = set()
    for folder in ("jobs", "lccn_jobs", "benchmarks", "tune", "pipeline", "shards"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            found |= {(rel, f) for f in _literal_flags(path) & set(FLAGS)}
    assert found == set(OTHER_MEANINGS), sorted(found ^ set(OTHER_MEANINGS))
