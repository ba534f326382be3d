"""What a user sees of a job's run in the MLflow UI, rendered by a headless browser.

Starts a real ``mlflow server`` (sqlite, served artifacts) in a temporary folder, runs
``jobs/train.py`` on a small class-folder tree of generated images against it (Ray, two
CPU workers, LCCN, three epochs), takes the UI links the job prints at its end
(``?workflowType=machine_learning``) and loads each page, and the run's metric charts and
artifacts tabs, in headless Chromium (``--dump-dom`` after the page's scripts ran, and a
screenshot). Each page must show what it is for:

- the runs table: the run's name and its dataset input;
- the run: its name, parameters;
- the metric charts: ``test_top1`` and ``val_top1``;
- the artifacts: the transition heat maps (``transitions/``), and the last one previewed;
- the logged model: its name and the run it came from.

Needs Chromium (``apt-get install chromium``; ``--browser PATH`` for another binary).
Usage::

    python benchmarks/check_mlflow_ui.py --out /tmp/lccn-ui     # screenshots and DOMs there

Prints one line per page, PASS or FAIL with the strings it missed; exit status 1 on any
FAIL. Not part of the test suite (it needs a browser the CI machine does not have).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
         f"sqlite:///{root / 'db.sqlite'}", "--serve-artifacts", "--artifacts-destination",
         str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, uri
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"mlflow server did not start:\n"
                             f"{(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)


def make_images(out: Path, per_class: int, seed: int) -> Path:
    """``out/<class>/<n>.jpg``: three classes of 32 px images (a bright square, a disc, a
    bar on noise), so the run has something to learn."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    for c, name in enumerate(("square", "disc", "bar")):
        (out / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = Image.fromarray(rng.integers(0, 90, (32, 32, 3), dtype=np.uint8))
            d = ImageDraw.Draw(img)
            x, y = rng.integers(2, 14, 2)
            box = [int(x), int(y), int(x) + 16, int(y) + 16]
            colour = tuple(int(v) for v in rng.integers(150, 256, 3))
            (d.rectangle, d.ellipse, lambda b, fill: d.rectangle(
                [b[0], b[1] + 6, b[2], b[1] + 10], fill=fill))[c](box, fill=colour)
            img.save(out / name / f"{i:04d}.jpg", quality=90)
    return out


def render(browser: str, url: str, png: Path, wait_ms: int, height: int = 1000) -> str:
    """The page's DOM after its scripts ran (and a screenshot beside it); ``height``: the
    window's (the metric charts are a virtualised grid: only charts in view render)."""
    base = [browser, "--headless=new", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", f"--virtual-time-budget={wait_ms}",
            f"--window-size=1600,{height}"]
    subprocess.run(base + [f"--screenshot={png}", url], capture_output=True, timeout=180)
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True,
                         timeout=180)
    return dom.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="lccn-ui-")))
    p.add_argument("--browser", default=shutil.which("chromium") or shutil.which("chromium-browser")
                   or shutil.which("google-chrome"))
    p.add_argument("--per-class", type=int, default=40)
    p.add_argument("--wait-ms", type=int, default=60000,
                   help="virtual time the browser gives each page's scripts")
    args = p.parse_args(argv)
    if not args.browser:
        raise SystemExit("no Chromium found: apt-get install chromium, or --browser PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lccn-ui-work-"))
    proc, uri = start_server(work)
    try:
        photos = make_images(work / "photos", args.per_class, 0)
        test = make_images(work / "photos-test", 10, 1)
        cmd = [sys.executable, "jobs/train.py", "--images", str(photos), "--test-images",
               str(test), "--run-dir", str(work / "runs"), "--run-name", "ui-check",
               "--experiment", "lccn-ui-check", "--tracking-uri", uri, "--no-pretrained",
               "--model", "small_cnn", "--image-size", "32", "--epochs", "3",
               "--pretrain-epochs", "1", "--loader-workers", "0"]
        t0 = time.perf_counter()
        job = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        out = job.stdout + job.stderr
        (args.out / "job.log").write_text(out)
        if job.returncode != 0:
            print(out[-4000:])
            raise SystemExit(f"the job failed ({job.returncode}); log: {args.out / 'job.log'}")
        print(f"job done in {time.perf_counter() - t0:.0f} s against {uri}")
        # the job's last lines: "[train] MLflow:" then "  runs  URL", "  run   URL", "  model URL"
        urls = dict(re.findall(r"^  (runs|run|model) +(http\S+workflowType=\S+)", out,
                               flags=re.M))
        if "runs" not in urls or "run" not in urls:
            raise SystemExit("the job printed no UI links ('  runs  http...', '  run   "
                             f"http...'); see {args.out / 'job.log'}")
        base, query = urls["run"].split("?", 1)
        pages = {
            "runs table": (urls["runs"], ["ui-check", "Dataset"]),
            "run": (urls["run"], ["ui-check", "Parameters"]),
            "metric charts": (f"{base}/model-metrics?{query}", ["test_top1", "val_top1"]),
            "artifacts": (f"{base}/artifacts?{query}", ["transition"]),
        }
        run_id = base.rsplit("/", 1)[-1]
        with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/artifacts/list?run_id={run_id}"
                                    f"&path=transitions", timeout=30) as r:
            maps = sorted(f["path"] for f in json.load(r).get("files", [])
                          if f["path"].endswith(".png"))
        if maps:  # the last epoch's transition heat map, previewed
            pages["heat map"] = (f"{base}/artifacts/{maps[-1]}?{query}",
                                 [maps[-1].rsplit("/", 1)[-1], "<img"])
        if "model" in urls:
            pages["logged model"] = (urls["model"], ["model", "ui-check"])
        failed = 0
        for name, (url, want) in pages.items():
            stem = name.replace(" ", "_")
            for attempt in range(3):  # the charts render lazily: a slow load is tried again
                dom = render(args.browser, url, args.out / f"{stem}.png",
                             args.wait_ms * (attempt + 1),
                             height=7000 if name == "metric charts" else 1000)
                missing = [w for w in want if w not in dom]
                if not missing:
                    break
            (args.out / f"{stem}.html").write_text(dom)
            failed += bool(missing)
            print(f"{'PASS' if not missing else 'FAIL'}  {name:14s} {url}"
                  + (f"  missing: {missing}" if missing else "")
                  + f"  ({len(dom):,} bytes of DOM, try {attempt + 1}; "
                    f"{args.out / (stem + '.png')})")
        return 1 if failed else 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


if __name__ == "__main__":
    sys.exit(main())
