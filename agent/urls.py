"""The server URL: its one grammar (checked by ``AgentConfig``, used by ``http_conn``) and its loggable form.

``urllib.parse`` only, so that the configuration can check a URL without importing ``http.client``.
"""

from __future__ import annotations

import urllib.parse
from typing import NamedTuple

__all__ = ["ServerUrl", "split_server_url", "safe_url"]


class ServerUrl(NamedTuple):
    """``http(s)://host[:port][/prefix]`` taken apart."""

    https: bool
    host: str
    port: int | None
    prefix: str


def split_server_url(url: str) -> ServerUrl:
    """The parts of a server base URL; ``ValueError`` (never naming a password) when it is not one."""
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError:
        raise ValueError(f"server URL must be http(s)://host[:port][/prefix], got {safe_url(url)!r}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"server URL must be http(s)://host[:port][/prefix], got {safe_url(url)!r}")
    return ServerUrl(u.scheme == "https", u.hostname, port, u.path.rstrip("/"))


def safe_url(url: str) -> str:
    """The URL without user:password (never log credentials)."""
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError:
        return "<unparsable URL>"
    netloc = u.hostname or ""
    if port:
        netloc += f":{port}"
    return urllib.parse.urlunsplit((u.scheme, netloc, u.path, "", ""))
