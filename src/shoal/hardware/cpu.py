"""The CPU fallback: model name and the instruction sets llama.cpp's CPU backend cares about.

Pure parsers of text: ``/proc/cpuinfo`` (Linux x86 ``flags``, Linux ARM ``Features``) and
``sysctl hw machdep`` (macOS: ``machdep.cpu.features``/``leaf7_features`` on Intel,
``hw.optional.*`` on Apple Silicon). Core counts come from psutil in ``detect``; the parsers
only read what the text says.

Feature names are normalised to one lower-case vocabulary (:data:`FEATURE_ORDER`) whatever
the source spells them: Linux says ``pni`` for SSE3 and ``asimddp`` for the dot-product
instructions, macOS says ``AVX1.0`` and ``hw.optional.arm.FEAT_DotProd``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

FEATURE_ORDER = (
    "sse3",
    "ssse3",
    "avx",
    "avx2",
    "f16c",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vbmi",
    "avx512vnni",
    "avx512bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "neon",
    "fp16",
    "dotprod",
    "i8mm",
    "bf16",
    "sve",
    "sve2",
    "sme",
)
"""Every feature this module reports, in the order it reports them."""

_LINUX_FLAGS = {
    # x86 /proc/cpuinfo "flags"
    "pni": "sse3",
    "ssse3": "ssse3",
    "avx": "avx",
    "avx2": "avx2",
    "f16c": "f16c",
    "fma": "fma",
    "avx_vnni": "avx_vnni",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vbmi": "avx512vbmi",
    "avx512_vnni": "avx512vnni",
    "avx512_bf16": "avx512bf16",
    "amx_tile": "amx_tile",
    "amx_int8": "amx_int8",
    "amx_bf16": "amx_bf16",
    # aarch64 /proc/cpuinfo "Features"
    "asimd": "neon",
    "fphp": "fp16",
    "asimdhp": "fp16",
    "asimddp": "dotprod",
    "i8mm": "i8mm",
    "bf16": "bf16",
    "sve": "sve",
    "sve2": "sve2",
    "sme": "sme",
}

_DARWIN_INTEL_FLAGS = {
    "SSE3": "sse3",
    "SSSE3": "ssse3",
    "AVX1.0": "avx",
    "AVX2": "avx2",
    "F16C": "f16c",
    "FMA": "fma",
    "AVX512F": "avx512f",
    "AVX512BW": "avx512bw",
    "AVX512VBMI": "avx512vbmi",
    "AVX512VNNI": "avx512vnni",
}

_DARWIN_ARM_KEYS = {
    "hw.optional.neon": "neon",
    "hw.optional.neon_fp16": "fp16",
    "hw.optional.arm.FEAT_FP16": "fp16",
    "hw.optional.arm.FEAT_DotProd": "dotprod",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16",
    "hw.optional.arm.FEAT_SME": "sme",
}

_ARM_IMPLEMENTERS = {
    "0x41": "ARM",
    "0x42": "Broadcom",
    "0x46": "Fujitsu",
    "0x48": "HiSilicon",
    "0x4e": "NVIDIA",
    "0x51": "Qualcomm",
    "0x61": "Apple",
    "0xc0": "Ampere",
}


def ordered_features(names: Iterable[str]) -> tuple[str, ...]:
    """The known features among ``names``, deduplicated, in :data:`FEATURE_ORDER`."""
    present = set(names)
    return tuple(f for f in FEATURE_ORDER if f in present)


def _first_block(text: str) -> dict[str, str]:
    """The ``key : value`` pairs of the first processor block of ``/proc/cpuinfo``."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _arm_model(fields: Mapping[str, str]) -> str:
    implementer = fields.get("CPU implementer", "").lower()
    part = fields.get("CPU part", "").lower()
    if not implementer:
        return ""
    vendor = _ARM_IMPLEMENTERS.get(implementer, f"implementer {implementer}")
    return f"{vendor} CPU part {part}" if part else f"{vendor} CPU"


def parse_proc_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """``(model, features)`` from Linux ``/proc/cpuinfo``; ``("", ())`` for empty text.

    All processors of a machine report the same flags, so the first block is enough. ARM
    kernels print no model name; the model is then described by implementer and part.
    """
    fields = _first_block(text)
    model = fields.get("model name") or fields.get("Hardware") or _arm_model(fields)
    tokens = (fields.get("flags", "") + " " + fields.get("Features", "")).split()
    return model, ordered_features(_LINUX_FLAGS[t] for t in tokens if t in _LINUX_FLAGS)


def parse_sysctl(text: str) -> dict[str, str]:
    """``name: value`` lines of ``sysctl`` output (``sysctl hw machdep``) as a dict.

    Lines without ``": "`` (wrapped values, error messages) are ignored.
    """
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep and key and " " not in key:
            values[key.strip()] = value.strip()
    return values


def parse_darwin_cpu(sysctl: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """``(model, features)`` from ``sysctl hw machdep`` values (see :func:`parse_sysctl`)."""
    model = sysctl.get("machdep.cpu.brand_string", "")
    tokens = (
        sysctl.get("machdep.cpu.features", "") + " " + sysctl.get("machdep.cpu.leaf7_features", "")
    ).split()
    names = [_DARWIN_INTEL_FLAGS[t] for t in tokens if t in _DARWIN_INTEL_FLAGS]
    names += [name for key, name in _DARWIN_ARM_KEYS.items() if sysctl.get(key) == "1"]
    return model, ordered_features(names)
