"""One layer-segmentation fit with its encoder on torch_xla's CPU device, then the same on the CPU.

Prints one JSON line: where the encoded volumes were kept and where the encoder and the fit ran,
and both fits' mean Dice and selected step (tests/test_layer_segmentation.py reads it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch_xla

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder: its helpers

from test_layer_segmentation import ToyLayers, _encoder, _evaluator  # noqa: E402


def fit(device):
    evaluator = _evaluator(ToyLayers(8), epochs=2, fit_batch_size=2, decoder="linear")
    encoded = evaluator.encode(_encoder(depth=2).to(device), device)
    where = {"inputs": sorted({x.device.type for x in (*encoded.train, *encoded.test, encoded.train_layers)}),
             "encoder": next(encoded.encoder.parameters()).device.type}
    return where, evaluator.score(encoded)


xla_where, on_xla = fit(torch_xla.device())  # first: autograd must meet the XLA device before a CPU backward
_, on_cpu = fit(torch.device("cpu"))
print(json.dumps({"where": xla_where, "mean_dice": {"xla": on_xla["mean_dice"], "cpu": on_cpu["mean_dice"]},
                  "selected_step": {"xla": on_xla["selected_step"], "cpu": on_cpu["selected_step"]}}))
