"""The project speaks of itself: no file names documents the repository does not hold, and
every relative link in the Markdown guides points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".json"}
FOREIGN = ("DESIGN.md", "PLATFORM.md", "STYLE.md")


def project_files() -> list[Path]:
    out = []
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if any(part.startswith(".") or part == "__pycache__" or part.endswith(".egg-info")
               for part in rel.parts[:-1]):
            continue
        if p.is_file() and p.suffix in TEXT:
            out.append(p)
    return out


def test_no_file_cites_documents_outside_the_repository():
    me = Path(__file__).resolve()
    hits = [f"{p.relative_to(REPO)}: {name}" for p in project_files() if p.resolve() != me
            for name in FOREIGN if name in p.read_text(errors="replace")]
    assert not hits, hits


def test_docs_folder_holds_the_design_notes():
    for name in ("README.md", "design.md", "reliability.md", "operations.md"):
        assert (REPO / "docs" / name).is_file(), name
    design = (REPO / "docs" / "design.md").read_text()
    for topic in ("phi[k, j] = P(observed = j | latent = k)", "Fences", "Invariants",
                  "Exactly once"):
        assert topic in design, topic


GUIDES = ["README.md", "infra/README.md", *sorted(str(p.relative_to(REPO))
                                                   for p in (REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("guide", GUIDES)
def test_relative_links_resolve(guide):
    path = REPO / guide
    text = path.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    targets += re.findall(r"`((?:docs|benchmarks|infra|jobs|lccn_jobs|scripts|tests|pipeline|shards|tune)/[\w./-]+\.(?:md|py|sh|yaml))`", text)
    missing = [t for t in targets if "://" not in t
               and not ((path.parent / t).exists() or (REPO / t).exists())]
    assert not missing, missing


def _script_parser(script: str):
    """The parser of a job script ``jobs/<name>.py`` (its ``get_args_parser``, run without
    its ``__main__`` block)."""
    import runpy

    path = REPO / script
    assert path.is_file(), script
    return runpy.run_path(str(path))["get_args_parser"]()


def _commands(text: str, prefix: str) -> list[list[str]]:
    """Command lines in the fenced code blocks of ``text`` that start with ``prefix``
    (continuation lines joined, comments dropped), split like a shell would."""
    import shlex

    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith(prefix):
                out.append(shlex.split(line)[len(prefix.split()):])
    return out


def test_readme_commands_parse():
    """Every lccn-shards / lccn-labelview / job / sweep command the README shows is accepted
    by that program's parser (catches options that were renamed or never existed)."""
    from shards import cli, labelview

    text = (REPO / "README.md").read_text()
    shards_cmds = _commands(text, "lccn-shards")
    assert {c[0] for c in shards_cmds} >= {"cifar10", "imagefolder", "clothing1m", "webvision"}
    for argv in shards_cmds:
        cli.build_parser().parse_args(argv)
    for argv in _commands(text, "lccn-labelview"):
        labelview.get_args_parser().parse_args(argv)
    jobs = [argv for argv in _commands(text, "python") if argv and argv[0].startswith("jobs/")]
    assert jobs
    for argv in jobs:
        _script_parser(argv[0]).parse_args(argv[1:])
    from tune import sweep

    sweeps = _commands(text, "python -m tune.sweep")
    assert sweeps
    for argv in sweeps:
        sweep.get_args_parser().parse_args(argv)


def test_readme_says_how_to_use_the_venv_and_the_converters():
    text = (REPO / "README.md").read_text()
    for phrase in ("source .venv/bin/activate", "`imagefolder`", "`--download`",
                   "noisy_label_kv.txt", "python -m tune.sweep", "docs/design.md"):
        assert phrase in text, phrase


def test_presets_table_is_the_code():
    """The "Presets" table of docs/methods.md is the jobs' recipes, rendered
    (``lccn_jobs/recipes.py``: ``presets_table``); rebuild it with that function after a
    change."""
    from lccn_jobs.recipes import METHOD_RECIPES, presets_table

    text = (REPO / "docs" / "methods.md").read_text()
    m = re.search(r"<!-- presets:start -->\n(.*?)<!-- presets:end -->", text, flags=re.S)
    assert m, "docs/methods.md has no presets table between its markers"
    assert m.group(1) == presets_table()
    for (dataset, method), r in METHOD_RECIPES.items():  # every recipe in a row
        assert f"| {dataset} | {method} | {r.get('model.name')}" in m.group(1), (dataset, method)
    assert "docs/methods.md#presets" in (REPO / "README.md").read_text()


