"""Build a tiny model of a real family (Llama-3.2, Mistral, Qwen2.5, Gemma-2, Phi-3, GPT-2, T5,
BERT, CLIP, Stable Diffusion 1.5/XL/3, Flux, CogVideoX) to try the converter on.

Each is its published checkpoint's config shrunk in depth and width only, with a tokenizer of
the family's own kind (see ``examples/zoo``). No download is needed; the sentencepiece-based
tokenizers need the ``sentencepiece`` and ``protobuf`` packages.

Usage: python examples/make_zoo_model.py FAMILY DIR   (no arguments: list the families)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import zoo


def main(argv: list[str]) -> int:
    families = ", ".join(zoo.FAMILIES)
    if not argv:
        print("families:", families)
        return 0
    if len(argv) != 2 or argv[0] not in zoo.FAMILIES:
        print(f"usage: make_zoo_model.py FAMILY DIR; families: {families}", file=sys.stderr)
        return 2
    name, target = argv[0], Path(argv[1])
    if missing := zoo.missing_packages(name):
        print(
            f"make_zoo_model.py: {name} needs {', '.join(missing)}: "
            f"pip install {' '.join(missing)}",
            file=sys.stderr,
        )
        return 2
    if target.exists():
        print(f"make_zoo_model.py: {target} already exists", file=sys.stderr)
        return 2
    # Built beside the target and renamed into place: a failed build leaves no half folder.
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    try:
        zoo.build(name, staging)
        staging.rename(target)
    except Exception as exc:  # any failure of the libraries: one line, nothing left behind
        print(f"make_zoo_model.py: building {name} failed: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
