"""Memory of attention's forward and backward on XLA: torch_xla's own
``F.scaled_dot_product_attention`` against octfw's query-blocked attention
(:func:`octfw.models.vit3d.blocked_attention`), read from the compiled
program's buffer assignment.

torch_xla lowers SDPA to matmul, softmax, matmul, and its autograd keeps the
``[B, heads, N, N]`` probabilities for the backward pass. The blocked
attention keeps a log-sum-exp per query and recomputes one block of
``[B, heads, block, N]`` at a time. For each size one graph holds the
forward and the backward of one attention call (gradients of q, k and v
as its outputs); XLA dumps the compiled module with its memory-usage
report, whose "Total bytes used" is the peak its buffer assignment
plans for the program (inputs, outputs and temporaries). No step runs
at the largest sizes: the numbers are the compiler's, not a measured
resident size.

Runs in a process of its own with ``PJRT_DEVICE=CPU`` (torch_xla patches torch
process-wide; XLA_FLAGS must be set before it starts). Prints one line per size
with the ratio and writes ``benchmarks/results/xla_attention_memory.json``.

    python benchmarks/accelerators/xla_attention_memory.py [--sizes 2048:512,4096:512,8192:512,4096:256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import machine, run_subprocess, write_result  # noqa: E402

HEADS, HEAD_DIM = 2, 16
DEFAULT_SIZES = "2048:512,4096:512,8192:512,4096:256"


def attention_program_bytes(attention: Callable, tokens: int, dump: Path, heads: int = HEADS,
                            head_dim: int = HEAD_DIM) -> int:
    """Bytes XLA's buffer assignment plans for one graph: ``attention(q, k, v)`` over
    ``tokens`` tokens (batch 1, float32) and its backward to q, k and v. Call in a process
    whose XLA_FLAGS dump modules into ``dump`` (:func:`octfw.diagnostics.xla_hlo.dump_flags`)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from octfw.diagnostics.xla_hlo import compiled_modules, module_memory_bytes

    device = torch_xla.device()
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, heads, tokens, head_dim, generator=generator).to(device) for _ in range(4))
    torch_xla.sync()  # the inputs as device data: the next graph is the attention's alone
    known = set(compiled_modules(dump))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attention(q, k, v).backward(grad)
    torch_xla.sync()
    xm.wait_device_ops()
    (module,) = [path for path in compiled_modules(dump) if path not in known]
    return module_memory_bytes(module)


def measure(sizes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Worker side: for each (tokens, block), the planned bytes of SDPA and of blocked attention."""
    import torch.nn.functional as F

    from octfw.models.vit3d import blocked_attention

    dump = Path(os.environ["OCTFW_XLA_DUMP"])
    rows, sdpa_bytes = [], {}
    for tokens, block in sizes:
        if tokens not in sdpa_bytes:  # compiled once per size: torch_xla reuses a graph it has compiled
            sdpa_bytes[tokens] = attention_program_bytes(F.scaled_dot_product_attention, tokens, dump)
        sdpa = sdpa_bytes[tokens]
        blocked = attention_program_bytes(lambda q, k, v: blocked_attention(q, k, v, block), tokens, dump)
        rows.append({"tokens": tokens, "block": block, "heads": HEADS, "head_dim": HEAD_DIM,
                     "sdpa_bytes": sdpa, "blocked_bytes": blocked, "ratio": sdpa / blocked,
                     "probabilities_bytes": HEADS * tokens * tokens * 4,
                     "block_bytes": HEADS * block * tokens * 4})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="tokens:block,... (default %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [tuple(int(n) for n in item.split(":")) for item in args.sizes.split(",")]
    if args.worker:
        print(json.dumps(measure(sizes)))
        return
    from octfw.diagnostics.xla_hlo import dump_flags

    with tempfile.TemporaryDirectory() as dump:
        out = run_subprocess([sys.executable, __file__, "--worker", "--sizes", args.sizes],
                             env={"PJRT_DEVICE": "CPU", "XLA_FLAGS": dump_flags(dump), "OCTFW_XLA_DUMP": dump})
    rows = json.loads(out.strip().splitlines()[-1])
    for row in rows:
        print(f"{row['tokens']:>6} tokens, block {row['block']:>4}: SDPA {row['sdpa_bytes'] / 2**20:8.1f} MiB, "
              f"blocked {row['blocked_bytes'] / 2**20:7.1f} MiB, ratio {row['ratio']:.2f} "
              f"(N x N probabilities {row['probabilities_bytes'] / 2**20:.1f} MiB, "
              f"one block {row['block_bytes'] / 2**20:.1f} MiB)")
    path = write_result("xla_attention_memory", {"machine": machine(), "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
