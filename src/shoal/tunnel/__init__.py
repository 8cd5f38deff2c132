"""Carrying llama.cpp RPC bytes between a head worker and a stage worker through the router.

``handshake`` (the one line a tunnel connection opens with), ``relay`` (moving bytes between
two connected sockets), ``hub`` (the router side: pairs head and stage connections),
``endpoints`` (the worker sides) and ``direct`` (the trusted-LAN mode, which needs no tunnel).
This package imports nothing from ``shoal.router`` or ``shoal.worker``.
"""
