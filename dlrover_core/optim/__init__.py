"""Optimizers registered by name; the core registers torch's ``adamw``, ``adam``, ``sgd``."""
