"""tests/engine: the tiny-model / workload modules beside the tests, the emulation under tests/support."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
