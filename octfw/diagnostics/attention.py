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

:func:`record_attention` watches the aten operators torch dispatches
(a ``TorchDispatchMode``), so it reports the kernel that really ran, forward
and backward, not a prediction. ``torch._fused_sdp_choice`` predicts the
forward choice, but it is private and answers "math" for shape-only ``meta``
tensors, so this check runs on the real device with real tensors.

:func:`sdpa_backend` (and :func:`sdpa_call`) ask that question for octfw's own
:class:`~octfw.models.vit3d.Attention` at a given size, in the precision the
engine trains in (bf16 is autocast over fp32 weights, as
:meth:`octfw.engine.backend.Backend.autocast` does it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import attrs
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AttentionCall", "AttentionRecord", "KERNELS", "describe", "record_attention", "sdpa_backend", "sdpa_call"]

#: The aten operator of each fused SDPA kernel (forward; its backward is the
#: same name + "_backward"), and the name octfw reports for it. A call that
#: dispatches none of them ran the math implementation (matmuls and softmax).
KERNELS: dict[str, str] = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
MATH = "math"
_BACKWARD = {f"{op}_backward": name for op, name in KERNELS.items()}


@attrs.frozen
class AttentionCall:
    """One ``F.scaled_dot_product_attention`` call as the kernel saw it."""

    query_shape: tuple[int, ...]  #: [B, heads, N, head_dim]
    key_shape: tuple[int, ...]
    dtype: str  #: of the query as dispatched (after autocast)
    masked: bool  #: an explicit attn_mask was passed
    kernel: str  #: "flash", "efficient", "cudnn", "overrideable" or "math"


@attrs.define
class AttentionRecord:
    """What :func:`record_attention` saw: one entry per forward call, and the
    fused backward kernels dispatched (math's backward is plain matmuls)."""

    calls: list[AttentionCall] = attrs.Factory(list)
    backward_kernels: list[str] = attrs.Factory(list)

    @property
    def kernels(self) -> set[str]:
        return {call.kernel for call in self.calls}


class _KernelOps(TorchDispatchMode):
    """Notes every fused-attention aten operator that runs, forward or backward."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: list[tuple[str, torch.Tensor]] = []  # (kernel, query as dispatched)
        self.backward: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in KERNELS:
            self.forward.append((KERNELS[name], args[0]))
        elif name in _BACKWARD:
            self.backward.append(_BACKWARD[name])
        return func(*args, **(kwargs or {}))


class _AttentionCalls(TorchFunctionMode):
    """Brackets every ``F.scaled_dot_product_attention`` call, so the kernel
    operators dispatched inside it belong to that call."""

    def __init__(self, ops: _KernelOps, record: AttentionRecord):
        super().__init__()
        self.ops, self.record = ops, record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        seen = len(self.ops.forward)
        out = func(*args, **kwargs)
        fused = self.ops.forward[seen:]
        query, key = args[0], args[1]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        # The dtype the kernel got (autocast may have cast the inputs); for
        # math, the dtype of the result.
        dispatched = fused[0][1].dtype if fused else out.dtype
        self.record.calls.append(AttentionCall(
            query_shape=tuple(query.shape), key_shape=tuple(key.shape),
            dtype=str(dispatched).replace("torch.", ""), masked=mask is not None,
            kernel=fused[0][0] if fused else MATH))
        return out


@contextlib.contextmanager
def record_attention() -> Iterator[AttentionRecord]:
    """Record the kernel of every scaled-dot-product attention run inside the
    block (forward calls, and the fused backward kernels if backward runs in
    it). Python-level hooks on every operator: for a check, not a timed run."""
    record = AttentionRecord()
    ops = _KernelOps()
    # The dispatch mode is entered first: the function mode reads what it saw.
    with ops, _AttentionCalls(ops, record):
        yield record
    record.backward_kernels.extend(ops.backward)


def sdpa_call(device: str | torch.device, dtype: torch.dtype, batch: int, heads: int, tokens: int,
              head_dim: int, *, backward: bool = False) -> AttentionCall:
    """The call octfw's :class:`~octfw.models.vit3d.Attention` makes on
    ``device`` for ``batch`` x ``tokens`` tokens of ``heads`` x ``head_dim``
    channels, with the kernel that ran it. ``dtype`` is the training
    precision: bf16 or fp16 means autocast over fp32 weights, as the engine
    runs it. With ``backward`` the gradient is taken too, and a backward that
    does not use the forward's kernel is an error.

    Runs one real forward at that size (about 1 s on 2 CPU cores for 6 heads
    at 9,216 tokens; milliseconds on a GPU)."""
    from octfw.models.vit3d import Attention

    device = torch.device(device)
    dim = heads * head_dim
    attention = Attention(dim, heads).to(device)
    x = torch.randn(batch, tokens, dim, device=device, requires_grad=backward)
    low = dtype in (torch.bfloat16, torch.float16)
    with record_attention() as record:
        with torch.autocast(device.type, dtype=dtype, enabled=low):
            out = attention(x)
        if backward:
            out.float().sum().backward()
    (call,) = record.calls
    if backward and record.backward_kernels != ([] if call.kernel == MATH else [call.kernel]):
        raise RuntimeError(f"attention forward ran {call.kernel}, backward ran {record.backward_kernels}")
    return call


def sdpa_backend(device: str | torch.device, dtype: torch.dtype, batch: int, heads: int, tokens: int,
                 head_dim: int, *, backward: bool = False) -> str:
    """The kernel octfw's attention runs for that size and precision (see
    :func:`sdpa_call`): "flash", "efficient", "cudnn", "overrideable" or "math"."""
    return sdpa_call(device, dtype, batch, heads, tokens, head_dim, backward=backward).kernel


def describe(record: AttentionRecord) -> list[dict[str, Any]]:
    """The distinct calls of a record, each with how often it ran (for reports)."""
    counts: dict[AttentionCall, int] = {}
    for call in record.calls:
        counts[call] = counts.get(call, 0) + 1
    return [{**attrs.asdict(call), "calls": n} for call, n in counts.items()]
