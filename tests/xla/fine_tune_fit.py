"""One fine-tune fit with its head phase on torch_xla's CPU device, then the same on the CPU.

Prints one JSON line: the XLA result's device, both selected epochs and the largest
difference between their test probabilities (tests/test_fine_tune.py reads it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch_xla

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder: its helpers

from test_fine_tune import _corner_tokens  # noqa: E402

from octfw.plugins.evaluators.fine_tune.algorithm import fine_tune  # noqa: E402


def fit(device):
    encoder, (train_x, train_y), (test_x, _) = _corner_tokens()
    return fine_tune(encoder.to(device), train_x.to(device), train_y, train_x[:8].to(device), train_y[:8],
                     test_x.to(device), 2, blocks=1, epochs=2, batch_size=4, lr=1e-3, num_heads=2, head_epochs=5)


on_xla = fit(torch_xla.device())  # first: autograd must meet the XLA device before a CPU backward
on_cpu = fit(torch.device("cpu"))
print(json.dumps({"device": on_xla.test_probabilities.device.type,
                  "selected_epoch": {"xla": on_xla.selected_epoch, "cpu": on_cpu.selected_epoch},
                  "max_difference": float((on_xla.test_probabilities.cpu() - on_cpu.test_probabilities).abs().max())}))
