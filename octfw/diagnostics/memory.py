"""Per-device memory of a training step, estimated before the run.

The seeds' smoke test died with ``BrokenProcessPool`` after workers ran out
of memory on a batch and volume size nobody had sized beforehand. ``octfw
check`` calls :func:`estimate_memory` on the model and one per-device batch,
:func:`memory_report` compares the total with the device's memory and
:func:`batch_advice` names the largest per-device batch that fits.

What is counted, in bytes, for one device:

- ``parameters``: trainable parameters (fp32 master weights, also under bf16
  autocast) and ``ema``: the frozen (EMA target encoder) parameters;
- ``buffers``: position embeddings and other buffers;
- ``gradients``: one fp32 gradient per trainable parameter;
- ``optimizer``: AdamW's two moments per trainable parameter;
- ``batch``: the input tensors of one micro-batch;
- ``activations``: the tensors autograd saves for the backward pass of one
  micro-batch, measured by running the forward on ``meta`` tensors (shapes
  only: nothing is computed or allocated) with ``saved_tensors_hooks``, with
  attention saved as the device's kernel saves it (:data:`ATTENTION_BY_DEVICE`;
  on xla with one query block's temporaries on top) and checkpointed blocks
  counted by what they keep (:class:`SavedTensors`).
  Under bf16 autocast the forward runs on fake CPU tensors under the CPU's
  autocast, so each saved tensor is counted at the dtype autocast gives it,
  the bf16 copies of the weights included (:func:`saved_tensors`);
- ``update_buffers``: the temporaries of the optimizer step and the EMA
  update (:data:`OPTIMIZER_TEMPORARIES_BY_DEVICE`). They come after the
  backward pass has freed the activations, so the peak holds the larger of
  the two, not both.

Sharded over N devices (``engine.parallelism = "fsdp"``, ``shards=N``), a device holds 1/N of
the parameters, EMA, gradients and optimizer state (and of the update's temporaries), plus
``gathered``: the largest transformer block whole, twice (the one computing and the next,
gathered ahead), and its whole gradient before it is reduce-scattered.

On the CPU the total is within 20 % of the measured peak of the engine's
update step for ``tiny`` and ``small`` (``tests/test_memory.py``); allocator
fragmentation and compiler workspaces on accelerators come on top, so a total
near the device's memory is already a risk. A guard's veto costs no memory:
it goes into the update itself (:mod:`octfw.engine.optim`).

What a device offers to compare with: :mod:`octfw.diagnostics.device_memory`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Mapping

import attrs
import torch

from octfw.models.vit3d import QUERY_BLOCK
from octfw.recipe import fields
from octfw.types import ActivationCheckpointing

__all__ = [
    "ATTENTION_BY_DEVICE", "BLOCK_TEMPORARIES", "MemoryEstimate", "SavedTensors", "activation_bytes",
    "batch_advice", "xla_attention_line", "estimate_memory", "largest_batch", "largest_fitting",
    "memory_report", "resized_batch", "saved_tensors",
]

GIB = 1024**3

#: AdamW keeps exp_avg and exp_avg_sq per parameter, at the parameter's dtype.
ADAMW_STATES = 2


@attrs.frozen
class MemoryEstimate:
    """Bytes per part for one device; :attr:`total` is the peak they add up to."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        # The activations are freed during the backward pass, before the
        # optimizer step and the EMA update make their temporaries: the two
        # never peak at the same time.
        together = sum(n for name, n in self.parts.items() if name not in ("activations", "update_buffers"))
        return together + max(self.parts.get("activations", 0), self.parts.get("update_buffers", 0))

    def describe(self) -> str:
        together = [f"{name} {_gib(n)}" for name, n in self.parts.items()
                    if n and name not in ("activations", "update_buffers")]
        alternatives = " and ".join(f"{name.replace('_', ' ')} {_gib(self.parts[name])}"
                                    for name in ("activations", "update_buffers") if self.parts.get(name))
        return ", ".join(together) + (f", then the larger of {alternatives}" if alternatives else "")


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB" if n >= 0.1 * GIB else f"{n / 1024**2:.3g} MiB"


