"""Where llama-server put a model, read from its load log (pure).

With ``--rpc`` and ``-lv 4`` the pinned build logs, while it loads, each device it uses (in
``--device`` order) and each buffer it allocates::

    llama_prepare_model_devices: using device CUDA0 (NVIDIA H100) (0000:...) - 80000 MiB free
    llama_prepare_model_devices: using device RPC0 (127.0.0.1:50161) (unknown id) - 24105 MiB free
    load_tensors:   CPU_Mapped model buffer size =    92.10 MiB
    load_tensors:        CUDA0 model buffer size =    33.90 MiB
    load_tensors: RPC0[127.0.0.1:50161] model buffer size =    23.25 MiB
    llama_kv_cache:        CPU KV buffer size =    15.00 MiB
    llama_kv_cache: RPC0[127.0.0.1:50161] KV buffer size =    16.50 MiB
    sched_reserve:        CUDA0 compute buffer size =    12.30 MiB

An RPC device is named ``RPC<k>`` by one counter across every ``--rpc`` server
(``ggml_backend_rpc_add_server``), and described by its server's address; its buffers are
labelled ``RPC<i>[address]`` with ``i`` the device's index *on that server* (so every
server's first device reads ``RPC0[...]``): the address and that index name the device.
Host memory shows as ``CPU``, ``CPU_Mapped``, ``CPU_REPACK`` or a GPU backend's pinned
``CUDA_Host``: all the head's RAM. The KV buffer of a device is proportional to the layers
it holds, which is how the placement is checked against the plan. At the default verbosity
none of these lines are printed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIB = 1024 * 1024
CPU = "CPU"

_USING = re.compile(r"using device (\S+) \((.*)\) \([^()]*\) - \d+ MiB free")
_BUFFER = re.compile(r":\s+(\S+?) (model|KV|RS|compute) buffer size =\s+([\d.]+) MiB")
_RPC_LABEL = re.compile(r"^RPC(\d+)\[([^\]]+)\]$")
_RPC_NAME = re.compile(r"^RPC(\d+)$")


@dataclass(frozen=True, slots=True)
class DeviceLoad:
    device: str
    """``CPU`` (the head's own memory), one of the head's GPUs (``CUDA0``) or ``RPC<k>``."""
    address: str | None
    """An RPC device's server."""
    model_bytes: int
    kv_bytes: int
    compute_bytes: int = 0


@dataclass
class _Buffers:
    model: float = 0.0
    kv: float = 0.0
    compute: float = 0.0

    def add(self, kind: str, mib: float) -> None:
        if kind == "model":
            self.model += mib
        elif kind in ("KV", "RS"):  # a recurrent model's state is its cache
            self.kv += mib
        else:  # a reserve logged again replaces the last
            self.compute = mib


def placement(lines: Iterable[str], rpc: Sequence[str]) -> list[DeviceLoad]:
    """Per device, the model, KV and compute bytes the log reports; ``rpc`` is the
    ``--rpc`` list. The head's CPU comes first, then the devices in the order it used them,
    then any other label a buffer was logged under.

    Raises ``ValueError`` when an RPC server of ``rpc`` is not among the devices llama-server
    used (it carries on without a server it could not reach, which must not pass unnoticed).
    """
    used: list[tuple[str, str]] = []  # (name, description), in llama.cpp's order
    buffers: dict[str, _Buffers] = {}
    labels: list[tuple[str, str, float]] = []
    for line in lines:
        if m := _USING.search(line):
            used.append((m.group(1), m.group(2)))
        elif m := _BUFFER.search(line):
            labels.append((m.group(1), m.group(2), float(m.group(3))))
    addresses = {description for name, description in used if _RPC_NAME.match(name)}
    missing = [address for address in rpc if address not in addresses]
    if missing:
        raise ValueError(
            f"llama-server did not use the RPC server(s) {', '.join(missing)}: it could not "
            "reach them, or they run another llama.cpp build"
        )
    names = _rpc_names(used)
    for label, kind, mib in labels:
        buffers.setdefault(_device(label, names), _Buffers()).add(kind, mib)
    order = [CPU, *(name for name, _ in used)]
    order += [name for name in buffers if name not in order]  # e.g. Metal's MTL0_Mapped
    address = {name: description for name, description in used if _RPC_NAME.match(name)}
    return [
        DeviceLoad(
            name,
            address.get(name),
            _bytes((b := buffers.get(name, _Buffers())).model),
            _bytes(b.kv),
            _bytes(b.compute),
        )
        for name in order
    ]


def _rpc_names(used: list[tuple[str, str]]) -> dict[tuple[str, int], str]:
    """(server address, device index on it) -> llama-server's ``RPC<k>``: a server's
    devices are numbered from its first one (the lowest ``k`` it got)."""
    first: dict[str, int] = {}
    numbers: list[tuple[str, int]] = []
    for name, description in used:
        if m := _RPC_NAME.match(name):
            k = int(m.group(1))
            first[description] = min(k, first.get(description, k))
            numbers.append((description, k))
    return {(address, k - first[address]): f"RPC{k}" for address, k in numbers}


def _device(label: str, rpc: dict[tuple[str, int], str]) -> str:
    """A buffer's label -> the device: ``CPU``, ``CPU_Mapped``, ``CUDA_Host`` -> ``CPU``;
    ``RPC<i>[address]`` -> ``RPC<k>``; a GPU of the head by its own name."""
    if m := _RPC_LABEL.match(label):
        return rpc.get((m.group(2), int(m.group(1))), label)
    return CPU if label.startswith(CPU) or label.endswith("_Host") else label


def _bytes(mib: float) -> int:
    return round(mib * MIB)
