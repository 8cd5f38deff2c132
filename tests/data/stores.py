"""Helpers for model store tests: a tiny GGUF, a byte-counting wrapper, a running store."""

from __future__ import annotations

import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.data.settings import DataSettings

MODEL_ID = "smollm2-135m-instruct"
TINY_ID = "tiny"
ADMIN_KEY = "sk-test-admin"
READ_KEY = "sk-test-read"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

N_EMBD = 32
N_FF = 64
N_VOCAB = 16


def write_tiny_gguf(path: Path, n_blocks: int = 3) -> None:
    """A tiny llama GGUF: F32 tensors, a ``rope_freqs`` shared by all layers, untied output."""
    rng = np.random.default_rng(1)

    def array(*shape: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        return rng.standard_normal(shape).astype(np.float32)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_block_count(n_blocks)
    writer.add_context_length(128)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(N_VOCAB)])
    writer.add_tensor("token_embd.weight", array(N_VOCAB, N_EMBD))
    writer.add_tensor("rope_freqs.weight", array(5))  # 20 bytes: padding follows
    for i in range(n_blocks):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", array(N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_q.weight", array(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", array(N_EMBD, N_FF))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", array(3))  # 12 bytes: padding follows
    writer.add_tensor("output_norm.weight", array(N_EMBD))
    writer.add_tensor("output.weight", array(N_VOCAB, N_EMBD))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:  # another file system, or no hardlinks: a copy serves as well
        shutil.copyfile(source, dest)


class BodyBytes:
    """ASGI wrapper counting the file bytes the store sends (``.../file`` response bodies)
    and those it receives (upload request bodies)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.sent = 0
        self.received = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/api/v1/storage/upload"):

            async def receiving() -> Message:
                message = await receive()
                if message["type"] == "http.request":
                    self.received += len(message.get("body", b""))
                return message

            await self.app(scope, receiving, send)
            return
        if scope["type"] != "http" or not scope["path"].endswith("/file"):
            await self.app(scope, receive, send)
            return

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.body":
                self.sent += len(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, counting)


@dataclass
class StoreServer:
    url: str
    storage: Path
    settings: DataSettings
    body: BodyBytes
    client: httpx.AsyncClient = field(repr=False)

    def files(self) -> set[str]:
        return set(os.listdir(self.storage))


StartStore = Callable[..., Awaitable[StoreServer]]
