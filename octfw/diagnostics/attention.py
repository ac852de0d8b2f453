"""Which scaled-dot-product-attention kernel runs octfw's attention on a device.

At the seeds' [64, 384, 384] with patch [4, 16, 16] the target encoder attends
over 9,216 tokens, and attention is most of a step's FLOPs. PyTorch picks a
kernel for every ``F.scaled_dot_product_attention`` call from its inputs, and
falls back to the math implementation without a word when they do not suit a
fused one: on CUDA, flash attention needs fp16 or bf16 and no explicit mask;
on every device a dropout probability, query/key/value of different dtypes or
a last dimension whose stride is not 1 leave only math. The math kernel
materialises the ``[heads, N, N]`` score matrix: for ``small`` at 9,216
tokens that is 6 x 9,216^2 x 4 bytes = 2.0 GB per sample in fp32 for the
scores alone, and autograd keeps their softmax for the backward pass. The
fallback costs memory and time and nothing else, so it goes unnoticed.

:func:`~octfw.engine.attention.record_attention` watches the aten operators
torch dispatches (a ``TorchDispatchMode``), so it reports the kernel that
really ran, forward and backward, not a prediction. ``torch._fused_sdp_choice`` predicts the
forward choice, but it is private and answers "math" for shape-only ``meta``
tensors, so this check runs on the real device with real tensors.

:func:`sdpa_backend` (and :func:`sdpa_call`) ask that question for octfw's own
:class:`~octfw.models.vit3d.Attention` at a given size, in the precision the
engine trains in (bf16 is autocast over fp32 weights, as
:meth:`octfw.engine.backend.Backend.forward_context` does it).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from octfw.engine.attention import BLOCKED, MATH, AttentionCall, AttentionRecord, priority_context, record_attention

__all__ = ["AttentionCall", "AttentionRecord", "describe", "record_attention", "sdpa_backend", "sdpa_call"]


def sdpa_call(device: str | torch.device, dtype: torch.dtype, batch: int, heads: int, tokens: int,
              head_dim: int, *, backward: bool = False, priority: tuple[str, ...] = ()) -> AttentionCall:
    """The call octfw's :class:`~octfw.models.vit3d.Attention` makes on
    ``device`` for ``batch`` x ``tokens`` tokens of ``heads`` x ``head_dim``
    channels, with the kernel that ran it. ``dtype`` is the training
    precision: bf16 or fp16 means autocast over fp32 weights, as the engine
    runs it. With ``backward`` the gradient is taken too, and a backward that
    does not use the forward's kernel is an error. ``priority``: the kernels to
    try in order (:func:`~octfw.engine.attention.kernel_priority`); empty: torch's order.

    Runs one real forward at that size (about 1 s on 2 CPU cores for 6 heads
    at 9,216 tokens; milliseconds on a GPU)."""
    from octfw.models.vit3d import Attention

    device = torch.device(device)
    dim = heads * head_dim
    attention = Attention(dim, heads).to(device)
    x = torch.randn(batch, tokens, dim, device=device, requires_grad=backward)
    low = dtype in (torch.bfloat16, torch.float16)
    with record_attention() as record, priority_context(priority):
        with torch.autocast(device.type, dtype=dtype, enabled=low):
            out = attention(x)
        if backward:
            out.float().sum().backward()
    (call,) = record.calls
    if backward and record.backward_kernels != ([] if call.kernel in (MATH, BLOCKED) else [call.kernel]):
        raise RuntimeError(f"attention forward ran {call.kernel}, backward ran {record.backward_kernels}")
    return call


def sdpa_backend(device: str | torch.device, dtype: torch.dtype, batch: int, heads: int, tokens: int,
                 head_dim: int, *, backward: bool = False, priority: tuple[str, ...] = ()) -> str:
    """The kernel octfw's attention runs for that size and precision (see
    :func:`sdpa_call`): "flash", "efficient", "cudnn", "overrideable", "math" or, on XLA
    beyond one query block, "blocked"."""
    return sdpa_call(device, dtype, batch, heads, tokens, head_dim, backward=backward, priority=priority).kernel


def describe(record: AttentionRecord) -> list[dict[str, Any]]:
    """The distinct calls of a record, each with how often it ran (for reports)."""
    counts: dict[AttentionCall, int] = {}
    for call in record.calls:
        counts[call] = counts.get(call, 0) + 1
    return [{**attrs.asdict(call), "calls": n} for call, n in counts.items()]
