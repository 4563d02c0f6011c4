"""A signed certificate says who vouches for the files: ``validate --sign KEY`` (or ``push --sign
KEY``) signs the certificate and every file it covers with OpenSSF model-signing, offline;
``validate --verify --public-key FILE`` requires that signature (exit 1 when missing or wrong)
and names the key; ``push`` uploads it. Without the ``signing`` extra these tests skip, except
the one that checks the command says which extra to install.

One tiny T5 encoder is uploaded to the local Hub server and converted once (``--variant bf16``,
so its certificate and signature carry the variant's names); each test works on a copy.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _models
import pytest
from _fake_hub import FakeHub
from test_push import SOURCE_REPO, TOKEN, USER, _one_line_error, _online
from typer.testing import CliRunner

from precision_convert.cli.main import app
from precision_convert.validation.certify.card import write_card
from precision_convert.validation.certify.certificate import Certificate, write

try:
    import model_signing  # noqa: F401

    SIGNING = True
except ImportError:
    SIGNING = False

needs_signing = pytest.mark.skipif(
    not SIGNING, reason='model-signing is not installed: pip install "precision-convert[signing]"'
)

VARIANT = "bf16"
CERTIFICATE = f"precision_certificate.{VARIANT}.json"
SIGNATURE = f"precision_certificate.{VARIANT}.sig"


@dataclass(frozen=True)
class Keys:
    private: Path  # PEM, P-256
    public: Path
    fingerprint: str  # sha256 of the public key's DER SubjectPublicKeyInfo, hex
    other_public: Path  # a key that signed nothing
    other_private: Path
    other_fingerprint: str


@dataclass(frozen=True)
class Served:
    hub: FakeHub
    home: Path
    output: Path  # `model ns/tiny --to bf16 --variant bf16`, certified, unsigned


def _write_key(directory: Path, name: str) -> tuple[Path, Path, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.pem", directory / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, spki))
    der = key.public_key().public_bytes(serialization.Encoding.DER, spki)
    return private, public, hashlib.sha256(der).hexdigest()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    root = tmp_path_factory.mktemp("keys")
    private, public, fingerprint = _write_key(root, "signer")
    other_private, other_public, other_fingerprint = _write_key(root, "other")
    return Keys(private, public, fingerprint, other_public, other_private, other_fingerprint)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("signing")
    source, home, output = root / "source", root / "hf-home", root / "tiny-bf16"
    _models.make("t5-encoder").save_pretrained(source)
    with FakeHub() as hub:
        hub.add_token(TOKEN, USER)
        hub.add_commit(SOURCE_REPO, source)
        with pytest.MonkeyPatch.context() as mp:
            _online(mp, hub, home)
            done = _cli(
                "model", SOURCE_REPO, "--to", "bf16", "--coverage", "quick",
                "--variant", VARIANT, "-o", str(output),
            )  # fmt: skip
            assert done.exit_code == 0, done.output
        yield Served(hub, home, output)


@pytest.fixture
def hub(served: Served, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    _online(monkeypatch, served.hub, served.home)
    served.hub.requests.clear()
    return served.hub


@pytest.fixture
def unsigned(served: Served, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(served.output, out)
    return out


@pytest.fixture
def signed(unsigned: Path, keys: Keys) -> Path:
    done = _cli("validate", str(unsigned), "--verify", "--sign", str(keys.private))
    assert done.exit_code == 0, done.output
    return unsigned


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _signed_names(signature: Path) -> set[str]:
    """The files a signature's statement covers (read, not trusted: for assertions)."""
    bundle = json.loads(signature.read_bytes())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    return {r["name"] for r in statement["predicate"]["resources"]}


def _model_signing_verifies(directory: Path, signature: Path, public: Path) -> None:
    """model-signing's own verifier accepts the signature (files it did not sign ignored)."""
    from model_signing import verifying

    config = verifying.Config().use_elliptic_key_verifier(public_key=public)
    config.set_ignore_unsigned_files(True).verify(directory, signature)


# --------------------------------------------------------------------------- signing


