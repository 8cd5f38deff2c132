"""FAKE stand-ins for outside services that tests cannot reach (see each module's docstring)."""

from pathlib import Path

NVIDIA_DRIVER = Path(__file__).parent / "nvidia_driver"
"""A folder with a FAKE ``nvidia-smi`` (recorded outputs of an H100 machine); put it first on
PATH (see the script)."""
