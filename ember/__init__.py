"""Ember: a self-hosted, long-running AI agent runtime."""

__version__ = "0.1.0"
