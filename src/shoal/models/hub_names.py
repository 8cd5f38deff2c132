"""What ``--model`` names when it names a Hugging Face GGUF repo: a pure parser.

The forms follow llama.cpp's ``-hf`` and Ollama's ``hf.co/`` names:

- ``org/repo``: the repo's quantization that fits this machine;
- ``org/repo:Q4_K_M``: that quantization (any case; ``:latest`` is the same as none);
- ``org/repo:path/in/repo.gguf``: that file (a split GGUF's first part brings the others);
- any of these after ``hf.co/``, ``huggingface.co/`` or ``https://huggingface.co/``.

A name that ends in ``.gguf`` without a ``:`` is a path on this machine, never a repo, and a
name without a ``/`` is a catalog id; this module says which names are repos (``parse_hub_name``
returns None for the others) and nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shoal.models.errors import ModelError
from shoal.models.gguf_names import GGUF_SUFFIX

HUB_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
LATEST = "latest"
"""Ollama's tag for "the default quantization": here, the one that fits."""
_PATH_STARTS = ("/", "./", "../", "~")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_QUANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class HubName:
    """A GGUF repo on the Hub, and which of its files: a quantization, a file, or the fit's."""

    repo: str
    quantization: str | None = None
    """Upper-case (``Q4_K_M``); None: the one that fits (or the one named by ``file``)."""
    file: str | None = None
    """A ``.gguf`` path inside the repo."""
    text: str = ""
    """The name as given, without its ``hf.co/`` prefix: the id clients send."""

    @property
    def id(self) -> str:
        return self.text or self.repo


def parse_hub_name(text: str) -> HubName | None:
    """The repo ``text`` names, or None when it is a catalog id or a path.

    Raises :class:`ModelError` for a name with a Hub prefix that is not a repo name, or for
    an empty tag (``org/repo:``).
    """
    name = text.strip()
    prefixed = next((p for p in HUB_PREFIXES if name.lower().startswith(p)), None)
    if prefixed is not None:
        name = name[len(prefixed) :]
    elif name.startswith(_PATH_STARTS) or "/" not in name:
        return None
    repo, colon, tag = name.partition(":")
    if prefixed is None and not colon and name.lower().endswith(GGUF_SUFFIX):
        return None  # models/x.gguf: a path
    if _REPO_RE.match(repo) is None or "--" in repo or ".." in repo:
        if prefixed is None:
            return None
        raise ModelError(f"{text!r} does not name a Hugging Face repo: {_FORMS}")
    if colon and not tag:
        raise ModelError(f"{text!r} ends with ':' but names no quantization or file: {_FORMS}")
    if tag.lower().endswith(GGUF_SUFFIX):
        return HubName(repo, file=tag, text=name)
    if not tag or tag.lower() == LATEST:
        return HubName(repo, text=name)
    if _QUANT_RE.match(tag) is None:
        raise ModelError(f"{text!r}: {tag!r} is not a quantization name. {_FORMS}")
    return HubName(repo, quantization=tag.upper(), text=name)


_FORMS = (
    "use org/repo, org/repo:QUANT (e.g. :Q4_K_M) or org/repo:FILE.gguf, optionally after hf.co/."
)
