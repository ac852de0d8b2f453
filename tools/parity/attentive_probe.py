"""Record V-JEPA 2's attentive classifier's output for fixed random weights and tokens.

Builds facebookresearch/vjepa2's ``src.models.attentive_pooler.AttentiveClassifier``
(the commit in ``_reference.REFERENCES``) at a small size (width 16, 4 heads,
depth 1: one cross-attention block, 3 classes), sets every parameter (the
layer norms and biases included, so each one is checked) to seeded random
values, runs it on seeded random tokens, and saves the state dict, the tokens
and the logits in ``tests/fixtures/reference/attentive_probe.safetensors``
(the module's own key names).

Usage::

    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/attentive_probe.py --vjepa2 /tmp/ref/vjepa2
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import save_file

from _reference import FIXTURES, checkout, write_fixture

WIDTH, HEADS, CLASSES, BATCH, TOKENS = 16, 4, 3, 2, 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vjepa2", required=True, help="a checkout of facebookresearch/vjepa2")
    args = parser.parse_args()
    reference = checkout("vjepa2", args.vjepa2)
    from src.models.attentive_pooler import AttentiveClassifier

    generator = torch.Generator().manual_seed(50)
    classifier = AttentiveClassifier(embed_dim=WIDTH, num_heads=HEADS, depth=1, num_classes=CLASSES).eval()
    with torch.no_grad():
        for value in classifier.state_dict().values():
            value.copy_(0.3 * torch.randn(value.shape, generator=generator))
        tokens = torch.randn(BATCH, TOKENS, WIDTH, generator=generator)
        logits = classifier(tokens)
    tensors = {f"state/{k}": v.contiguous() for k, v in classifier.state_dict().items()}
    tensors.update({"tokens": tokens, "logits": logits})
    path = FIXTURES / "attentive_probe.safetensors"
    FIXTURES.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    path.chmod(0o644)
    write_fixture("attentive_probe.json", {
        "what": "V-JEPA 2's AttentiveClassifier (src/models/attentive_pooler.py) on fixed random weights "
                "and tokens: state dict, tokens and logits in attentive_probe.safetensors; regenerate "
                "with tools/parity/attentive_probe.py",
        "reference": reference,
        "module": {"embed_dim": WIDTH, "num_heads": HEADS, "depth": 1, "num_classes": CLASSES,
                   "mlp_ratio": 4.0, "qkv_bias": True, "complete_block": True},
        "state_keys": sorted(classifier.state_dict()),
    })
    print(json.dumps({k: list(v.shape) for k, v in classifier.state_dict().items()}))


if __name__ == "__main__":
    main()
