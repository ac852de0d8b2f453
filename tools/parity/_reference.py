"""What the parity tools share: the reference checkouts they run, named by commit.

Each tool runs the reference's own code from a checkout (put on ``sys.path``)
and writes a small fixture under ``tests/fixtures/reference/``; the tests read
the fixture only, so they need neither the network nor the reference code.

A checkout of a repository snapshot (``git archive <commit> | tar -x``) has no
``.git``; the tool then trusts the commit named here, and with ``.git`` it
refuses any other.

The reference's imports beyond octfw's environment (timm, torchvision, einops
for vjepa2's attentive pooler) go into a folder of their own, never octfw's
virtual environment::

    .venv/bin/python -m pip install --target /tmp/refdeps --no-deps \\
        timm torchvision==0.24.0 einops
    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/<tool>.py --vjepa2 /tmp/ref/vjepa2
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "reference"

#: The commits the fixtures were recorded at (the newest stored snapshots, Nov 2026).
REFERENCES = {
    "vjepa2": ("https://github.com/facebookresearch/vjepa2", "c2963a47433ecca0ad4f06ec28bcfa8cb5b5cefb"),
    "jepa": ("https://github.com/facebookresearch/jepa", "51c59d518fc63c08464af6de585f78ac0c7ed4d5"),
    "mae": ("https://github.com/facebookresearch/mae", "efb2a8062c206524e35e47d04501ed4f544c0ae8"),
    "mae_st": ("https://github.com/facebookresearch/mae_st", "c5dec1bc01062097906ea67fe47935ec33fd46df"),
    "videomae": ("https://github.com/MCG-NJU/VideoMAE", "14ef8d856287c94ef1f985fe30f958eb4ec2c55d"),
    "retfound": ("https://github.com/rmaphoh/RETFound_MAE", "897d71c8c9b1d0ca1984370d4c4352722017b80a"),
}


def checkout(name: str, path: str | Path, commit: str | None = None) -> dict[str, str]:
    """Put the checkout of reference ``name`` at ``path`` first on ``sys.path`` and return
    ``{"repo", "commit"}`` for the fixture; refuses a git checkout at another commit."""
    url, expected = REFERENCES[name]
    expected = commit or expected
    root = Path(path).resolve()
    if not root.is_dir():
        raise SystemExit(f"{name}: no checkout at {root}")
    if (root / ".git").exists():
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        if expected and head != expected:
            raise SystemExit(f"{name}: the checkout is at {head}, the fixtures name {expected}")
        expected = head
    if not expected:
        raise SystemExit(f"{name}: name the checkout's commit with --commit")
    sys.path.insert(0, str(root))
    return {"repo": url, "commit": expected}


def run_train_step(root: str | Path, train_py: str, namespace: dict) -> dict:
    """Run the forward part of the reference's own training step from its checkout: the
    functions ``train_step`` defines (``forward_target``, ``forward_context``, ``loss_fn``) and
    the body of its one ``autocast`` block (targets, predictions, loss), taken from the file's
    text at the checkout's commit and executed as written, not copied.

    ``train_step`` is a closure inside the reference's ``main``: what it reads from there
    (the networks, ``clips``, ``masks_enc``, ``masks_pred``, ``loss_exp``, its imports...) comes
    from ``namespace``, which then holds what the block computed (``loss``, ``h``, ``z``...).
    Compiled under the file's name with its own line numbers, so a traceback points into the
    reference. The optimiser and scaler lines around the block are not run."""
    path = Path(root) / train_py
    tree = ast.parse(path.read_text(), filename=str(path))
    steps = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "train_step"]
    if len(steps) != 1:
        raise SystemExit(f"{path}: {len(steps)} functions named train_step, expected one")
    body = steps[0].body
    forward = [node for node in body if isinstance(node, ast.With)
               and any("autocast" in ast.unparse(item.context_expr) for item in node.items)]
    if len(forward) != 1:
        raise SystemExit(f"{path}: train_step has {len(forward)} autocast blocks, expected one")
    code = ast.Module(body=[*(node for node in body if isinstance(node, ast.FunctionDef)), *forward[0].body],
                      type_ignores=[])
    exec(compile(code, str(path), "exec"), namespace)
    return namespace


def write_fixture(filename: str, payload: dict) -> Path:
    """Write ``payload`` as indented JSON (floats in their shortest exact form)."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / filename
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")
    return path
