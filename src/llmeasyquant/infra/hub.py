"""Fast answers about the Hugging Face hub, so that an offline machine costs seconds, not minutes of retries."""

from __future__ import annotations

import functools
import logging
import os
import socket
from urllib.parse import urlparse

log = logging.getLogger(__name__)


@functools.cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the hub's host accepts a TCP connection within `timeout` seconds (and offline mode is off)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError as exc:
        log.info("the Hugging Face hub (%s) is not reachable: %s", host, exc)
        return False