# -- the user guide: every command it shows is accepted by the program it names -----------

USER_PAGES = ["README.md", "docs/guide.md", "docs/label-issues.md"]


def _shell_commands(text: str) -> list[list[str]]:
    """Commands of the ```bash blocks (continuations joined, comments and leading
    ``VAR=value`` assignments dropped; ``ray job submit ... -- CMD`` gives CMD) and the
    inline ``python benchmarks/...`` / ``bash ...`` commands in backticks."""
    import shlex

    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [ln.split(" #")[0].strip() for ln in joined.splitlines()]
    lines += re.findall(r"`((?:python|bash) (?:benchmarks|scripts)/[^`]+)`", text)
    out = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line)
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv[:3] == ["ray", "job", "submit"] and "--" in argv:
            argv = argv[argv.index("--") + 1:]
        out.append(argv)
    return out


def _check_command(argv: list[str]) -> bool:
    """Parse ``argv`` with the parser of the project program it runs; False when it is not
    one of ours (ray, kubectl, mlflow, ...)."""
    from pipeline.track import label_issues, predict
    from pipeline.train import models
    from shards import cli, labelview
    from tune import sweep

    if not argv:  # a line that only sets a shell variable
        return False
    prog, args = argv[0], argv[1:]
    if prog == "python" and args[:1] == ["-m"]:
        prog, args = f"python -m {args[1]}", args[2:]
    parsers = {"lccn-shards": cli.build_parser, "python -m shards": cli.build_parser,
               "lccn-labelview": labelview.get_args_parser,
               "python -m shards.labelview": labelview.get_args_parser,
               "lccn-label-issues": label_issues.get_args_parser,
               "python -m pipeline.track.label_issues": label_issues.get_args_parser,
               "python -m tune.sweep": sweep.get_args_parser,
               "python -m pipeline.train.models": models.get_args_parser,
               "lccn-predict": predict.get_args_parser,
               "python -m pipeline.track.predict": predict.get_args_parser}
    if prog in parsers:
        parsers[prog]().parse_args(args)
        return True
    if prog == "python" and args and args[0].startswith("jobs/"):
        _script_parser(args[0]).parse_args(args[1:])
        return True
    if prog in ("python", "bash") and args and args[0].startswith(("benchmarks/", "scripts/")):
        script = REPO / args[0]
        assert script.is_file(), args[0]
        source = script.read_text()
        for called in re.findall(r"benchmarks/\w+\.py", source):  # a wrapper passes "$@" on
            source += (REPO / called).read_text()
        for flag in (a.split("=")[0] for a in args[1:] if a.startswith("--")):
            assert f'"{flag}"' in source or f"{flag})" in source or f"{flag}|" in source \
                or f" {flag} " in source, f"{args[0]} has no option {flag}"
        return True
    return False


@pytest.mark.parametrize("page", USER_PAGES)
def test_user_guide_commands_are_real(page):
    """Every project command on the page (converters, label views, jobs, also behind
    ``ray job submit``, sweeps, the label-issue report, benchmarks) is accepted as shown."""
    checked = 0
    for argv in _shell_commands((REPO / page).read_text()):
        try:
            checked += _check_command(argv)
        except SystemExit as e:  # argparse refused it
            pytest.fail(f"{page}: {' '.join(argv)} is refused (exit {e.code})")
    assert checked >= 3, page


def test_user_guide_covers_the_journey():
    text = (REPO / "docs" / "guide.md").read_text()
    for phrase in ("lccn-shards clothing1m", "lccn-shards webvision", "lccn-shards cifar10",
                   "lccn-labelview", "infra/ray-cluster.yaml", "infra/kuberay-rayjob.yaml",
                   "python -m tune.sweep", "--scheduler pbt", "mlflow ui", "Choosing α",
                   "--warmup-steps", "--method", "label-issues.md", "benchmarks/results/"):
        assert phrase in text, phrase
    readme = (REPO / "README.md").read_text()
    assert "docs/guide.md" in readme and "docs/label-issues.md" in readme