def _math_attention() -> contextlib.AbstractContextManager:
    """Attention as XLA computes it: matmul, softmax, matmul, keeping the probabilities."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)


def resized_batch(batch: Mapping[str, Any], size: int) -> dict[str, Any]:
    """``batch`` with ``size`` samples, as shape-only (meta) tensors."""
    return {k: torch.empty((size, *v.shape[1:]), dtype=v.dtype, device="meta") if torch.is_tensor(v) else v
            for k, v in batch.items()}


#: How octfw's attention keeps what its backward needs, by device kind. "fused": the
#: fused kernels of ``F.scaled_dot_product_attention`` (flash / memory-efficient; on the
#: CPU and on CUDA for these shapes, see :mod:`octfw.diagnostics.attention`) keep q, k, v,
#: the output and a log-sum-exp per row. "math": torch_xla lowers SDPA to matmul, softmax,
#: matmul and keeps the ``[B, heads, N, N]`` probabilities, which at 9,216 tokens are most
#: of the activations. "blocked" (xla): octfw's query-blocked attention
#: (:func:`octfw.models.vit3d.blocked_attention`) for sequences longer than
#: :data:`~octfw.models.vit3d.QUERY_BLOCK` keeps what the fused kernels keep, and one
#: block's backward holds :data:`BLOCK_TEMPORARIES` more; shorter ones run "math".
ATTENTION_BY_DEVICE = {"cpu": "fused", "cuda": "fused", "xla": "blocked"}

#: Float32 ``[B, heads, QUERY_BLOCK, N]`` temporaries one block of blocked attention holds in
#: its backward (scores, probabilities, their gradients and transposes): XLA:CPU's buffer
#: assignment planned 5.4-6.2 of them, inputs and outputs included, at 2,048-8,192 tokens
#: (benchmarks/accelerators/xla_attention_memory.py).
BLOCK_TEMPORARIES = 6

#: Temporaries of the optimizer step, in trainable-parameter sizes, by device
#: kind: torch's foreach AdamW on the CPU keeps one (a square root) beside its
#: in-place updates; octfw's out-of-place GatedAdamW (cuda) holds up to six at
#: once in eager mode; on xla the step is one fused graph, counted like the
#: CPU's. The EMA update holds two EMA-sized temporaries; the larger counts.
OPTIMIZER_TEMPORARIES_BY_DEVICE = {"cpu": 1, "cuda": 6, "xla": 1}
EMA_TEMPORARIES = 2


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """Meta tensors run attention on the math path; this swaps in the fused
    kernel's op (its meta function gives the shapes it saves) for queries longer
    than ``longer_than``, and notes the bytes of one float32 block of
    ``block`` queries' scores of each such call (blocked attention)."""

    def __init__(self, longer_than: int = 0, block: int = QUERY_BLOCK):
        super().__init__()
        self.longer_than, self.block = longer_than, block
        self.block_bytes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.nn.functional.scaled_dot_product_attention and kwargs.get("attn_mask") is None
                and args[0].shape[-2] > self.longer_than):
            query, key, value = args[:3]
            *leading, queries, _ = query.shape
            self.block_bytes.append(4 * min(queries, self.block) * key.shape[-2] * math.prod(leading))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


