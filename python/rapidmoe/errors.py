"""Exceptions RapidMoE raises for problems a user can fix (bad files, bad arguments).

The CLI prints these as one line; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations


class RapidMoEError(Exception):
    """Base class: a problem with the user's input, explained in the message."""


class ModelFileError(RapidMoEError, ValueError):
    """A model path that is missing, unreadable, truncated, not GGUF, or not the kind of model required."""
