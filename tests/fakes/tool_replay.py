"""A FAKE of the vendor tools (nvidia-smi, amd-smi, rocm-smi, system_profiler, sysctl,
vulkaninfo) for ``shoal.hardware``'s injectable ``CommandRunner``.

``Replay`` answers each command line with a recorded output (``tests/hardware/fixtures/``)
and treats every other command as not installed, as ``detect.run_tool`` does for a missing
binary. ``run_tool`` itself is tested against real processes.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.hardware.detect import ToolResult


class Replay:
    """FAKE command runner: recorded outputs for known command lines, None for the rest."""

    def __init__(self, outputs: dict[tuple[str, ...], ToolResult | str]) -> None:
        self.outputs = {
            k: ToolResult(0, v) if isinstance(v, str) else v for k, v in outputs.items()
        }
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> ToolResult | None:
        self.calls.append(tuple(argv))
        return self.outputs.get(tuple(argv))