@attrs.frozen
class SavedTensors:
    """What autograd saves in one forward, by where it was saved (storage sizes, bytes).

    A *checkpointable* module has a ``checkpoint_activations`` attribute
    (:class:`octfw.models.vit3d.Block`); each of its calls is measured apart.
    """

    sizes: dict[int, int]  #: bytes of each saved storage, by id
    outside: frozenset[int]  #: saved outside every checkpointable module
    calls: tuple[tuple[bool, frozenset[int], frozenset[int]], ...]  #: (checkpointed, input, saved inside)
    #: bytes one block of the largest blocked-attention call holds in its backward (0 without blocked attention)
    transient: int = 0

    def total(self) -> int:
        """Bytes alive at the start of backward plus, for checkpointed modules,
        the largest one's recomputed activations (recomputed one at a time), plus
        one attention block's temporaries."""
        kept = set(self.outside)
        for checkpointed, inputs, inside in self.calls:
            kept |= inputs if checkpointed else inside
        recomputed = [sum(self.sizes[i] for i in inside - kept) for checkpointed, _, inside in self.calls
                      if checkpointed]
        return sum(self.sizes[i] for i in kept) + max(recomputed, default=0) + self.transient


def saved_tensors(model: torch.nn.Module, batch: Mapping[str, Any], *, attention: str = "fused",
                  checkpointing: bool | None = None, precision: str = "fp32") -> SavedTensors:
    """Run ``model(batch)`` on shape-only tensors and record what autograd saves.

    ``checkpointing``: None measures the model as configured; True or False as
    if every checkpointable module had ``checkpoint_activations`` set so.
    ``precision``: "fp32", or "bf16" to run under bf16 autocast, which saves
    most activations in 2 bytes. Meta tensors carry no autocast, so bf16 runs on
    fake CPU tensors (``FakeTensorMode``: shapes and dtypes, no memory) under the
    CPU's autocast; it stands in for every device kind (without a GPU, torch
    can fake no CUDA kernel), and its casts match CUDA's for the ops the models
    use (matmuls and attention in bf16, layer norms saving their fp32 input).
    """
    with _shape_only(precision) as shaped:
        state = {name: shaped(p) for name, p in model.named_parameters()}
        state.update({name: shaped(b) for name, b in model.named_buffers()})
        shaped_batch = {k: shaped(v) if torch.is_tensor(v) else v for k, v in batch.items()}
        return _saved_tensors(model, state, shaped_batch, attention, checkpointing, precision)


@contextlib.contextmanager
def _shape_only(precision: str):
    """A function making shape-only copies of tensors: meta for fp32, fake CPU tensors for bf16."""
    if precision == "fp32":
        yield _meta
        return
    if precision != "bf16":
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)

    with FakeTensorMode():
        yield fake


def _saved_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor], shaped_batch: dict[str, Any],
                   attention: str, checkpointing: bool | None, precision: str) -> SavedTensors:
    # Parameters, buffers and the batch are counted in parts of their own (the
    # patch embedding saves the batch itself for its weight gradient).
    frozen = {id(t) for t in state.values()} | {id(t) for t in shaped_batch.values() if torch.is_tensor(t)}
    keep_alive: dict[int, torch.Tensor] = {}  # so that ids are not reused during the forward
    outside: set[int] = set()
    calls: list[tuple[bool, set[int], set[int]]] = []
    current: list[set[int]] = []  # the saved set of the outermost checkpointable call running

    def storage_id(t: torch.Tensor) -> int:
        base = t._base if t._base is not None else t  # a view shares its base's storage
        keep_alive.setdefault(id(base), base)
        return id(base)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_id(t)
        if key not in frozen:
            (current[-1] if current else outside).add(key)
        return t

    checkpointable = [m for m in model.modules() if isinstance(m, ActivationCheckpointing)]
    configured = {id(m): m.checkpoint_activations for m in checkpointable}
    handles = []

    def before(module, args):
        if not current:
            inputs = {storage_id(a) for a in args if torch.is_tensor(a)}
            wanted = configured[id(module)] if checkpointing is None else checkpointing
            calls.append((bool(wanted), inputs, set()))
            current.append(calls[-1][2])
        else:
            current.append(current[-1])  # nested: counted with the outermost call

    def after(module, args, output):
        current.pop()

    try:
        for m in checkpointable:
            m.checkpoint_activations = False  # run plainly, so every saved tensor is seen
            handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
        # blocked: the fused kernel's saved tensors beyond one query block, math within it
        fused = _FusedAttention(longer_than=QUERY_BLOCK if attention == "blocked" else 0)
        decomposed = _math_attention() if attention != "fused" else contextlib.nullcontext()
        mode = fused if attention != "math" else contextlib.nullcontext()
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                    else contextlib.nullcontext())
        with decomposed, mode, autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.func.functional_call(model, state, (shaped_batch,))
    finally:
        for handle in handles:
            handle.remove()
        for m in checkpointable:
            m.checkpoint_activations = configured[id(m)]
    sizes = {key: _nbytes(t) for key, t in keep_alive.items()}
    transient = BLOCK_TEMPORARIES * max(fused.block_bytes, default=0) if attention == "blocked" else 0
    return SavedTensors(sizes, frozenset(outside),
                        tuple((c, frozenset(i), frozenset(s)) for c, i, s in calls), transient)


