"""The names this tool reads and writes by pattern, one definition each: Hub ids, variant
names, variant-named weight files, certificate files and their signatures. Match them with
``fullmatch``."""

from __future__ import annotations

import re
from collections.abc import Iterable

_OWNER = r"[A-Za-z0-9][\w.-]*"
_NAME = r"[\w.-]+"
_VARIANT = r"[A-Za-z0-9_]+"  # in a file name; a variant given by the user is VARIANT_NAME

#: A Hub repo a push writes to: ``owner/name``.
REPO_ID = re.compile(rf"{_OWNER}/{_NAME}")
#: A Hub model a source names: ``owner/name``, or ``name`` alone (the Hub's oldest models).
HUB_ID = re.compile(rf"{_OWNER}(?:/{_NAME})?")
#: A Hub variant name (``fp16``, ``bf16``, ``non_ema``): it goes inside file names.
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*")
#: A variant-named weight file or index: ``model.fp16.safetensors``,
#: ``model.fp16-00001-of-00002.safetensors``, ``model.safetensors.index.fp16.json`` (and the
#: same with ``.bin``).
VARIANT_FILE = re.compile(
    rf"(?P<stem>.+)\.(?P<variant>{_VARIANT})(?P<shard>-\d+-of-\d+)?\.(?P<ext>safetensors|bin)"
    rf"|(?P<istem>.+)\.(?P<iext>safetensors|bin)\.index\.(?P<ivariant>{_VARIANT})\.json"
)
#: The certificate of an output written without ``--variant``.
CERTIFICATE_NAME = "precision_certificate.json"
_CERTIFICATE_STEM = rf"precision_certificate(?:\.(?P<variant>{_VARIANT}))?"
#: ``precision_certificate.json``, or ``precision_certificate.<variant>.json`` for an output
#: written with ``--variant`` (it sits beside the source repo's files, under its own name).
CERTIFICATE_FILE = re.compile(rf"{_CERTIFICATE_STEM}\.json")
#: The signature of a certificate and the files it covers (``validate --sign``), beside it:
#: ``precision_certificate.sig`` or ``precision_certificate.<variant>.sig``.
SIGNATURE_FILE = re.compile(rf"{_CERTIFICATE_STEM}\.sig")


def certificate_name(variant: str | None) -> str:
    """The file name of the certificate of an output written with ``variant`` (or without)."""
    return f"precision_certificate.{variant}.json" if variant else CERTIFICATE_NAME


def signature_name(variant: str | None) -> str:
    """The file name of the signature of the certificate :func:`certificate_name` names."""
    return certificate_name(variant).removesuffix(".json") + ".sig"


def is_variant_file(path: str, variant: str) -> bool:
    """Whether ``path`` (in any folder) is one of ``variant``'s safetensors weights or their
    index: ``model.<v>.safetensors``, ``model.<v>-00001-of-00002.safetensors``,
    ``model.safetensors.index.<v>.json``."""
    found = VARIANT_FILE.fullmatch(path.rsplit("/", 1)[-1])
    return (
        found is not None
        and variant in (found["variant"], found["ivariant"])
        and "safetensors" in (found["ext"], found["iext"])
    )


#: Files a library runs as code when the user passes ``trust_remote_code`` (transformers'
#: ``auto_map`` modules, diffusers' custom pipelines and components): a copied source may
#: carry them, and a push publishes them.
CODE_FILE = re.compile(r".+\.py")


def code_files(paths: Iterable[str]) -> list[str]:
    """The files among ``paths`` (relative, ``/``-separated) that are Python code, sorted."""
    return sorted(p for p in paths if CODE_FILE.fullmatch(p.rsplit("/", 1)[-1]))
