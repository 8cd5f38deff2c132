"""What this machine has: CPU, RAM and GPUs, from the vendors' own tools."""
