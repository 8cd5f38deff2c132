"""Shoal: one OpenAI-compatible endpoint over your own GPU machines."""

__version__ = "0.1.0"
