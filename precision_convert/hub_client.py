"""A bounded Hub client for a process that owns itself: the command and batch workers.

huggingface_hub's HTTP client waits forever (``timeout=None``, passed on every request): a Hub
that accepts the connection and never answers would hang a download, a listing or a push. It
offers no per-call timeout for its repo look-up and file listing, only a process-wide client
factory (``huggingface_hub.set_client_factory``). So only code that owns its process installs
the bound, through :func:`bound_hub_requests`: the ``precision-convert`` command (from
``cli.main.run``) and the batch worker processes it starts (``batch.job.own_process``). A
library call (``pc.convert``, ``pc.push``) never does: library users configure their own
client, and ``resolve(timeout=...)`` bounds what can be bounded per call.
"""

from __future__ import annotations

import os

#: Seconds a Hub request may go without receiving a byte before it fails (default 60).
HUB_TIMEOUT_VARIABLE = "PRECISION_CONVERT_HUB_TIMEOUT"
#: Long enough for a slow Hub to answer a listing, short enough that a silent one is noticed.
_DEFAULT_SECONDS = 60.0


def bound_hub_requests() -> None:
    """Give huggingface_hub's HTTP client a timeout, for this process (call it only from code
    that owns the process; see the module docstring).

    A request hook replaces a missing timeout with one that bounds each wait for data, not a
    whole transfer, so large files are unaffected; a timeout a caller set is kept. The value
    comes from ``PRECISION_CONVERT_HUB_TIMEOUT`` (seconds; default 60), read now, so worker
    processes inherit the command's.
    """
    try:
        import httpx2
        from huggingface_hub import set_client_factory
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:  # another huggingface_hub generation: keep its own behaviour
        return
    seconds = float(os.environ.get(HUB_TIMEOUT_VARIABLE) or _DEFAULT_SECONDS)
    bounded = httpx2.Timeout(seconds).as_dict()

    def bound(request: httpx2.Request) -> None:
        if not any(request.extensions.get("timeout", {}).values()):
            request.extensions["timeout"] = bounded

    def bounded_client() -> httpx2.Client:
        client = default_client_factory()
        client.event_hooks["request"].append(bound)
        return client

    set_client_factory(bounded_client)
