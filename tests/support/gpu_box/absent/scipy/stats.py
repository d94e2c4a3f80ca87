"""scipy.stats stand-in (see the package docstring): imported by name, never used on the engine path."""

from __future__ import annotations


def __getattr__(name: str):
    raise AttributeError(f"scipy stand-in: scipy.stats.{name} is not available on this machine", name=name)
