"""zb-patch: zero-bubble async scheduling + speculative decoding for vLLM-Ascend releases that lack it.

Importing this package has no side effects. vLLM activates it through the ``vllm.general_plugins`` entry
point (:func:`zb_patch.plugin.register`) when ``ZB_PATCH=1``.
"""

# The one version source: pyproject.toml reads it (tool.setuptools.dynamic), the CLI prints it.
__version__ = "0.1.0.dev0"
