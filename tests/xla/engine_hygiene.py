"""Run by tests/test_xla_engine.py in its own process (torch_xla patches torch
process-wide): the real engine on the XLA CPU device, with the compile and
device-to-host transfer counters taken before every update step, printed as
JSON. The counting lives in octfw.diagnostics.xla_counters, shared with
benchmarks/engine/xla_hygiene.py."""

import json
import sys
from pathlib import Path

from octfw.diagnostics.xla_counters import counted_run

print(json.dumps(counted_run(Path(sys.argv[1]), int(sys.argv[2]), log_every=10)))
