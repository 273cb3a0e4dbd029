"""Servers to bench: a name, a base URL, and what their /v1/models says."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

import httpx


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str  # without /v1
    api_key: str | None = None


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_model_len: int | None


def parse_target(spec: str, api_key: str | None) -> Target:
    """A `NAME=URL` option value."""
    name, sep, url = spec.partition("=")
    if not sep or not name or not url:
        raise ValueError(f"--target wants NAME=URL, got {spec!r}")
    return Target(name, normalize_url(url), api_key)


def normalize_url(url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all name the same server."""
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1")
    if urlparse(url).scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url


def url_name(url: str) -> str:
    return urlparse(url).netloc or url


def served_model(target: Target, timeout_s: float = 30.0) -> ServedModel:
    """The first model the target lists, with its `max_model_len` when it gives one."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        resp = httpx.get(target.base_url + "/v1/models", headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        cards = resp.json()["data"]
        card = cards[0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"{target.name}: GET /v1/models failed: {exc}") from exc
    limit = card.get("max_model_len")
    return ServedModel(str(card["id"]), int(limit) if isinstance(limit, int) else None)
