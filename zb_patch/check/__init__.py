"""Diagnostics: ``zb-patch selftest`` (:mod:`.selftest`) and ``zb-patch doctor --probe`` (:mod:`.probe`).

They start engines, swap vLLM's platform, register fake model architectures and carry planted bugs, so
they live apart from the product: nothing on the activation path (``zb_patch.plugin``, ``zb_patch.versions``
and what they import) imports this package; only the ``zb-patch`` CLI does, inside the command that needs
it (tests/unit/test_check_boundary.py and tests/lifecycle/test_check_boundary.py assert both). The
dependency points one way: diagnostics import the product, never the reverse.

This module imports nothing: a probed worker imports it on the way to the probe's extension class.
"""
