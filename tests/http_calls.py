"""``httpx.get``/``post``/``stream``/… for tests, on shared clients.

``http_calls.get(url)`` builds a client, and with it an SSL context that loads the whole CA bundle,
on every call: 30–80 ms of CPU each on these machines, and the tests poll a router every
50 ms while its processes start on the same two cores. These functions take the same
arguments (``verify=`` included) and reuse one client per ``verify`` value, with no cookie
jar, so that a call carries nothing an earlier one left behind.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx

Verify = ssl.SSLContext | str | bool

_clients: dict[object, tuple[Verify, httpx.Client]] = {}
_lock = threading.Lock()


def client(verify: Verify = True) -> httpx.Client:
    """The shared client for ``verify`` (a context is told apart by identity)."""
    key: object = id(verify) if isinstance(verify, ssl.SSLContext) else verify
    with _lock:
        found = _clients.get(key)
        if found is None:
            jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
            # The context is kept with its client: its id must not be reused while it is a key.
            found = _clients[key] = (verify, httpx.Client(verify=verify, cookies=jar))
        return found[1]


def request(method: str, url: str, *, verify: Verify = True, **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("timeout", httpx.Timeout(5.0))
    return client(verify).request(method, url, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)


def delete(url: str, **kwargs: Any) -> httpx.Response:
    return request("DELETE", url, **kwargs)


@contextmanager
def stream(
    method: str, url: str, *, verify: Verify = True, **kwargs: Any
) -> Iterator[httpx.Response]:
    kwargs.setdefault("timeout", httpx.Timeout(5.0))
    with client(verify).stream(method, url, **kwargs) as response:
        yield response
