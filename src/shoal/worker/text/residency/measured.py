"""What a loaded model holds, as llama-server reported it while loading.

With ``-lv 4`` llama.cpp logs every buffer it allocates, with its device and size
(``shoal.llama_cpp.load_log`` reads them, for split models too)::

    load_tensors:   CPU_Mapped model buffer size =   469.88 MiB
    load_tensors:        CUDA0 model buffer size =  4403.49 MiB
    llama_kv_cache:      CUDA0 KV buffer size =  1024.00 MiB
    sched_reserve:       CUDA0 compute buffer size =   560.00 MiB

Their sum per device is what the model holds: weights, KV cache (or a recurrent model's
state) and compute buffers. Host buffers (``CPU``, ``CPU_Mapped``, ``CUDA_Host``…) are RAM;
``CUDA0``, ``ROCm1``, ``Vulkan0``, ``SYCL0`` are that GPU (llama.cpp numbers them in the
order Shoal's ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` gives, the tools' index); Apple's Metal
(``MTL0``) shares RAM, so it counts as RAM. ``RPC…`` buffers are on another machine.

``footprint_from_log`` reads the lines of one load (``last_load`` cuts a log file that holds
several starts down to the latest).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from shoal.llama_cpp.load_log import placement
from shoal.models.residency import Footprint

_GPU = re.compile(r"(?:CUDA|ROCm|HIP|Vulkan|SYCL|CANN|MUSA|OpenCL)(?P<index>\d+)$")
LOAD_START = "llama_model_loader: loaded meta data"
"""The first line llama.cpp logs for each load of a model file."""


def footprint_from_log(lines: Iterable[str]) -> Footprint | None:
    """The bytes the buffers in ``lines`` hold, in RAM and per GPU (None: no buffer line:
    llama-server logged at less than ``-lv 4``)."""
    ram = 0
    gpus: dict[int, int] = {}
    seen = False
    for device in placement(lines, rpc=()):
        held = device.model_bytes + device.kv_bytes + device.compute_bytes
        seen = seen or held > 0
        if device.device.startswith("RPC"):
            continue
        gpu = _GPU.match(device.device)
        if gpu is not None:
            index = int(gpu["index"])
            gpus[index] = gpus.get(index, 0) + held
        else:  # host memory, and unified memory (Metal)
            ram += held
    if not seen:
        return None
    width = max(gpus, default=-1) + 1
    return Footprint(ram, tuple(gpus.get(i, 0) for i in range(width)))


def last_load(lines: Sequence[str]) -> Sequence[str]:
    """The lines of the latest load in a log that may hold several (each start appends)."""
    for i in range(len(lines) - 1, -1, -1):
        if LOAD_START in lines[i]:
            return lines[i:]
    return lines
