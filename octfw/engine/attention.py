"""Scaled-dot-product attention on the device: which kernels octfw asks for,
and which one really ran.

PyTorch picks a kernel for every ``F.scaled_dot_product_attention`` call from
its inputs and a priority list, and falls back to the math implementation
without a word when the inputs do not suit a fused one. The math kernel
materialises the ``[heads, N, N]`` scores: at the seeds' 9,216 tokens that is
2 GB per sample for ``small`` in fp32. So the engine sets the priority by
device (:func:`kernel_priority`) and names the kernel that ran
(:func:`record_attention`, a dispatch mode that sees the aten operator torch
really dispatched, forward and backward, not a prediction). On XLA, where
torch_xla's SDPA keeps the N x N probabilities, octfw's attention runs long
sequences through :func:`octfw.models.vit3d.blocked_attention`, which the
record names ``blocked``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import attrs
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from octfw.models.vit3d import blocked_attention

__all__ = ["AttentionCall", "AttentionRecord", "BLOCKED", "KERNELS", "MATH", "kernel_priority", "priority_context",
           "record_attention"]

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
#: octfw's query-blocked attention on XLA (:func:`~octfw.models.vit3d.blocked_attention`): plain
#: matmuls too, so no fused operator names it; the function itself is seen.
BLOCKED = "blocked"
_BACKWARD = {f"{op}_backward": name for op, name in KERNELS.items()}


@attrs.frozen
class AttentionCall:
    """One ``F.scaled_dot_product_attention`` call as the kernel saw it."""

    query_shape: tuple[int, ...]  #: [B, heads, N, head_dim]
    key_shape: tuple[int, ...]
    dtype: str  #: of the query as dispatched (after autocast)
    masked: bool  #: an explicit attn_mask was passed
    kernel: str  #: "flash", "efficient", "cudnn", "overrideable", "math" or "blocked"


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
        # (kernel, dtype of the query as dispatched): never the query itself, which would keep
        # every layer's queries alive through the step (10 GB for `small` at batch 48 on an H100)
        self.forward: list[tuple[str, torch.dtype]] = []
        self.backward: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in KERNELS:
            self.forward.append((KERNELS[name], args[0].dtype))
        elif name in _BACKWARD:
            self.backward.append(_BACKWARD[name])
        return func(*args, **(kwargs or {}))


class _AttentionCalls(TorchFunctionMode):
    """Brackets every ``F.scaled_dot_product_attention`` call, so the kernel
    operators dispatched inside it belong to that call; notes every
    :func:`~octfw.models.vit3d.blocked_attention` call as ``blocked``."""

    def __init__(self, ops: _KernelOps, record: AttentionRecord):
        super().__init__()
        self.ops, self.record = ops, record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is blocked_attention:
            out = func(*args, **kwargs)
            self.record.calls.append(AttentionCall(
                query_shape=tuple(args[0].shape), key_shape=tuple(args[1].shape),
                dtype=str(args[0].dtype).replace("torch.", ""), masked=False, kernel=BLOCKED))
            return out
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        seen = len(self.ops.forward)
        out = func(*args, **kwargs)
        fused = self.ops.forward[seen:]
        query, key = args[0], args[1]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        # The dtype the kernel got (autocast may have cast the inputs); for
        # math, the dtype of the result.
        dispatched = fused[0][1] if fused else out.dtype
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


#: The SDPA kernels octfw tries first on each CUDA architecture (major compute
#: capability), then the rest in torch's order. On Hopper (9) cuDNN's attention
#: is the FlashAttention-3-style kernel; torch's own default order puts it last.
#: Measured on a lent H100 by benchmarks/accelerators/accelerator_suite.py (benchmarks/accelerators/README.md).
CUDA_PRIORITY: dict[int, tuple[str, ...]] = {9: ("cudnn", "flash", "efficient", "math"),
                                             10: ("cudnn", "flash", "efficient", "math")}
_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}


def kernel_priority(device: torch.device) -> tuple[str, ...]:
    """The kernels to try, in order, on ``device``; empty: torch's own order."""
    if device.type != "cuda":
        return ()
    major, _ = torch.cuda.get_device_capability(device)
    return CUDA_PRIORITY.get(major, ())


def priority_context(priority: tuple[str, ...]) -> contextlib.AbstractContextManager:
    """Every SDPA call inside tries ``priority``'s kernels in that order."""
    if not priority:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _BACKENDS[name]) for name in priority], set_priority=True)
