"""pytest glue for the kernel tests; the shared helpers live in kernel_env.py."""

from kernel_env import dev  # noqa: F401  (fixture)
