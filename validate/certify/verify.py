"""The one verifier: are the files in a directory the ones its certificate certified?

Certification records the sha256 of every file it covers (:func:`hash_files`, called when the
certificate is written); everything that later trusts a certificate asks :func:`verify`:
``push`` and ``model --push`` (the certificate gate, before any request), ``batch --resume``
(is a finished job's output still what was certified?) and ``validate --verify`` (the same
check on demand). One listing, one hashing and one comparison serve them all, so a file that
one of them would count as changed, missing or extra, every one of them does.

What is hashed is always the bytes, read here, never a name (a Hub-cache blob is named by its
sha256, but a link there can be repointed): only the source's weight files, which live in that
cache, are hashed by name (:mod:`precision_convert.conversion.io.finite`, which reads them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from precision_convert.conversion.io.hashing import HashedFile, hash_paths
from precision_convert.core.errors import InputError, NotAsCertified, one_line
from precision_convert.core.patterns import SIGNATURE_FILE, is_variant_file
from precision_convert.validation.certify.card import render_card
from precision_convert.validation.certify.certificate import (
    CARD_NAME,
    CERTIFICATE_FILE,
    CERTIFICATE_NAME,
    Certificate,
)
from precision_convert.validation.certify.consistency import refusal


@dataclass(frozen=True)
class Verified:
    """A directory that passed :func:`verify`: its certificate, variant and every file."""

    directory: Path
    certificate: Certificate
    certificate_name: str
    variant: str | None
    files: dict[str, HashedFile]
    card: str  # the card text (README.md, or rendered when a variant output has none)


def verify(directory: str | Path, *, blocks: bool = False) -> Verified:
    """Check ``directory`` against its certificate, offline; every file hashed from its bytes.

    It passes when there is exactly one certificate, its verdict is ``pass`` and its records
    agree (:func:`~.consistency.contradiction`), it is named for
    the variant it records, every file it covers is there with the same sha256 and nothing
    else is (hidden paths aside, and the signature it lists, which must be there), and the card
    is the one the certificate renders. Whose signature it is takes a public key:
    :func:`~precision_convert.validation.certify.signing.check`.

    Args:
        blocks: keep a digest per block of each large file (for an upload that re-reads them;
            see :class:`~precision_convert.conversion.io.hashing.HashedFile`).

    Raises:
        InputError: ``directory`` is not a directory.
        NotAsCertified: naming every problem, one line per file at fault.
    """
    root = Path(directory)
    if not root.is_dir():
        raise InputError("no such directory: expected a converted model directory", root)
    paths = listing(root)
    certificate_name, certificate = _certificate(root, paths)
    variant = CERTIFICATE_FILE.fullmatch(certificate_name)["variant"]  # type: ignore[index]
    problems: list[str] = []
    recorded = certificate.source.get("variant")
    if recorded != variant:
        problems.append(
            f"{certificate_name}: records variant {recorded!r} but is named for {variant!r}"
        )
    if (refused := refusal(certificate, root)) is not None:
        problems.append(f"{certificate_name}: {refused}")
    elif not certificate.passed:
        problems.append(f"{certificate_name}: {certificate.why_not_certified(root)}")
    files = hash_paths(root, paths, blocks=blocks)
    covered = {p: f.sha256 for p, f in files.items() if not _uncovered(p)}
    problems += differences(covered, certificate)
    problems += _signature_problems(paths, certificate)
    if variant is not None and not any(is_variant_file(p, variant) for p in covered):
        problems.append(f"{certificate_name}: no {variant!r}-variant weight file beside it")

    expected_card = render_card(certificate, root)
    card_file = files.get(CARD_NAME)
    if card_file is None:
        if variant is None:  # a variant PR never uploads the card; a new repo needs it
            problems.append(f"{CARD_NAME}: missing (it is written with the certificate)")
        card = expected_card
    else:
        card = (card_file.data or card_file.location.read_bytes()).decode(errors="replace")
        if card != expected_card:
            problems.append(f"{CARD_NAME}: differs from the card the certificate renders")
    if problems:
        raise NotAsCertified(root, problems)
    return Verified(root, certificate, certificate_name, variant, files, card)


def verify_files(directory: str | Path, certificate: Certificate) -> list[str]:
    """What differs between the files in ``directory`` and those ``certificate`` covers, one
    line per file (empty: the same); the comparison :func:`verify` makes, without the
    certificate's own checks."""
    return differences(hash_files(directory), certificate)


def differences(digests: Mapping[str, str], certificate: Certificate) -> list[str]:
    """Changed, missing and uncovered files: ``digests`` (path -> sha256, certificate and card
    left out) against the certificate's."""
    expected = certificate.files
    problems = [
        f"{name}: changed since certification"
        if name in expected
        else f"{name}: not covered by the certificate"
        for name in sorted(digests)
        if expected.get(name) != digests[name]
    ]
    problems += [f"{name}: missing" for name in sorted(set(expected) - set(digests) - {CARD_NAME})]
    return problems


def hash_files(directory: str | Path) -> dict[str, str]:
    """sha256 of every file a certificate covers (relative POSIX paths): every file under
    ``directory`` but the certificate, the card and a signature (written after the hashes are
    taken: the card quotes the certificate, the signature signs it) and hidden paths
    (``.cache``, ``.git``)."""
    root = Path(directory)
    covered = [p for p in listing(root) if not _uncovered(p)]
    return {p: f.sha256 for p, f in hash_paths(root, covered).items()}


def listing(directory: Path) -> list[str]:
    """Every file under ``directory`` (relative POSIX paths, sorted), minus hidden paths
    (``.cache``, ``.git``, a batch's state, temporary files), which are neither certified nor
    uploaded. Links to folders are not followed."""
    found = []
    for root, dirs, names in os.walk(directory, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if not name.startswith(".") and os.path.isfile(os.path.join(root, name)):
                found.append(Path(root, name).relative_to(directory).as_posix())
    return found


def _certificate(root: Path, paths: list[str]) -> tuple[str, Certificate]:
    """The one certificate at the top of ``root``, read."""
    names = [p for p in paths if "/" not in p and CERTIFICATE_FILE.fullmatch(p)]
    if not names:
        raise NotAsCertified(
            root,
            [
                f"{CERTIFICATE_NAME}: missing (certify the output against its source first: "
                f"precision-convert validate {root} --baseline SOURCE)"
            ],
        )
    if len(names) > 1:
        raise NotAsCertified(root, [f"more than one certificate ({', '.join(sorted(names))})"])
    try:
        data = json.loads((root / names[0]).read_text(encoding="utf-8"))
        return names[0], Certificate.from_dict(data)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise NotAsCertified(root, [f"{names[0]}: unreadable ({one_line(exc)})"]) from None


def _uncovered(path: str) -> bool:
    """The certificate, the card and a signature: written after the hashes are taken."""
    return path == CARD_NAME or any(p.fullmatch(path) for p in (CERTIFICATE_FILE, SIGNATURE_FILE))


def _signature_problems(paths: list[str], certificate: Certificate) -> list[str]:
    """The signature the certificate lists is there, and no other is: the one file it cannot
    hash (the signature is written after it, and signs it) is exempt only by being listed."""
    listed = (certificate.signature or {}).get("file")
    problems = [
        f"{path}: not covered by the certificate (it lists {listed or 'no signature'})"
        for path in paths
        if SIGNATURE_FILE.fullmatch(path) and path != listed
    ]
    if listed is not None and listed not in paths:
        problems.append(f"{listed}: missing (the certificate lists it as its signature)")
    return problems