def test_the_kuberay_job_is_a_command_the_job_accepts_and_can_start():
    """The RayJob's entrypoint parses with the job's own parser, and a remote training split
    comes with its label view (without one the job exits at once); the header's commands of
    the project parse too."""
    import shlex

    import yaml

    text = (REPO / "infra" / "kuberay-rayjob.yaml").read_text()
    argv = shlex.split(yaml.safe_load(text)["spec"]["entrypoint"])
    assert argv[:2] == ["python", "jobs/webvision_divide_lccn.py"] and _check_command(argv)
    args = _script_parser(argv[1]).parse_args(argv[2:])
    assert "://" in args.train_shards and args.label_view is not None
    header = [line.lstrip("# ").split("  #")[0] for line in text.splitlines()
              if line.startswith("#   lccn-")]
    assert header and all(_check_command(shlex.split(cmd)) for cmd in header)


def test_the_image_and_the_cluster_put_the_presets_weights_in_place():
    """infra/Dockerfile and infra/ray-cluster.yaml fetch the weights of every preset that
    starts from pretrained weights, with a command the project's parser accepts."""
    import shlex

    import yaml

    from lccn_jobs.recipes import METHOD_RECIPES, RECIPES

    needed = {r.get("model.name") for r in [*RECIPES.values(), *METHOD_RECIPES.values()]
              if r.pretrained}
    assert needed == {"resnet50"}
    docker = [shlex.split(line[4:]) for line in (REPO / "infra" / "Dockerfile").read_text()
              .splitlines() if line.startswith("RUN python -m pipeline.train.models")]
    setup = yaml.safe_load((REPO / "infra" / "ray-cluster.yaml").read_text())["setup_commands"]
    cluster = [shlex.split(c.split("&&")[-1].replace("~/venv/bin/python", "python"))
               for c in setup if "pipeline.train.models" in c]
    for cmds in (docker, cluster):
        assert cmds and all(_check_command(argv) for argv in cmds)
        assert {argv[4] for argv in cmds if argv[3] == "fetch"} >= needed


def test_both_cluster_configs_start_locked_down():
    """Ray token auth and MLflow basic auth in infra/ray-cluster.yaml (the token and the
    credentials mounted on every node, RAY_AUTH_MODE=token on every `ray start`, the server
    started with --auth from a password file) and in infra/kuberay-rayjob.yaml
    (authOptions, the credentials from a Secret on the head and the workers); the README's
    local cluster turns token auth on before `ray start`."""
    import yaml

    c = yaml.safe_load((REPO / "infra" / "ray-cluster.yaml").read_text())
    assert c["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "~/.lccn/mlflow" in c["file_mounts"]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [cmd for cmd in c[key] if "ray start" in cmd]
        assert starts and all("RAY_AUTH_MODE=token" in cmd for cmd in starts), key
    server = [cmd for cmd in c["head_setup_commands"]
              if "mlflow-server.sh" in cmd and "--stop" not in cmd]
    assert server and all("--auth" in cmd and "MLFLOW_AUTH_ADMIN_PASSWORD_FILE=" in cmd
                          for cmd in server)
    assert any("~/.mlflow/credentials" in cmd for cmd in c["setup_commands"])
    k = yaml.safe_load((REPO / "infra" / "kuberay-rayjob.yaml").read_text())
    spec = k["spec"]["rayClusterSpec"]
    assert spec["authOptions"] == {"mode": "token"}
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for pod in pods:
        for container in pod["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                assert env[var]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-credentials"
    readme = (REPO / "README.md").read_text()
    assert readme.index("export RAY_AUTH_MODE=token") < readme.index("ray start --head")
    assert 'eval "$(infra/mlflow-server.sh --auth)"' in readme
    script = (REPO / "infra" / "mlflow-server.sh").read_text()
    assert "--auth) AUTH=1" in script and "MLFLOW_AUTH_ADMIN_PASSWORD_FILE" in script
