"""Deciding where models run: which workers hold which layers of a model."""