@needs_signing
def test_a_signed_certificate_verifies_under_its_public_key(unsigned: Path, keys: Keys) -> None:
    (unsigned / ".cache").mkdir()
    (unsigned / ".cache" / "local.bin").write_bytes(b"not published, not signed")
    done = _cli("validate", str(unsigned), "--verify", "--sign", str(keys.private))
    assert done.exit_code == 0, done.output
    assert f"signed: {SIGNATURE} with the key sha256:{keys.fingerprint}" in done.stderr

    certificate = Certificate.read(unsigned)
    assert certificate.signature == {"file": SIGNATURE, "public_key_sha256": keys.fingerprint}
    # What is signed: the certificate and every file it covers; not the card (rendered again
    # for the repo a push goes to), not hidden paths.
    assert _signed_names(unsigned / SIGNATURE) == {CERTIFICATE, *certificate.files}
    assert "README.md" not in certificate.files
    _model_signing_verifies(unsigned, unsigned / SIGNATURE, keys.public)

    checked = _cli("validate", str(unsigned), "--verify", "--public-key", str(keys.public))
    assert checked.exit_code == 0, checked.output
    assert f"{SIGNATURE} verifies with the public key sha256:{keys.fingerprint}" in checked.stdout

    as_json = _cli(
        "validate", str(unsigned), "--verify", "--public-key", str(keys.public), "--json"
    )
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["signature"] == {
        "file": SIGNATURE,
        "public_key_sha256": keys.fingerprint,
        "checked": True,
    }