def activation_bytes(model: torch.nn.Module, batch: Mapping[str, Any], *, attention: str = "fused",
                     checkpointing: bool | None = None, precision: str = "fp32") -> int:
    """Bytes autograd keeps for backward in one ``model(batch)`` (see :func:`saved_tensors`)."""
    return saved_tensors(model, batch, attention=attention, checkpointing=checkpointing,
                         precision=precision).total()


def estimate_memory(model: torch.nn.Module, batch: Mapping[str, Any], *, device: str = "cpu",
                    checkpointing: bool | None = None, precision: str = "fp32",
                    attention: str | None = None, shards: int = 1) -> MemoryEstimate:
    """Estimate the peak per-device bytes of training ``model`` on micro-batches like ``batch``
    on a device of kind ``device`` (cpu, cuda, xla) at ``precision`` (fp32, or bf16 autocast);
    ``checkpointing``: see :func:`saved_tensors`; ``attention``: "fused", "blocked" or "math", by default
    the device's (:data:`ATTENTION_BY_DEVICE`); ``shards``: the devices the model's state is
    split over (``engine.parallelism = "fsdp"``; 1: replicated)."""
    trainable = sum(_nbytes(p) for p in model.parameters() if p.requires_grad) // shards
    frozen = sum(_nbytes(p) for p in model.parameters() if not p.requires_grad) // shards
    parts = {
        "parameters": trainable,
        "ema": frozen,
        "buffers": sum(_nbytes(b) for b in model.buffers()),
        "gradients": trainable,
        "optimizer": ADAMW_STATES * trainable,
        "gathered": _gathered_bytes(model, precision) if shards > 1 else 0,
        "batch": sum(_nbytes(v) for v in batch.values() if torch.is_tensor(v)),
        "activations": activation_bytes(model, batch, attention=attention or ATTENTION_BY_DEVICE[device],
                                        checkpointing=checkpointing, precision=precision),
        "update_buffers": max(OPTIMIZER_TEMPORARIES_BY_DEVICE[device] * trainable, EMA_TEMPORARIES * frozen),
    }
    return MemoryEstimate(parts)


def _gathered_bytes(model: torch.nn.Module, precision: str) -> int:
    """What a sharded device holds whole at once: the largest block twice, at the compute
    precision (the one computing and the next, gathered ahead), and its fp32 gradient."""
    from octfw.engine.sharding import sharding_units

    units = sharding_units(model) or [model]
    largest = max(sum(p.numel() for p in unit.parameters()) for unit in units)
    return largest * (2 * (2 if precision == "bf16" else 4) + 4)


def largest_fitting(fits: Callable[[int], bool], limit: int = 1 << 16) -> int:
    """The largest size in ``[1, limit]`` for which ``fits(size)``, 0 when not even 1 fits;
    ``fits`` must be monotone (true up to some size, false above it). Doubles, then bisects."""
    if not fits(1):
        return 0
    low, high = 1, 2  # fits(low); the first doubling that does not fit bounds the search
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def largest_batch(model: torch.nn.Module, batch: Mapping[str, Any], device_bytes: int, *,
                  device: str = "cpu", checkpointing: bool | None = None, limit: int = 1 << 16,
                  precision: str = "fp32", shards: int = 1) -> int:
    """The largest per-device batch of samples like ``batch``'s whose estimate
    fits in ``device_bytes``; 0 when one sample does not fit."""

    def fits(size: int) -> bool:
        estimate = estimate_memory(model, resized_batch(batch, size), device=device,
                                   checkpointing=checkpointing, precision=precision, shards=shards)
        return estimate.total <= device_bytes

    return largest_fitting(fits, limit)


