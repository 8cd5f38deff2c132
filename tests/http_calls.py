"""``httpx.get``/``post``/``stream``/… for tests, without an SSL context per call.

``httpx.get(url)`` builds a client and, with it, an SSL context that loads the whole CA bundle:
30–280 ms of CPU per call on these machines (even for a plain ``http://`` URL), while the tests
poll a router every 50 ms beside the processes they start on the same two cores. These
functions take the same arguments (``verify=`` included) and behave as httpx's do, a fresh
client and connection per call (a call that times out closes its connection, as a client that
gives up does; nothing is pooled or kept between calls), but the SSL context for each
``verify`` value is made once.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

Verify = ssl.SSLContext | str | bool


@functools.cache
def _context(verify: str | bool) -> ssl.SSLContext:
    return httpx.create_ssl_context(verify=verify)


def _client(verify: Verify) -> httpx.Client:
    context = verify if isinstance(verify, ssl.SSLContext) else _context(verify)
    return httpx.Client(verify=context)


def request(method: str, url: str, *, verify: Verify = True, **kwargs: Any) -> httpx.Response:
    with _client(verify) as client:
        return client.request(method, url, **kwargs)


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
    with _client(verify) as client, client.stream(method, url, **kwargs) as response:
        yield response
