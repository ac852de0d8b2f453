"""Run by tests/test_blocked_attention.py in its own process (torch_xla patches
torch process-wide), with PJRT_DEVICE=CPU. Sets XLA_FLAGS itself, before
torch_xla starts, so that XLA dumps every compiled module with its memory
report into a temporary folder.

On torch_xla's CPU device: octfw's query-blocked attention against
``F.scaled_dot_product_attention`` (output and the gradients of q, k and v)
at 20 tokens in blocks of 8, so the last block is short; octfw's ``Attention``
and a checkpointed ``Block`` on xla, which choose it themselves when the
sequence is longer than ``QUERY_BLOCK`` (lowered to 8 here), against the same
modules on the CPU, and the kernel ``record_attention`` names; and the bytes
XLA's buffer assignment plans for one attention's forward and backward, SDPA
against blocked, at 512 and 1,024 tokens in blocks of 128. Prints one JSON object.
"""

import copy
import json
import os
import sys
import tempfile
from pathlib import Path

DUMP = Path(tempfile.mkdtemp(prefix="octfw-blocked-attention-"))
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP} --xla_dump_hlo_as_text"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402

from octfw.engine.attention import record_attention  # noqa: E402
from octfw.models import vit3d  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "accelerators"))
from xla_attention_memory import attention_program_bytes  # noqa: E402

device = torch_xla.device()


def largest_differences(first, second, relative: bool = False) -> list[float]:
    """Per pair, the largest absolute difference; ``relative``: over the first's largest magnitude."""
    out = []
    for a, b in zip(first, second):
        a, b = a.detach().cpu(), b.detach().cpu()
        out.append(float((a - b).abs().max() / (a.abs().max() if relative else 1.0)))
    return out


def with_gradients(attention, inputs, grad, on):
    q, k, v = (t.detach().to(on).requires_grad_() for t in inputs)
    out = attention(q, k, v)
    out.backward(grad.to(on))
    return [out, q.grad, k.grad, v.grad]


generator = torch.Generator().manual_seed(0)
q, k, v, grad = (torch.randn(2, 3, 20, 8, generator=generator) for _ in range(4))
sdpa = with_gradients(F.scaled_dot_product_attention, (q, k, v), grad, device)
blocked = with_gradients(lambda *t: vit3d.blocked_attention(*t, block=8), (q, k, v), grad, device)
cpu_sdpa = with_gradients(F.scaled_dot_product_attention, (q, k, v), grad, "cpu")


def module_on_xla_against_cpu(module: torch.nn.Module, tokens: torch.Tensor) -> tuple[list[float], set[str]]:
    """Largest differences of the output and every gradient (input, parameters) between
    ``module`` on xla and on the CPU, each relative to its largest magnitude on the CPU
    (parameter gradients sum over 40 tokens), and the kernels record_attention saw on xla."""
    sides = {}
    for on in ("cpu", device):
        copy_ = copy.deepcopy(module).to(on)
        x = tokens.detach().to(on).requires_grad_()
        with record_attention() as record:
            out = copy_(x)
            out.backward(torch.ones_like(out))
        sides[str(on)] = ([out, x.grad] + [p.grad for p in copy_.parameters()], record.kernels)
    (cpu_values, _), (xla_values, xla_kernels) = sides["cpu"], sides[str(device)]
    return largest_differences(cpu_values, xla_values, relative=True), xla_kernels


vit3d.QUERY_BLOCK = 8  # 20 tokens: three query blocks, the last of 4
torch.manual_seed(0)
tokens = torch.randn(2, 20, 24)
attention_module = vit3d.Attention(24, 3)
block_module = vit3d.Block(24, 3, mlp_ratio=2.0)
block_module.checkpoint_activations = True  # torch_xla's checkpoint around the blocked attention
module_differences, module_kernels = module_on_xla_against_cpu(attention_module, tokens)
block_differences, block_kernels = module_on_xla_against_cpu(block_module, tokens)
short_differences, short_kernels = module_on_xla_against_cpu(attention_module, tokens[:, :8])  # one block: SDPA

memory = [{"tokens": n, "block": 128, "probabilities_bytes": 2 * n * n * 4, "block_bytes": 2 * 128 * n * 4,
           "sdpa_bytes": attention_program_bytes(F.scaled_dot_product_attention, n, DUMP),
           "blocked_bytes": attention_program_bytes(lambda *t: vit3d.blocked_attention(*t, block=128), n, DUMP)}
          for n in (512, 1024)]

print(json.dumps({
    "against_sdpa": largest_differences(sdpa, blocked),
    "against_cpu_sdpa": largest_differences(cpu_sdpa, blocked),
    "attention_module": module_differences, "attention_kernels": sorted(module_kernels),
    "checkpointed_block": block_differences, "block_kernels": sorted(block_kernels),
    "one_block_module": short_differences, "one_block_kernels": sorted(short_kernels),
    "memory": memory,
}))