def memory_report(estimate: MemoryEstimate, device_bytes: int | None, device_desc: str) -> tuple[str, str | None]:
    """(the report line, a warning line when the estimate exceeds the device's memory, else None)."""
    line = f"memory    ~{_gib(estimate.total)} per device ({estimate.describe()})"
    if device_bytes is None:
        return line + f"; device memory unknown: {device_desc}", None
    line += f" of {_gib(device_bytes)} {device_desc}"
    if estimate.total <= device_bytes:
        return line, None
    biggest = max(estimate.parts, key=estimate.parts.__getitem__)
    warning = (f"estimated memory per device {_gib(estimate.total)} exceeds {_gib(device_bytes)} "
               f"({device_desc}); the largest part is {biggest.replace('_', ' ')} "
               f"({_gib(estimate.parts[biggest])}): lower engine.per_device_batch (and raise "
               "engine.grad_accum_steps to keep the global batch), turn on model.activation_checkpointing, "
               "or lower transform.image_size or model.preset")
    return line, warning


def xla_attention_line(model: torch.nn.Module, batch: Mapping[str, Any], estimate: MemoryEstimate,
                       precision: str, shards: int = 1) -> str:
    """For xla: the activations and peak XLA's own attention (torch_xla's SDPA, keeping the
    ``N x N`` probabilities) would give, beside ``estimate``'s for octfw's query-blocked
    attention, which runs (docs/performance.md says why not torch_xla's Pallas kernel)."""
    own = estimate_memory(model, batch, device="xla", precision=precision, attention="math", shards=shards)
    return (f"          with XLA's own attention: activations {_gib(own.parts['activations'])} instead of "
            f"{_gib(estimate.parts['activations'])}, ~{_gib(own.total)} per device "
            f"(octfw's runs {QUERY_BLOCK} queries at a time: docs/performance.md)")


#: Share of a device's memory the advised batch may fill: on an H100 the eager bf16 step of
#: ``small`` at the seeds' size peaked 1.15x the estimate (the CUDA caching allocator and
#: backward's transient gradients; the compiled step 1.00x), benchmarks/accelerators/README.md.
ADVISED_SHARE = 0.85


def batch_advice(model: torch.nn.Module, batch: Mapping[str, Any], device_bytes: int, device: str,
                 precision: str = "fp32", shards: int = 1) -> str:
    """The largest per-device batch whose estimate fills at most :data:`ADVISED_SHARE` of the
    device, as configured and, where the model can checkpoint activations but does not, with
    checkpointing; ``shards``: see :func:`estimate_memory`."""
    device_bytes = int(device_bytes * ADVISED_SHARE)
    fitting = largest_batch(model, batch, device_bytes, device=device, precision=precision, shards=shards)
    line = f"fits      per-device batch up to {fitting}" if fitting else "fits      not even 1 sample per device"
    configured = [m.checkpoint_activations for m in model.modules() if isinstance(m, ActivationCheckpointing)]
    if configured and not any(configured):
        with_checkpointing = largest_batch(model, batch, device_bytes, device=device, checkpointing=True,
                                           precision=precision, shards=shards)
        line += f"; {with_checkpointing} with model.activation_checkpointing = true"
    sharded = f", the model's state sharded over {shards} devices" if shards > 1 else ""
    return line + (f" (estimated for {device} {precision}{sharded}, {ADVISED_SHARE:.0%} of the device: "
                   f"{_gib(device_bytes)})")
