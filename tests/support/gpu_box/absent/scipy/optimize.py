"""scipy.optimize stand-in (see the package docstring): ``linear_sum_assignment`` is imported by name and only called
by EPLB's FlashLB policy, which the engine runs never use."""

from __future__ import annotations


def linear_sum_assignment(*args, **kwargs):
    raise RuntimeError("scipy stand-in: scipy.optimize.linear_sum_assignment is not available on this machine")


def __getattr__(name: str):
    raise AttributeError(f"scipy stand-in: scipy.optimize.{name} is not available on this machine", name=name)
