"""``shoal doctor``'s checks: pure functions of what ``doctor.py`` gathered, one per concern.

Each gives a :class:`Check`: ``ok``, ``warn`` or ``error`` (``skip`` when there is nothing to
check), a one-line finding, and, when not ok, the command or step that fixes it. Any error
makes ``shoal doctor`` exit non-zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from shoal.hardware.detect import DEVICE_PREFIX
from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.llama_cpp.backend import INSTALL, BackendChoice, MachineFacts, driver_cuda
from shoal.llama_cpp.binaries import Binaries
from shoal.llama_cpp.coverage import unused_gpus
from shoal.llama_cpp.devices import ComputeDevice
from shoal.models.fit import FitDecision

Status = Literal["ok", "warn", "error", "skip"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    finding: str
    fix: str | None = None
    details: tuple[str, ...] = field(default=())

    def json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "status": self.status,
            "finding": self.finding,
            "fix": self.fix,
            "details": list(self.details),
        }


def _gpu_names(gpus: Sequence[GpuDevice]) -> str:
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.name] = counts.get(g.name, 0) + 1
    return ", ".join(f"{n}x {name}" if n > 1 else name for name, n in counts.items())


def gpus_check(facts: MachineFacts) -> Check:
    """The GPUs found, with their driver (NVIDIA: its version and the CUDA it supports)."""
    toolkit = (f"CUDA toolkit: nvcc {facts.nvcc}",) if facts.nvcc else ()
    if not facts.gpus:
        return Check("gpus", "ok", "no GPU: models run on the CPU", details=toolkit)
    groups: dict[tuple[str, str], list[str]] = {}
    for g in facts.gpus:
        groups.setdefault((g.name, g.accelerator.value), []).append(str(g.index))
    details = [f"GPU {', '.join(i)}: {name} ({kind})" for (name, kind), i in groups.items()]
    nvidia = tuple(g for g in facts.gpus if g.accelerator is Accelerator.CUDA)
    finding = _gpu_names(facts.gpus)
    if nvidia:
        version, said = driver_cuda(nvidia)
        driver = next((g.driver for g in nvidia if g.driver), "")
        finding += f"; NVIDIA driver {driver or '(version unknown)'}: {said}"
        caps = sorted({g.compute_capability for g in nvidia if g.compute_capability})
        details.append(f"compute capability {', '.join(caps) or 'unknown'}")
        if version is None:
            return Check("gpus", "warn", finding, "check that `nvidia-smi` works", tuple(details))
    return Check("gpus", "ok", finding, details=(*details, *toolkit))


def backend_check(choice: BackendChoice, assets: Sequence[str]) -> Check:
    """The backend ``auto`` (or the flag) chose, why, and how it is got: ``assets`` are the
    release files it would download."""
    details = list(choice.reasons)
    if assets and choice.no_release is None:
        details.append("release: " + " + ".join(assets))
    if choice.build_flags or choice.no_build is None:
        details.append("a build from source adds: " + (" ".join(choice.build_flags) or "nothing"))
    if choice.no_build is not None:
        details.append(f"no build from source: {choice.no_build}")
    how = "given with --llama-cpp-backend" if choice.asked else "chosen for this machine"
    finding = f"{choice.backend}, {how}"
    if choice.idle_gpus is not None:
        finding += ", which leaves the GPUs unused"
        return Check("backend", "error", finding, choice.idle_gpus, tuple(details))
    return Check("backend", "ok", finding, details=tuple(details))


def binary_check(
    found: Binaries | str,
    listed: Sequence[ComputeDevice] | str,
    gpus: Sequence[GpuDevice],
    choice: BackendChoice | None,
) -> Check:
    """The llama-server that would run and whether it drives the GPUs here. ``found`` and
    ``listed`` are, each, what was found or why nothing was."""
    if isinstance(found, str):
        return Check(
            "llama.cpp",
            "warn",
            f"no llama-server yet: {found.splitlines()[0]}",
            f"`shoal worker` gets it at start; to get it now, run `{INSTALL}`",
        )
    where = f"{found.llama_server} ({found.reason})"
    if isinstance(listed, str):
        return Check("llama.cpp", "error", f"{where} does not run: {listed}", f"run `{INSTALL}`")
    details = tuple(f"{d.name}: {d.description}" for d in listed) or ("no GPU device",)
    unused = unused_gpus(gpus, listed, found, choice)
    if unused is not None:
        finding = f"{where} is a CPU build: it drives none of the GPUs here"
        return Check("llama.cpp", "error", finding, unused.split("To fix: ", 1)[-1], details)
    return _kind_check(where, listed, gpus, choice, details)


def _kind_check(
    where: str,
    listed: Sequence[ComputeDevice],
    gpus: Sequence[GpuDevice],
    choice: BackendChoice | None,
    details: tuple[str, ...],
) -> Check:
    if not gpus:
        return Check("llama.cpp", "ok", f"{where}, on the CPU", details=details)
    drives = f"{where} drives {', '.join(d.name for d in listed)}"
    prefix = DEVICE_PREFIX.get(Accelerator(choice.backend)) if choice is not None else None
    if prefix is not None and not any(d.name.startswith(prefix) for d in listed):
        fix = f"run `{INSTALL} --llama-cpp-backend {choice.backend if choice else ''}`"
        return Check("llama.cpp", "warn", f"{drives}, not {prefix}", fix, details)
    if len(listed) < len(gpus):
        fix = "check CUDA_VISIBLE_DEVICES and the like in the worker's environment"
        return Check(
            "llama.cpp", "warn", f"{drives}: {len(listed)} of {len(gpus)} GPUs", fix, details
        )
    return Check("llama.cpp", "ok", drives, details=details)


def model_check(
    model: str,
    fit: FitDecision | str | None,
    on_cpu_only: bool,
    details: tuple[str, ...] = (),
) -> Check:
    """The model the worker would serve and whether it fits: ``fit`` is the quantization
    decision, why there is none (a model error), or None when it is not estimated here.
    ``on_cpu_only``: llama.cpp here drives none of the GPUs the fit counts on."""
    if isinstance(fit, str):
        finding = f"{model}: {fit.splitlines()[0]}"
        return Check("model", "error", finding, f"see `shoal models show {model}`", details)
    if fit is None:
        return Check("model", "ok", f"{model} (its fit is not estimated here)", details=details)
    finding = f"{model} in {fit.quant.quantization}: {fit.reason}"
    if on_cpu_only and fit.budget.memory == "VRAM":
        fix = "it is sized for the GPUs' VRAM, but llama.cpp runs on the CPU here: fix llama.cpp"
        return Check("model", "warn", finding, fix, details)
    if not fit.fits:
        fix = "choose a smaller model, --quantization or --ctx-size"
        return Check("model", "warn", finding, fix, details)
    return Check("model", "ok", finding, details=details)


def router_check(url: str, answer: str | None, version: str | None) -> Check:
    """The router at ``url``: ``answer`` is None when it accepts this worker's key and
    protocol, else what went wrong; ``version`` the router's Shoal version."""
    if answer is None:
        return Check("router", "ok", f"{url} (Shoal {version or '?'}) accepts this GPU key")
    return Check("router", "error", f"{url}: {answer}", _router_fix(answer))


def _router_fix(answer: str) -> str:
    if "GPU key" in answer:
        return "pass the router's worker key: --gpu-key (SHOAL_GPU_KEY)"
    if "protocol" in answer:
        return "run the same Shoal version on the router and this machine"
    return "check --router-url (SHOAL_ROUTER_URL), that the router runs, and the network"


def no_router_check(why: str) -> Check:
    return Check("router", "skip", f"not checked: {why}")


def summary(checks: Sequence[Check]) -> str:
    errors = sum(c.status == "error" for c in checks)
    warnings = sum(c.status == "warn" for c in checks)
    if errors:
        return f"{errors} error(s), {warnings} warning(s): fix the errors above."
    if warnings:
        return f"no errors, {warnings} warning(s)."
    return "everything checked is in order."
