"""Publishing a converted directory to the Hugging Face Hub: only what its certificate covers.

:func:`push` (``pc.push``, ``precision-convert push``, ``model … --push``) runs in two stages:

1. **The gate** (:func:`check`: the one verifier,
   :func:`~precision_convert.validation.certify.verify.verify`, that ``batch --resume`` and
   ``validate --verify`` use too), local and offline. It reads the certificate
   (``precision_certificate.json``, or ``precision_certificate.<variant>.json`` for an output
   written with ``--variant``), hashes every file it is about to upload — the bytes, never a
   name such as a Hub-cache blob's — and refuses
   (:class:`~precision_convert.core.errors.PushRefused`, exit 1) unless the verdict is ``pass``
   and every file matches: each changed, missing or extra file is named. The card
   (``README.md``) is regenerated from the certificate and must be identical, so a hand-edited
   card is refused too. Nothing is sent when the gate refuses.
2. **The upload**, through ``huggingface_hub.HfApi`` in one of two shapes:

   - *new repo*: ``create_repo(exist_ok=True)`` and one commit holding every file (on the
     branch, or in a pull request with ``create_pr``);
   - *variant PR*: when the output was written with ``--variant`` and ``repo_id`` is the source
     repo its certificate records, a pull request adding only the variant-named weights and
     ``precision_certificate.<variant>.json`` (the source's own weights, configs and card are
     never touched), with the parity summary and the card in its description.

   What is uploaded is exactly what the gate hashed: files up to a block (8 MiB) are read once
   and sent from memory; larger ones are read again through :class:`CertifiedReader`, which
   checks every block against the digest the gate took of it before handing it to the client,
   so a file changed in between is refused (nothing committed, its new bytes never sent).
   Streams take the Hub's HTTP (LFS) upload path rather than Xet's, which would read the file
   itself, outside this check.

   The commit names the branch head it was built on (``parent_commit``), so a branch that moves
   meanwhile is an error rather than an overwrite. An open pull request with the same title by
   the same user is updated instead of opening another; ``revision="refs/pr/N"`` commits into
   open pull request N, as huggingface_hub takes it. Uploads go through huggingface_hub's
   preupload and LFS machinery: the Hub reports the objects it already holds and the client
   skips them, so a push that was interrupted uploads only what is missing when run again; the
   client retries 429 and 5xx answers itself, after the wait the Hub asks for (which the
   command bounds, see :mod:`precision_convert.core.hub_client`).

The token comes from the ``token`` argument, ``HF_TOKEN`` or the user's login, is handed only to
``HfApi``, and is scrubbed from every message this module produces. Errors surface as this
project's: :class:`~precision_convert.core.errors.HubAuthError` (missing or rejected token),
:class:`~precision_convert.core.errors.HubPermissionError` (403, with the hint that fits the token,
the namespace and the step), ``InputError`` (bad repo id, a revision that is neither a branch
nor an open pull request), :class:`~precision_convert.core.errors.PushFailed` (the Hub did not
complete the push) — each one line. :func:`check_write_access` asks the same of a token before
a batch runs anything that would end in pushes.
"""

from precision_convert.hub.errors import check_write_access
from precision_convert.hub.publish import PushResult, check, push, push_with_result

__all__ = ["PushResult", "check", "check_write_access", "push", "push_with_result"]
