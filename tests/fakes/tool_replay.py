"""A FAKE of the vendor tools (nvidia-smi, amd-smi, rocm-smi, system_profiler, sysctl,
vulkaninfo): recorded outputs (``tests/hardware/fixtures/``, sources in its SOURCES.md),
looked up by the whole command line.

``Replay`` is one table of recordings, used two ways:

* In process, as ``shoal.hardware``'s injectable ``CommandRunner``: it answers each command
  line it has a recording for and treats every other command as not installed, as
  ``detect.run_tool`` does for a missing binary (``run_tool`` itself is tested against real
  processes).
* For a real process (``shoal doctor``, a worker) that runs the tools itself: ``on_path``
  writes one executable per tool into a folder to put first on its PATH. Each answers the
  command lines recorded for it (stdout, stderr, exit status) and fails (status 1, saying so
  on stderr) for any other: there the tool is installed, it just has no recording for that
  command line.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from shoal.hardware import nvidia
from shoal.hardware.detect import ToolResult

FIXTURES = Path(__file__).parents[1] / "hardware" / "fixtures"

Command = tuple[str, ...]


def recorded(name: str) -> str:
    """A recorded output in ``tests/hardware/fixtures/``."""
    return (FIXTURES / name).read_text(encoding="utf-8")


class Replay:
    """FAKE command runner: recorded outputs for known command lines, None for the rest."""

    def __init__(self, outputs: dict[Command, ToolResult | str]) -> None:
        self.outputs = {
            k: ToolResult(0, v) if isinstance(v, str) else v for k, v in outputs.items()
        }
        self.calls: list[Command] = []

    def __call__(self, argv: Sequence[str]) -> ToolResult | None:
        self.calls.append(tuple(argv))
        return self.outputs.get(tuple(argv))

    def on_path(self, folder: Path) -> Path:
        """Writes the tools into ``folder`` (created) and returns it, to go first on PATH."""
        folder.mkdir(parents=True, exist_ok=True)
        for tool in sorted({argv[0] for argv in self.outputs}):
            commands = [(argv, r) for argv, r in self.outputs.items() if argv[0] == tool]
            script = folder / tool
            script.write_text(_script(tool, commands, folder), encoding="utf-8")
            script.chmod(0o755)
        return folder


def _script(tool: str, commands: list[tuple[Command, ToolResult]], folder: Path) -> str:
    cases = []
    for n, (argv, result) in enumerate(commands):
        out, err = folder / f".{tool}.{n}.stdout", folder / f".{tool}.{n}.stderr"
        out.write_text(result.stdout, encoding="utf-8")
        err.write_text(result.stderr, encoding="utf-8")
        cases.append(
            f"  {shlex.quote(' '.join(argv[1:]))}) cat {shlex.quote(str(out))};"
            f" cat {shlex.quote(str(err))} >&2; exit {result.returncode} ;;"
        )
    unknown = shlex.quote(f"FAKE {tool}: no recording for this command line:")
    return "\n".join(
        [
            "#!/bin/sh",
            f"# FAKE {tool}, written by tests/fakes/tool_replay.py: recorded outputs.",
            'case "$*" in',
            *cases,
            f'  *) echo {unknown} "$*" >&2; exit 1 ;;',
            "esac",
            "",
        ]
    )


def nvidia_h100_driver(banner: str = "nvidia_smi_banner_a100x2_580.txt") -> Replay:
    """``nvidia-smi`` of a machine with eight H100s (their recorded query, with the compute
    capability) and the driver in ``banner`` (default: driver 580 with CUDA 13.0, as on the
    machine of issue 25; recorded on another machine, whose GPUs are not read from it). Only
    Shoal's GPU query and the banner are recorded: its free-memory and telemetry queries
    fail, so that machine's memory and telemetry are unknown."""
    return Replay(
        {
            nvidia.smi_command(): recorded("nvidia_smi_compute_cap_h100x8.csv"),
            nvidia.SMI_BANNER: recorded(banner),
        }
    )
