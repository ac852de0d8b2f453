"""octfw's query-blocked attention (octfw.models.vit3d.blocked_attention), which
octfw's attention runs on XLA for sequences longer than one block: the same
values and gradients as ``F.scaled_dot_product_attention`` (on the CPU here,
and on torch_xla's CPU device in a process of its own), and memory linear in
the tokens in the program XLA compiles (its buffer assignment, against
torch_xla's own SDPA, which keeps the N x N probabilities).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import run_xla_script
from octfw.engine.attention import record_attention
from octfw.models.vit3d import QUERY_BLOCK, Attention, attention, blocked_attention


def _with_gradients(function, inputs, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    out = function(q, k, v)
    out.backward(grad)
    return [out, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("tokens, block", [(20, 8), (16, 8), (5, 8), (7, 1)])
def test_blocked_attention_equals_sdpa_forward_and_backward(tokens, block):
    """Float64 on the CPU: equal to rounding, whether or not the block divides the tokens."""
    generator = torch.Generator().manual_seed(tokens)
    inputs = [torch.randn(2, 3, tokens, 8, dtype=torch.float64, generator=generator) for _ in range(3)]
    grad = torch.randn(2, 3, tokens, 8, dtype=torch.float64, generator=generator)
    expected = _with_gradients(F.scaled_dot_product_attention, inputs, grad)
    got = _with_gradients(lambda q, k, v: blocked_attention(q, k, v, block), inputs, grad)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


def test_blocked_attention_in_bf16_keeps_the_dtype_and_float32_statistics():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=generator).bfloat16() for _ in range(3))
    out = blocked_attention(q, k, v, 16)
    assert out.dtype == torch.bfloat16
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert float((out.double() - reference).abs().max()) < 2e-2


def test_without_grad_nothing_is_kept_and_the_result_is_the_same():
    q, k, v = (torch.randn(1, 2, 10, 4) for _ in range(3))
    with torch.no_grad():
        out = blocked_attention(q, k, v, 4)
    assert out.grad_fn is None
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0, atol=1e-6)


def test_off_xla_attention_is_torchs_sdpa_and_the_record_names_each_kernel():
    """The choice is the device's: the CPU keeps its fused kernel at any length; a call of
    blocked_attention is recorded as "blocked"."""
    q = k = v = torch.randn(1, 2, QUERY_BLOCK + 1, 8)
    with record_attention() as record:
        attention(q, k, v)
        blocked_attention(q, k, v, 64)
    assert [call.kernel for call in record.calls] == ["flash", "blocked"]
    assert record.calls[1].query_shape == (1, 2, QUERY_BLOCK + 1, 8)
    with record_attention() as record:
        Attention(16, 2)(torch.randn(1, 12, 16))
    assert record.kernels == {"flash"}


@pytest.fixture(scope="module")
def xla_run():
    return run_xla_script("blocked_attention.py")


@pytest.mark.slow
def test_on_xla_blocked_attention_equals_sdpa_within_1e_5(xla_run):
    """20 tokens in blocks of 8 (the last block holds 4): the output and the gradients
    of q, k and v against torch_xla's SDPA and against the CPU's."""
    assert max(xla_run["against_sdpa"]) < 1e-5, xla_run["against_sdpa"]
    assert max(xla_run["against_cpu_sdpa"]) < 1e-5, xla_run["against_cpu_sdpa"]


@pytest.mark.slow
def test_on_xla_octfws_modules_choose_it_beyond_one_block(xla_run):
    """Attention and a checkpointed Block (torch_xla's checkpoint around it) on xla run
    blocked attention when the tokens exceed QUERY_BLOCK, SDPA within one block, and
    match the same modules on the CPU (output, input and parameter gradients)."""
    assert xla_run["attention_kernels"] == ["blocked"] and xla_run["block_kernels"] == ["blocked"]
    assert xla_run["one_block_kernels"] == ["math"]
    for key in ("attention_module", "checkpointed_block", "one_block_module"):
        assert max(xla_run[key]) < 1e-5, (key, xla_run[key])


@pytest.mark.slow
def test_on_xla_the_compiled_program_plans_memory_linear_in_the_tokens(xla_run):
    """XLA's buffer assignment for one attention's forward and backward (2 heads of 16
    channels, float32): SDPA plans several N x N buffers (scores, probabilities and their
    gradients), 4x as much at twice the tokens; the blocked attention a few of one block's
    [heads, 128, N], twice as much at twice the tokens. Measured at 1,024 tokens: 33.1 MiB
    against 7.6 MiB (4.3x; more at more tokens: benchmarks/accelerators/xla_attention_memory.py)."""
    small, large = xla_run["memory"]
    for memory in (small, large):
        print(f"{memory['tokens']} tokens: XLA:CPU plans {memory['sdpa_bytes'] / 2**20:.1f} MiB for SDPA, "
              f"{memory['blocked_bytes'] / 2**20:.1f} MiB blocked: {memory['sdpa_bytes'] / memory['blocked_bytes']:.2f}x")
        assert memory["sdpa_bytes"] > 3 * memory["probabilities_bytes"]
        assert memory["blocked_bytes"] < 10 * memory["block_bytes"]
    assert large["sdpa_bytes"] > 3.5 * small["sdpa_bytes"]
    assert large["blocked_bytes"] < 2.5 * small["blocked_bytes"]
    assert large["sdpa_bytes"] > 4 * large["blocked_bytes"]
