"""Where llama-server put a model, read from its load log (pure).

With ``--rpc`` and ``-lv 4`` the pinned build logs, while it loads::

    llama_prepare_model_devices: using device RPC0 (127.0.0.1:50161) (unknown id) - 24105 MiB free
    load_tensors:   CPU_Mapped model buffer size =    92.10 MiB
    load_tensors: RPC0[127.0.0.1:50161] model buffer size =    23.25 MiB
    llama_kv_cache:        CPU KV buffer size =    15.00 MiB
    llama_kv_cache: RPC0[127.0.0.1:50161] KV buffer size =    16.50 MiB

The bracketed address, not the device label, names the RPC server (the label repeats
``RPC0`` for every server in this build). The KV buffer of a device is proportional to the
layers it holds, which is how the placement is checked against the plan. At the default
verbosity none of these lines are printed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIB = 1024 * 1024

_USING = re.compile(r"using device (RPC\d+) \(([^)]+)\)")
_MODEL = re.compile(r"load_tensors:\s+(\S+?) model buffer size =\s+([\d.]+) MiB")
_KV = re.compile(r"llama_kv_cache:\s+(\S+?) KV buffer size =\s+([\d.]+) MiB")
_RPC_LABEL = re.compile(r"^RPC\d+\[([^\]]+)\]$")


@dataclass(frozen=True, slots=True)
class DeviceLoad:
    device: str
    """``CPU`` (the head's own memory) or ``RPC<n>``, numbered in ``--rpc`` order."""
    address: str | None
    model_bytes: int
    kv_bytes: int


def placement(lines: Iterable[str], rpc: Sequence[str]) -> list[DeviceLoad]:
    """Per device, the model and KV bytes the log reports; ``rpc`` is the ``--rpc`` list.

    Raises ``ValueError`` when an RPC server of ``rpc`` is not among the devices llama-server
    used (it carries on without a server it could not reach, which must not pass unnoticed).
    """
    used: set[str] = set()
    model: dict[str, float] = {}
    kv: dict[str, float] = {}
    for line in lines:
        if m := _USING.search(line):
            used.add(m.group(2))
        elif m := _MODEL.search(line):
            key = _device_key(m.group(1))
            model[key] = model.get(key, 0.0) + float(m.group(2))
        elif m := _KV.search(line):
            key = _device_key(m.group(1))
            kv[key] = kv.get(key, 0.0) + float(m.group(2))
    missing = [address for address in rpc if address not in used]
    if missing:
        raise ValueError(
            f"llama-server did not use the RPC server(s) {', '.join(missing)}: it could not "
            "reach them, or they run another llama.cpp build"
        )
    devices = [DeviceLoad("CPU", None, _bytes(model.get("CPU", 0)), _bytes(kv.get("CPU", 0)))]
    for index, address in enumerate(rpc):
        devices.append(
            DeviceLoad(
                f"RPC{index}", address, _bytes(model.get(address, 0)), _bytes(kv.get(address, 0))
            )
        )
    return devices


def _device_key(label: str) -> str:
    """``CPU``, ``CPU_Mapped`` -> ``CPU``; ``RPC0[host:port]`` -> ``host:port``."""
    if m := _RPC_LABEL.match(label):
        return m.group(1)
    return "CPU" if label.startswith("CPU") else label


def _bytes(mib: float) -> int:
    return round(mib * MIB)
