"""Which PIL this interpreter imports: Pillow, or pillow-simd (the SIMD build of the same
API, faster resizes; ``scripts/pillow_simd.sh`` installs it in place of Pillow).

``pil_build()`` -> ``{"distribution", "version", "simd", "libjpeg"}``: pillow-simd is told
by its version (``X.Y.Z.postN``, its release scheme) together with an installed
``pillow-simd`` distribution that owns the ``PIL`` package (a Pillow installed over it,
as any later ``pip install`` touching torchvision does, takes the folder back).

    python -m pipeline.data.pil_build [--require-simd]   # one line; exit 1 if not SIMD

Imports: PIL and the standard library only.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys

import PIL
from PIL import features


def pil_build() -> dict[str, object]:
    """The distribution that provides ``PIL`` here, its version, whether it is the SIMD
    build, and the libjpeg it decodes with."""
    owners = md.packages_distributions().get("PIL", [])
    simd = bool(re.search(r"\.post\d+$", PIL.__version__)) and any(
        o.lower() == "pillow-simd" for o in owners)
    dist = "pillow-simd" if simd else next((o for o in owners if o.lower() == "pillow"),
                                           owners[0] if owners else "PIL")
    if features.check_feature("libjpeg_turbo"):
        jpeg = f"libjpeg-turbo {features.version('libjpeg_turbo') or '?'}"
    else:
        jpeg = f"libjpeg {features.version('jpg') or '?'}"
    return {"distribution": dist, "version": PIL.__version__, "simd": simd, "libjpeg": jpeg}


def describe() -> str:
    b = pil_build()
    kind = "the SIMD build" if b["simd"] else "not the SIMD build"
    return f"{b['distribution']} {b['version']} ({kind}, {b['libjpeg']})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--require-simd", action="store_true",
                   help="exit with status 1 unless PIL is pillow-simd")
    args = p.parse_args(argv)
    print(f"PIL: {describe()}")
    return 0 if pil_build()["simd"] or not args.require_simd else 1


if __name__ == "__main__":
    sys.exit(main())
