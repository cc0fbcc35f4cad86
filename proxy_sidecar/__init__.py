"""Sidecar proxy between an unchanged harness and its model servers; captures every call."""

__version__ = "0.1.0"
