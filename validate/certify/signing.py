"""Signed certificates: who vouches for a certified output, with OpenSSF's ``model-signing``.

A certificate alone proves integrity against accidental change: its ``files`` hold the sha256 of
every file it covers, and :func:`~precision_convert.validation.certify.verify.verify` finds any
byte changed since. It does not prove who wrote it: whoever edits a file can recompute the
hashes and the card. ``validate --sign KEY`` (and ``push --sign KEY``) adds that: the
certificate and every file it covers are signed with an elliptic-curve private key, offline,
into ``precision_certificate.sig`` (``precision_certificate.<variant>.sig`` for a variant), a
sigstore bundle as ``model-signing`` writes it, so its own command verifies it too::

    model_signing verify key DIR --signature DIR/precision_certificate.sig \\
        --public_key key.pub --ignore_unsigned_files

What is signed: the certificate and the files it covers, hashed by ``model-signing`` itself
(sha256, the digests the certificate records). Not the card (rendered from the certificate, and
rendered again for the repo a push goes to), not the signature, not hidden paths: files that
are not signed are the certificate check's business (it refuses every extra file), so the
signature holds no local file names. The signature is written after the certificate, which
therefore records only its name and the signer's key (``signature``), never its hash: it is the
one file of an output checked by its own means, :func:`check`, given the public key.

``model-signing`` is an optional extra (``pip install "precision-convert[signing]"``),
imported only here and only when a key is used.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.conversion.io.staging import TargetLock, real_path
from precision_convert.core.errors import InputError, NotAsCertified, one_line
from precision_convert.core.patterns import signature_name
from precision_convert.validation.certify.certificate import CARD_NAME, Certificate, write
from precision_convert.validation.certify.verify import Verified, verify

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey

#: The extra that brings ``model-signing``.
EXTRA = 'pip install "precision-convert[signing]"'
#: The curves ``model-signing`` signs with (NIST P-256, P-384, P-521).
CURVES = ("secp256r1", "secp384r1", "secp521r1")


@dataclass(frozen=True)
class Key:
    """An elliptic-curve key read from a PEM file: the file, whether it is the private key,
    its public half (PEM) and the public half's fingerprint (sha256 of its DER
    SubjectPublicKeyInfo, hex)."""

    path: Path
    private: bool
    public_pem: bytes
    fingerprint: str


def private_key(path: str | Path) -> Key:
    """The signing key in ``path`` (an unencrypted PEM elliptic-curve private key), checked
    before anything runs.

    Raises:
        InputError: ``model-signing`` is not installed, or the file is unreadable or holds no
            such key.
    """
    _require_library()
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    data = _read(path)
    try:
        key = load_pem_private_key(data, password=None)
    except TypeError:  # cryptography's word for a key that needs a password
        raise InputError(
            "the private key is encrypted: --sign takes an unencrypted PEM key", path
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise InputError(
            "not a PEM private key (make one: openssl ecparam -name prime256v1 -genkey -noout "
            "-out key.pem)",
            path,
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InputError(_NOT_EC, path)
    return _key(path, key.public_key(), private=True)


def public_key(path: str | Path) -> Key:
    """The public key in ``path`` (PEM), to check a signature with.

    Raises:
        InputError: ``model-signing`` is not installed, or the file is unreadable or holds no
            such key.
    """
    _require_library()
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    data = _read(path)
    try:
        key = load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise InputError(
            "not a PEM public key (the signer makes it from the private key: openssl ec -in "
            "key.pem -pubout -out key.pub)",
            path,
        ) from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise InputError(_NOT_EC, path)
    return _key(path, key, private=False)


_NOT_EC = f"not an elliptic-curve key on {', '.join(CURVES)} (what model-signing signs with)"


def sign(directory: str | Path, key: Key) -> Certificate:
    """Sign the certified output ``directory`` with ``key`` (see the module docstring); returns
    its certificate, which now records the signature. Offline.

    Under the output's lock, and only when :func:`verify` passes: what is signed is what is
    certified. A signature this key already made of these files is kept (signing again would
    give other bytes, and a push of the same output would commit them again).

    Raises:
        NotAsCertified: the output does not pass :func:`verify`; nothing was signed.
        InputError: ``model-signing`` could not sign a file (its reason); the output is as it was.
    """
    root = Path(directory)
    with TargetLock(real_path(root)):
        checked = verify(root)
        certificate = checked.certificate
        recorded = certificate.signature or {}
        if recorded.get("public_key_sha256") == key.fingerprint and _why_not(checked, key) is None:
            return certificate
        name = signature_name(checked.variant)
        signed = replace(
            certificate, signature={"file": name, "public_key_sha256": key.fingerprint}
        )
        covered = [checked.certificate_name, *sorted(set(certificate.files) - {CARD_NAME})]
        write(signed, root)  # the certificate names its signature, which then signs it
        try:
            _sign_files(root, covered, key, name)
        except BaseException as exc:
            write(certificate, root)  # back as it was (an earlier signature is untouched)
            if isinstance(exc, ValueError | OSError):  # model-signing's refusals
                raise InputError(f"could not sign: {one_line(exc)}", root) from None
            raise
    return signed


def check(checked: Verified, key: Key) -> None:
    """Require a signature of ``checked`` (an output :func:`verify` passed) made with ``key``'s
    private half, over the certificate and every file it covers as they are now.

    Raises:
        NotAsCertified: one line saying why: unsigned, signed with another key, the signature
            altered, or which signed files changed since signing.
    """
    certificate, root = checked.certificate, checked.directory
    if certificate.signature is None:
        raise NotAsCertified(
            root,
            [
                f"{checked.certificate_name}: not signed, and --public-key requires a signature "
                f"(the key's owner signs it: precision-convert validate {root} --verify --sign KEY)"
            ],
        )
    why = _why_not(checked, key)
    if why is None and certificate.signature["public_key_sha256"] != key.fingerprint:
        why = (
            f"{checked.certificate_name}: names another signer's key than the one it is signed with"
        )
    if why is not None:
        raise NotAsCertified(root, [why])


def signature_file(checked: Verified) -> str | None:
    """The signature ``checked``'s certificate lists (there, since :func:`verify` passed), or
    None when unsigned."""
    return (checked.certificate.signature or {}).get("file")


# --------------------------------------------------------------------------- model-signing


def _require_library() -> None:
    """Raise InputError naming the extra when ``model-signing`` cannot be imported."""
    try:
        import model_signing  # noqa: F401
    except ImportError:
        raise InputError(f"signing needs model-signing: {EXTRA}") from None


def _read(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read the key: {exc.strerror or one_line(exc)}", path) from None


def _key(path: str | Path, public: EllipticCurvePublicKey, *, private: bool) -> Key:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    if public.curve.name not in CURVES:
        raise InputError(_NOT_EC, path)
    der = public.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    pem = public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    return Key(Path(path), private, pem, hashlib.sha256(der).hexdigest())


def _sign_files(root: Path, paths: list[str], key: Key, name: str) -> None:
    """Sign ``paths`` (relative to ``root``) into ``root/name``, written whole or not at all."""
    from model_signing import signing

    listed = [root / p for p in paths]
    config = _hashing(listed)
    temporary = root / f".{name}.tmp"  # hidden: a run killed meanwhile leaves no extra file
    try:
        signer = signing.Config().set_hashing_config(config)
        signer.use_elliptic_key_signer(private_key=key.path).sign(root, temporary)
        os.replace(temporary, root / name)
    finally:
        temporary.unlink(missing_ok=True)


def _hashing(listed: list[Path] | None = None) -> Any:
    """model-signing's hashing as a signature here is made and checked: sha256 per file (the
    digests the certificate records), links hashed through (as the certificate hashes them),
    and when signing only the ``listed`` files, not every file under the directory."""
    from model_signing import hashing

    class Listed(hashing.Config):
        def hash(self, model_path: Any, *, files_to_hash: Any = None) -> Any:
            return super().hash(model_path, files_to_hash=listed or files_to_hash)

    return Listed().use_file_serialization(hashing_algorithm="sha256").set_allow_symlinks(True)


def _why_not(checked: Verified, key: Key) -> str | None:
    """Why the signature ``checked``'s certificate lists does not verify with ``key`` (None:
    it does), in one clause naming the signature or the files."""
    from cryptography.exceptions import InvalidSignature
    from model_signing import verifying

    name = signature_file(checked)
    assert name is not None
    root = checked.directory
    with tempfile.TemporaryDirectory(prefix="precision-convert-key-") as folder:
        public = Path(folder, "key.pub")
        public.write_bytes(key.public_pem)
        config = verifying.Config().use_elliptic_key_verifier(public_key=public)
        # Set, not guessed from the signature: a guess drops allow_symlinks (model-signing 1.1).
        config.set_hashing_config(_hashing()).set_ignore_unsigned_files(True)
        try:
            config.verify(root, root / name)
        except InvalidSignature:
            return f"{name}: does not verify with the key sha256:{key.fingerprint} (altered)"
        # ValueError for a key or file mismatch; a damaged file raises whatever its parsers do.
        except Exception as exc:
            message = str(exc)
            if message.startswith("Key mismatch"):
                return f"{name}: made with another key, not sha256:{key.fingerprint}"
            # The signature verified, then the files differed ("Cannot use": one is gone).
            files_differ = message.startswith(("Signature mismatch", "Cannot use"))
            changed = _changed_since_signing(checked, root / name) if files_differ else []
            if changed:
                return f"{name}: {', '.join(changed)} changed since signing"
            return f"{name}: does not verify ({one_line(exc)})"
    return None


def _changed_since_signing(checked: Verified, signature: Path) -> list[str]:
    """The signed files whose bytes differ now (or are gone), read from the signature's
    statement: only to name them once model-signing has checked its signature and found the
    files differ."""
    try:
        bundle = json.loads(signature.read_bytes())
        statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
        resources = statement["predicate"]["resources"]
        signed = {r["name"]: r["digest"] for r in resources if r["algorithm"] == "sha256"}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    now = {path: file.sha256 for path, file in checked.files.items()}
    return sorted(path for path, digest in signed.items() if now.get(path) != digest)
