"""The engine self-test (``zb-patch selftest --engine``): tokens generated through the installed vLLM /
vllm-ascend engine with a tiny locally built model, without and with zb-patch, compared per request.

:mod:`.model` writes the tiny target + draft, :mod:`.workload` holds the workload and the comparison of results,
:mod:`.child` runs one configuration in one process, :mod:`.run` runs them all and gives the verdict.
"""
