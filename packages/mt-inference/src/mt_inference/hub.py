"""Whether the Hugging Face hub can be reached, asked once before lm-eval loads a task's
dataset from it: without the hub, `datasets` retries every download with backoff before it
fails. With the hub out of reach, the run reads the datasets' cached copies only (the hub's
own offline settings), and a dataset that is not cached fails at once."""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from urllib.parse import urlsplit

__all__ = ["OFFLINE_VARIABLES", "offline_unless_reachable"]

#: The settings `huggingface_hub` and `datasets` read (once, at import) to stay offline.
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def offline_unless_reachable(environ: MutableMapping[str, str] = os.environ,
                             timeout: float = 5.0) -> str | None:
    """Set :data:`OFFLINE_VARIABLES` in ``environ`` when the hub (``HF_ENDPOINT``, else
    huggingface.co) cannot be reached: its name does not resolve, or nothing answers on its
    port within ``timeout`` seconds. Returns why, for one line to the user; None (``environ``
    unchanged) when it answers, when an offline setting is given already, or behind a proxy
    (which this check cannot see through). Call it before `huggingface_hub` is imported."""
    if any(environ.get(name) for name in (*OFFLINE_VARIABLES, "TRANSFORMERS_OFFLINE")) or \
            any(environ.get(name) for name in _PROXIES):
        return None
    endpoint = environ.get("HF_ENDPOINT") or "https://huggingface.co"
    parts = urlsplit(endpoint)
    host = parts.hostname
    if host is None:
        return None  # not a URL: left for huggingface_hub to say
    try:
        port = parts.port or (80 if parts.scheme == "http" else 443)
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except socket.gaierror as err:
        why = f"{host} does not resolve ({err.strerror or err})"
    except OSError as err:
        why = f"{host}:{port} does not answer ({err.strerror or type(err).__name__})"
    except ValueError as err:  # a port out of range in HF_ENDPOINT
        why = f"HF_ENDPOINT {endpoint!r}: {err}"
    for name in OFFLINE_VARIABLES:
        environ[name] = "1"
    return why