@needs_signing
def test_signing_and_checking_are_offline(
    unsigned: Path, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key-based signing needs no transparency log, no identity provider: no connection."""
    import socket

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a network call: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for key in (["--sign", str(keys.private)], ["--public-key", str(keys.public)]):
        done = _cli("validate", str(unsigned), "--verify", *key)
        assert done.exit_code == 0, done.output


@needs_signing
def test_signing_again_with_the_same_key_keeps_the_signature(signed: Path, keys: Keys) -> None:
    """A signature is not reproducible byte for byte: signing what this key signed already
    keeps it, so pushing the same output again commits nothing new."""
    before = (signed / SIGNATURE).read_bytes(), (signed / CERTIFICATE).read_bytes()
    done = _cli("validate", str(signed), "--verify", "--sign", str(keys.private))
    assert done.exit_code == 0, done.output
    assert ((signed / SIGNATURE).read_bytes(), (signed / CERTIFICATE).read_bytes()) == before

    other = _cli("validate", str(signed), "--verify", "--sign", str(keys.other_private))
    assert other.exit_code == 0, other.output
    assert (signed / SIGNATURE).read_bytes() != before[0]
    wrong = _cli("validate", str(signed), "--verify", "--public-key", str(keys.public))
    _one_line_error(wrong, 1, SIGNATURE, f"another key, not sha256:{keys.fingerprint}")


@needs_signing
def test_validate_sign_signs_what_it_certifies(
    signed: Path, keys: Keys, hub: FakeHub, tmp_path: Path
) -> None:
    """``validate --baseline SOURCE --sign KEY``: the new certificate is signed, and the
    signature of the certificate it replaced is gone with it."""
    done = _cli(
        "validate", str(signed), "--baseline", SOURCE_REPO, "--coverage", "quick",
        "--sign", str(keys.other_private),
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert f"with the key sha256:{keys.other_fingerprint}" in done.stderr
    checked = _cli("validate", str(signed), "--verify", "--public-key", str(keys.other_public))
    assert checked.exit_code == 0, checked.output
    old = _cli("validate", str(signed), "--verify", "--public-key", str(keys.public))
    _one_line_error(old, 1, SIGNATURE, "another key")


@needs_signing
def test_a_new_certificate_drops_the_old_signature(signed: Path) -> None:
    """A certificate written again (a re-validation without ``--sign``) removes the signature
    of the one it replaces: it would sign nothing there."""
    certificate = Certificate.read(signed)
    certificate.signature = None
    write(certificate, signed)
    assert not (signed / SIGNATURE).exists()
    done = _cli("validate", str(signed), "--verify")
    assert done.exit_code == 0, done.output
    assert "unsigned" in done.stdout


# --------------------------------------------------------------------------- tampering


def _weights_byte(out: Path) -> str:
    shard = sorted(out.glob(f"model.{VARIANT}*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    return f"{shard.name}: changed since certification"


def _edited_certificate(out: Path) -> str:
    """One metric value made prettier, the card rendered again from it: every hash still
    matches, so only the signature tells."""
    data = json.loads((out / CERTIFICATE).read_text())
    series = next(s for s in data["metrics"]["series"] if s["metric"] == "cosine")
    series["value"][0] = 1.0
    (out / CERTIFICATE).write_text(json.dumps(data, indent=2) + "\n")
    write_card(Certificate.from_dict(data), out)
    return f"{SIGNATURE}: {CERTIFICATE} changed since signing"


def _weights_and_hashes(out: Path) -> str:
    """Weights changed, their hash in the certificate recomputed and the card rendered again."""
    shard = sorted(out.glob(f"model.{VARIANT}*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    certificate = Certificate.read(out)
    certificate.files[shard.name] = hashlib.sha256(bytes(data)).hexdigest()
    (out / CERTIFICATE).write_text(json.dumps(certificate.to_dict(), indent=2) + "\n")
    write_card(certificate, out)
    return f"{SIGNATURE}: {shard.name}, {CERTIFICATE} changed since signing"


def _stripped_signature(out: Path) -> str:
    (out / SIGNATURE).unlink()
    return f"{SIGNATURE}: missing (the certificate lists it as its signature)"


def _stripped_signature_and_its_record(out: Path) -> str:
    (out / SIGNATURE).unlink()
    certificate = Certificate.read(out)
    certificate.signature = None
    (out / CERTIFICATE).write_text(json.dumps(certificate.to_dict(), indent=2) + "\n")
    write_card(certificate, out)
    return f"{CERTIFICATE}: not signed, and --public-key requires a signature"


def _altered_signature(out: Path) -> str:
    bundle = json.loads((out / SIGNATURE).read_bytes())
    raw = bytearray(base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"]))
    raw[-1] ^= 0x01
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(raw)).decode()
    (out / SIGNATURE).write_text(json.dumps(bundle))
    return f"{SIGNATURE}: does not verify with the key"


TAMPERS = [
    _weights_byte,
    _edited_certificate,
    _weights_and_hashes,
    _stripped_signature,
    _stripped_signature_and_its_record,
    _altered_signature,
]


@needs_signing
@pytest.mark.parametrize("tamper", TAMPERS, ids=[t.__name__[1:] for t in TAMPERS])
def test_a_change_fails_under_the_public_key(
    tamper: Callable[[Path], str], signed: Path, keys: Keys
) -> None:
    why = tamper(signed)
    done = _cli("validate", str(signed), "--verify", "--public-key", str(keys.public))
    _one_line_error(done, 1, "not as certified", why)


@needs_signing
def test_without_a_key_only_accidents_show(signed: Path, keys: Keys) -> None:
    """What an unsigned check proves: integrity against accidental change. An edit that
    recomputes the hashes and the card passes plain ``--verify``; only the key tells."""
    _edited_certificate(signed)
    plain = _cli("validate", str(signed), "--verify")
    assert plain.exit_code == 0, plain.output
    assert f"signed: {SIGNATURE} (by the public key sha256:{keys.fingerprint}" in plain.stdout
    assert "--public-key FILE checks it" in plain.stdout


@needs_signing
def test_plain_verify_reports_whether_a_signature_is_there(
    unsigned: Path, keys: Keys, served: Served
) -> None:
    done = _cli("validate", str(unsigned), "--verify", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["signature"] is None
    text = _cli("validate", str(unsigned), "--verify")
    assert "unsigned: the hashes show accidental change, not who wrote the files" in text.stdout
    required = _cli("validate", str(unsigned), "--verify", "--public-key", str(keys.public))
    _one_line_error(required, 1, f"{CERTIFICATE}: not signed")

    # A signature the certificate does not list is an extra file, like any other.
    signed_copy = unsigned.parent / "signed"
    shutil.copytree(unsigned, signed_copy)
    assert (
        _cli("validate", str(signed_copy), "--verify", "--sign", str(keys.private)).exit_code == 0
    )
    shutil.copy(signed_copy / SIGNATURE, unsigned / SIGNATURE)
    stray = _cli("validate", str(unsigned), "--verify")
    _one_line_error(stray, 1, f"{SIGNATURE}: not covered by the certificate")


# --------------------------------------------------------------------------- keys


def _rsa_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _encrypted_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    encryption = serialization.BestAvailableEncryption(b"secret")
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )


@needs_signing
@pytest.mark.parametrize(
    ("flag", "make", "fragment"),
    [
        ("--sign", None, "cannot read the key"),
        ("--public-key", None, "cannot read the key"),
        ("--sign", lambda p: p.write_text("not a key\n"), "not a PEM private key"),
        ("--sign", _rsa_key, "not an elliptic-curve key"),
        ("--sign", _encrypted_key, "the private key is encrypted"),
        ("--public-key", lambda p: p.write_text("not a key\n"), "not a PEM public key"),
    ],
    ids=["missing", "missing-public", "garbage", "rsa", "encrypted", "garbage-public"],
)
def test_an_unusable_key_is_one_line_before_anything_runs(
    signed: Path, tmp_path: Path, flag: str, make: Callable[[Path], None] | None, fragment: str
) -> None:
    key = tmp_path / "key.pem"
    if make is not None:
        make(key)
    before = {p.name: p.read_bytes() for p in signed.iterdir()}
    done = _cli("validate", str(signed), "--verify", flag, str(key))
    _one_line_error(done, 2, str(key), fragment)
    assert {p.name: p.read_bytes() for p in signed.iterdir()} == before


def test_without_the_extra_the_command_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "model_signing", None)  # the import fails, as uninstalled
    for flag in ("--sign", "--public-key"):
        done = _cli("validate", str(tmp_path), "--verify", flag, str(tmp_path / "key.pem"))
        _one_line_error(done, 2, "model-signing", 'pip install "precision-convert[signing]"')


def test_public_key_needs_verify(tmp_path: Path) -> None:
    done = _cli("validate", str(tmp_path), "--public-key", str(tmp_path / "key.pub"))
    _one_line_error(done, 2, "--public-key checks a signature: use it with --verify")


# --------------------------------------------------------------------------- push


@needs_signing
def test_push_uploads_the_signature_to_a_new_repo(
    signed: Path, keys: Keys, hub: FakeHub, tmp_path: Path
) -> None:
    from huggingface_hub import snapshot_download

    done = _cli("push", str(signed), "ns/tiny-signed")
    assert done.exit_code == 0, done.output
    pushed = hub.files("ns/tiny-signed")
    assert pushed[SIGNATURE] == (signed / SIGNATURE).read_bytes()
    repo = hub.repos["ns/tiny-signed"]
    assert keys.fingerprint in repo.messages[repo.refs["main"]][1]  # the commit's description
    # Whoever downloads the repo verifies it with model-signing's own verifier.
    snapshot = Path(snapshot_download("ns/tiny-signed", local_dir=tmp_path / "download"))
    _model_signing_verifies(snapshot, snapshot / SIGNATURE, keys.public)


@needs_signing
def test_a_variant_pr_carries_its_signature(
    signed: Path, keys: Keys, hub: FakeHub, tmp_path: Path
) -> None:
    from huggingface_hub import snapshot_download

    done = _cli("push", str(signed), SOURCE_REPO)
    assert done.exit_code == 0, done.output
    number = int(done.stdout.strip().rsplit("/", 1)[1])
    revision = f"refs/pr/{number}"
    files = hub.files(SOURCE_REPO, revision)
    assert files[SIGNATURE] == (signed / SIGNATURE).read_bytes()
    assert CERTIFICATE in files
    snapshot = Path(
        snapshot_download(SOURCE_REPO, revision=revision, local_dir=tmp_path / "download")
    )
    _model_signing_verifies(snapshot, snapshot / SIGNATURE, keys.public)


@needs_signing
def test_an_unsigned_push_removes_the_signature_an_earlier_one_left(
    signed: Path, served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    """A signature of another certificate must not stay beside the new one."""
    assert _cli("push", str(signed), "ns/tiny-resigned").exit_code == 0
    assert SIGNATURE in hub.files("ns/tiny-resigned")
    plain = tmp_path / "plain"
    shutil.copytree(served.output, plain)
    done = _cli("push", str(plain), "ns/tiny-resigned")
    assert done.exit_code == 0, done.output
    assert "1 stale files removed" in done.stderr
    assert SIGNATURE not in hub.files("ns/tiny-resigned")


@needs_signing
def test_push_sign_signs_before_the_upload(unsigned: Path, keys: Keys, hub: FakeHub) -> None:
    done = _cli("push", str(unsigned), "ns/tiny-push-signed", "--sign", str(keys.private))
    assert done.exit_code == 0, done.output
    assert f"signed: {SIGNATURE} with the key sha256:{keys.fingerprint}" in done.stderr
    assert hub.files("ns/tiny-push-signed")[SIGNATURE] == (unsigned / SIGNATURE).read_bytes()
    again = _cli("push", str(unsigned), "ns/tiny-push-signed", "--sign", str(keys.private))
    assert again.exit_code == 0, again.output
    assert "nothing to push" in again.stderr


@needs_signing
@pytest.mark.parametrize(
    "tamper", [_stripped_signature, _weights_byte], ids=["stripped", "weights"]
)
def test_the_gate_refuses_a_broken_signed_output(
    tamper: Callable[[Path], str], signed: Path, keys: Keys, hub: FakeHub
) -> None:
    why = tamper(signed)
    for sign in ([], ["--sign", str(keys.private)]):
        done = _cli("push", str(signed), "ns/refused", *sign)
        _one_line_error(done, 1, "push refused, nothing uploaded", why)
        assert hub.requests == []
