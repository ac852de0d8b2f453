"""Building blocks of a 3D Vision Transformer: patch embedding, positions (fixed
sin-cos by default, a learned table, or V-JEPA 2's 3D rotary embedding), pre-norm
blocks, and an encoder that can run on a subset of tokens.

Shapes: volumes are ``[B, C, D, H, W]``; tokens are ``[B, N, E]`` with the N
patches in row-major order over the patch grid ``(D/pd, H/ph, W/pw)``.

Everything here is XLA-friendly: token subsets are taken with
:func:`gather_tokens` and fixed-size index tensors, never boolean masks, and
no forward branches on tensor values. Attention goes through
:func:`attention`: torch's SDPA, or on XLA beyond one block of queries
:func:`blocked_attention`, whose memory is linear in the tokens where
torch_xla's SDPA keeps the N x N probabilities.

This module imports torch only, never octfw: ``octfw export --format
monai-bundle`` ships it as it is (``scripts/vit3d.py``) so that MONAI users
build the encoder without octfw (``tests/test_embed.py`` checks it). That is
why it is one file of one concern, the encoder network, longer than octfw's
other modules: split into positions and blocks, the bundle would need octfw
or a package of its own. What is not the network lives elsewhere (the
optimizer's weight-decay groups in :mod:`octfw.engine.optim`).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

__all__ = [
    "grid_shape",
    "sincos_pos_embed_3d",
    "POSITIONS",
    "ROTARY",
    "rope_tables",
    "apply_rope",
    "dim_rotated",
    "gather_tokens",
    "PatchEmbed3D",
    "standardise_volume",
    "volume_statistics",
    "QUERY_BLOCK",
    "attention",
    "blocked_attention",
    "Attention",
    "MLP",
    "LayerNorm",
    "layer_norm",
    "written_out_layer_norm",
    "Block",
    "checkpointed",
    "set_activation_checkpointing",
    "ViT3DEncoder",
    "init_weights",
    "rescale_residual_branches",
]

#: Standard deviation of the truncated-normal initialisation of weights.
INIT_STD = 0.02

#: How tokens know their place (``position`` of :class:`ViT3DEncoder`): ``"sincos"`` a fixed
#: 3D sin-cos table added to the patch tokens (octfw's default); ``"rope"`` V-JEPA 2's 3D
#: rotary embedding of queries and keys in every attention layer (:func:`apply_rope`; nothing
#: is added to the tokens and nothing is saved); ``"rope-interleaved"`` V-JEPA 2.1's, whose
#: table gives each angle to one neighbouring channel pair (see :func:`rope_tables`);
#: ``"learned"`` a trained table added to the tokens, initialised as the sin-cos one and
#: saved (MAE-family and timm weights carry one).
POSITIONS = ("sincos", "rope", "rope-interleaved", "learned")
ROTARY = ("rope", "rope-interleaved")

#: LayerNorm epsilon of octfw's networks; V-JEPA 2 and MAE build theirs with 1e-6
#: (``norm_eps`` of :class:`ViT3DEncoder`).
NORM_EPS = 1e-5


def grid_shape(
    image_size: tuple[int, int, int], patch_size: tuple[int, int, int]
) -> tuple[int, int, int]:
    """The patch grid ``(D/pd, H/ph, W/pw)``; every size must divide exactly."""
    for size, patch in zip(image_size, patch_size):
        if size % patch:
            raise ValueError(
                f"image_size {tuple(image_size)} is not divisible by patch_size {tuple(patch_size)}"
            )
    return tuple(size // patch for size, patch in zip(image_size, patch_size))


def _sincos_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """``[len(positions), dim]`` embedding: sines then cosines of geometric frequencies."""
    half = dim // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / max(half, 1)))
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_pos_embed_3d(grid: tuple[int, int, int], dim: int) -> torch.Tensor:
    """Fixed 3D sin-cos position embedding, float32 ``[gd * gh * gw, dim]``.

    The channels are split between the three axes, each an even share: every
    axis gets ``2 * (dim // 6)`` and the (0, 2 or 4) channels left over go to
    the width and height axes, which have the most positions in OCT grids.
    Rows follow the row-major patch order.
    """
    if dim % 2:
        raise ValueError(f"a sin-cos position embedding needs an even dimension, got {dim}")
    base = 2 * (dim // 6)
    spare = dim - 3 * base  # 0, 2 or 4
    dims = [base, base + (2 if spare >= 4 else 0), base + (2 if spare >= 2 else 0)]
    gd, gh, gw = grid
    zz, yy, xx = torch.meshgrid(
        torch.arange(gd), torch.arange(gh), torch.arange(gw), indexing="ij"
    )
    parts = [
        _sincos_1d(axis.reshape(-1), axis_dim)
        for axis, axis_dim in zip((zz, yy, xx), dims)
        if axis_dim > 0
    ]
    return torch.cat(parts, dim=1).to(torch.float32)


def gather_tokens(tokens: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``tokens[b, idx[b]]`` for every sample: ``[B, N, E]`` x ``[B, K]`` -> ``[B, K, E]``.

    ``torch.gather`` with a fixed-size index keeps the shape static, so an XLA
    graph compiles once whatever the mask.
    """
    index = idx.unsqueeze(-1).expand(-1, -1, tokens.shape[-1])
    return torch.gather(tokens, 1, index)


def rope_tables(grid: tuple[int, int, int], head_dim: int, idx: torch.Tensor | None = None,
                device: torch.device | None = None, interleaved: bool = False,
                span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of V-JEPA 2's 3D rotary embedding for the tokens at ``idx``
    (``[B, K]`` patch indices; None: all ``N`` patches in order): float32
    ``[B or 1, 1, K or N, 3 * r]``, ``r = 2 * ((head_dim // 3) // 2)``, the channels of each
    head rotated by the depth, height and width position in turn (the rest of a head is
    left as it is).

    Facts of the reference (facebookresearch/vjepa2 ``src/models/utils/modules.py``,
    ``rotate_queries_or_keys``), kept so that its weights mean the same here: positions are
    patch-grid coordinates (0, 1, 2, ...); an axis of ``r`` channels has ``r / 2``
    frequencies ``10000 ** -(j / (r / 2))``; the table is the ``r / 2`` angles written twice
    one after the other (not interleaved), while the rotation pairs neighbouring channels
    (:func:`apply_rope`). The reference notes this pairing as a known quirk that its
    published weights were trained with. ``interleaved`` (V-JEPA 2.1, ``app/vjepa_2_1``)
    writes each angle twice side by side instead, so each channel pair turns by one angle.
    ``span`` (V-JEPA 2.1's ``interpolate_rope``): in-plane positions are stretched so that
    the grid's rows and columns run from 0 to ``span - 1``, the grid the weights were
    trained at (16 for 256-pixel frames of 16-pixel patches), whatever the grid's size.
    """
    gd, gh, gw = grid
    if idx is None:
        idx = torch.arange(gd * gh * gw, device=device)[None]
    rotated = 2 * ((head_dim // 3) // 2)
    omega = torch.arange(rotated // 2, dtype=torch.float32, device=idx.device)
    omega = 1.0 / 10000 ** (omega / (rotated / 2.0))
    coordinates = [c.float() for c in (idx // (gh * gw), (idx // gw) % gh, idx % gw)]  # depth, height, width
    if span is not None:  # the reference's arithmetic: position * (span - 1) / (size - 1)
        coordinates[1:] = [c * (span - 1) / (size - 1) if size > 1 else c
                           for c, size in zip(coordinates[1:], (gh, gw))]
    angles = [coordinate[..., None] * omega for coordinate in coordinates]  # each [B, K, r/2]
    if interleaved:
        angles = torch.cat([a.repeat_interleave(2, dim=-1) for a in angles], dim=-1)[:, None]
    else:
        angles = torch.cat([torch.cat([a, a], dim=-1) for a in angles], dim=-1)[:, None]  # [B, 1, K, 3r]
    return angles.cos(), angles.sin()


def dim_rotated(embed_dim: int, num_heads: int) -> int:
    """Channels of each head that :func:`apply_rope` rotates: ``3 * 2 * ((head_dim // 3) // 2)``."""
    return 3 * 2 * ((embed_dim // num_heads // 3) // 2)


def apply_rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Queries or keys ``x`` ``[B, heads, K, head_dim]`` rotated by :func:`rope_tables`:
    the first ``3 * r`` channels of each head become ``x * cos + x' * sin`` with ``x'`` the
    pairs ``(x0, x1), (x2, x3), ...`` turned to ``(-x1, x0), (-x3, x2), ...`` (the
    reference's arithmetic, in its order); the others are kept."""
    cos, sin = tables
    width = cos.shape[-1]
    head, rest = x[..., :width], x[..., width:]
    pairs = head.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rotated = head * cos.to(x.dtype) + turned * sin.to(x.dtype)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


#: Floor of a volume's standard deviation in :func:`standardise_volume`: a constant volume
#: (all background) becomes zeros instead of dividing by zero.
STANDARDISE_EPS = 1e-6


def volume_statistics(volume: torch.Tensor, patch_size: tuple[int, int, int],
                      keep_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each volume's mean and ``1 / std`` ``[B]`` (float32), for standardising it (the
    references standardise their inputs).

    The statistics are those of the patches at ``keep_idx`` (``[B, K]``; None: every
    patch), so an encoder that sees only the context learns nothing of the masked
    patches, not even their brightness. Per-patch means of ``x`` and ``x**2`` come from
    average pools (no copy of the volume into patches), and every patch has the same
    number of voxels, so the mean of the kept patches' means is the mean of their voxels.
    A constant volume gets ``1 / STANDARDISE_EPS``: its standardised voxels are 0."""
    x = volume.float()
    moments = [F.avg_pool3d(v, kernel_size=patch_size, stride=patch_size).mean(dim=1).flatten(1)
               for v in (x, x.square())]  # each [B, N]: the mean over channels too
    if keep_idx is not None:
        moments = [torch.gather(m, 1, keep_idx) for m in moments]
    mean, square = (m.mean(dim=1) for m in moments)
    var = (square - mean.square()).clamp_min(0.0)
    return mean, torch.rsqrt(var + STANDARDISE_EPS ** 2)


def standardise_volume(volume: torch.Tensor, patch_size: tuple[int, int, int],
                       keep_idx: torch.Tensor | None = None) -> torch.Tensor:
    """``volume`` standardised with :func:`volume_statistics`, float32 ``[B, C, D, H, W]``. The
    encoder does not build this copy: it folds the statistics into its patch projection."""
    mean, inv_std = volume_statistics(volume, patch_size, keep_idx)
    return (volume.float() - mean[:, None, None, None, None]) * inv_std[:, None, None, None, None]


class PatchEmbed3D(nn.Module):
    """Non-overlapping 3D patches to tokens (a Conv3d with kernel = stride = patch).

    Initialised as MAE initialises its patch projection: xavier-uniform on the
    flattened ``[E, C * pd * ph * pw]`` kernel, as a linear layer would be. The ViT
    default (std 0.02) gave tokens whose content was a third of the position
    embedding's norm, and mostly the patch's mean brightness."""

    def __init__(self, patch_size: tuple[int, int, int], in_channels: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        weight = self.proj.weight
        nn.init.xavier_uniform_(weight.view(weight.shape[0], -1))
        nn.init.zeros_(self.proj.bias)

    def forward(self, volume: torch.Tensor,
                statistics: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Tokens of ``volume``; with ``statistics`` (:func:`volume_statistics`), the tokens of
        the standardised volume. The projection is linear, so ``proj((x - m) * r)`` is
        ``(proj(x) - b - m * sum(W)) * r + b``: no standardised copy of the volume is made
        or kept for the backward pass (it cost as much activation memory as the input)."""
        tokens = self.proj(volume)  # [B, E, gd, gh, gw]
        if statistics is not None:
            mean, inv_std = statistics
            bias = self.proj.bias.float()[None, :, None, None, None]
            kernel_sum = self.proj.weight.float().sum(dim=(1, 2, 3, 4))[None, :, None, None, None]
            shift = mean[:, None, None, None, None] * kernel_sum
            scale = inv_std[:, None, None, None, None]
            tokens = ((tokens.float() - bias - shift) * scale + bias).to(tokens.dtype)
        # [B, E, gd, gh, gw] -> [B, N, E], N in row-major (d, h, w) order.
        return tokens.flatten(2).transpose(1, 2)


#: Queries per block of :func:`blocked_attention`, the attention :func:`attention` runs on
#: XLA for sequences longer than one block. One block's backward holds about six
#: ``[B, heads, QUERY_BLOCK, N]`` float32 temporaries (XLA:CPU's buffer assignment,
#: ``benchmarks/accelerators/xla_attention_memory.py``): 1.8 GB per sample for ``large``
#: (16 heads) at the seeds' 9,216 tokens, against 2.7 GB of bf16 probabilities per layer
#: that XLA's own attention keeps.
QUERY_BLOCK = 512


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of ``q`` over ``k``, ``v`` (each ``[B, heads, N, head_dim]``).

    ``F.scaled_dot_product_attention`` picks a fused kernel on the CPU and on CUDA
    (memory linear in N). torch_xla lowers it to matmul, softmax, matmul and keeps the
    ``[B, heads, N, N]`` probabilities for the backward pass (70 GiB of a 76 GiB
    estimate for ``large`` at the seeds' size); on XLA a sequence longer than
    :data:`QUERY_BLOCK` runs :func:`blocked_attention` instead. The branch is on the
    device type and shapes only, never on values (docs/performance.md).
    """
    if q.device.type == "xla" and q.shape[-2] > QUERY_BLOCK:
        return blocked_attention(q, k, v, QUERY_BLOCK)
    return F.scaled_dot_product_attention(q, k, v)


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = QUERY_BLOCK) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v)`` (no mask, no dropout), a block of
    ``block`` queries at a time: each block's exact softmax over all keys, keeping a
    log-sum-exp per query for the backward pass, which recomputes each block's
    probabilities from it (as a flash kernel does, in plain torch). Memory for one block's
    ``[B, heads, block, N]`` at a time instead of ``N x N``. Modes see it as a torch
    function (``record_attention`` names it ``blocked``)."""
    if torch.overrides.has_torch_function((q, k, v)):
        return torch.overrides.handle_torch_function(blocked_attention, (q, k, v), q, k, v, block)
    return _BlockedAttention.apply(q, k, v, block)


def _after(x: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
    """``x``, made to depend on ``earlier``: plus zero times one element of each of its
    ``[batch, head]`` rows (XLA folds ``x * 0`` only for integers, and a NaN is already
    everywhere). Orders the blocks of :class:`_BlockedAttention` for any compiler: XLA:CPU
    removes optimization barriers before scheduling, and then both starts every block's
    ``N``-wide temporaries at once and merges the backward's recomputed scores with the
    forward's, keeping them all alive."""
    return x + earlier[..., :1, :1].to(x.dtype) * 0


class _BlockedAttention(torch.autograd.Function):
    """:func:`blocked_attention`: saves ``q``, ``k``, ``v``, the output and a float32
    log-sum-exp per query, what a fused kernel saves. Scores and softmax statistics in
    float32 (float64 for float64 inputs), the products in the inputs' dtype (bf16 under
    autocast)."""

    @staticmethod
    def forward(ctx, q, k, v, block):
        scale, exact = q.shape[-1] ** -0.5, torch.promote_types(q.dtype, torch.float32)
        keys = k.transpose(-2, -1)
        outs, lses, previous = [], [], None
        for start in range(0, q.shape[-2], block):
            queries = q[..., start:start + block, :]
            if previous is not None:
                queries = _after(queries, previous)
            scores = (queries @ keys).to(exact) * scale
            peak = scores.amax(dim=-1, keepdim=True)
            weights = torch.exp(scores - peak)
            total = weights.sum(dim=-1, keepdim=True)
            out = ((weights.to(v.dtype) @ v).to(exact) / total).to(q.dtype)
            outs.append(out)
            lses.append((peak + torch.log(total)).squeeze(-1))
            previous = out
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, exact = q.shape[-1] ** -0.5, lse.dtype
        keys, values = k.transpose(-2, -1), v.transpose(-2, -1)
        grad_k = torch.zeros(k.shape, dtype=exact, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=exact, device=v.device)
        grad_q, previous = [], grad_out
        for start in reversed(range(0, q.shape[-2], ctx.block)):
            rows = slice(start, start + ctx.block)
            queries, grad = _after(q[..., rows, :], previous), _after(grad_out[..., rows, :], previous)
            weights = torch.exp((queries @ keys).to(exact) * scale - lse[..., rows, None])
            grad_v = grad_v + weights.to(grad.dtype).transpose(-2, -1) @ grad
            grad_weights = (grad @ values).to(exact)
            row_dot = (grad.to(exact) * out[..., rows, :].to(exact)).sum(dim=-1, keepdim=True)
            grad_scores = (weights * (grad_weights - row_dot) * scale).to(q.dtype)
            grad_q.append(grad_scores @ k)
            grad_k = grad_k + grad_scores.transpose(-2, -1) @ queries
            previous = grad_q[-1]
        return torch.cat(grad_q[::-1], dim=-2), grad_k.to(k.dtype), grad_v.to(v.dtype), None


class Attention(nn.Module):
    """Multi-head self-attention through :func:`attention`: ``F.scaled_dot_product_attention``,
    or on XLA :func:`blocked_attention` for sequences longer than one block."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embedding dimension {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Attention over ``x`` ``[B, N, E]``; with ``rope`` (:func:`rope_tables` of the tokens'
        positions) queries and keys are rotated first (V-JEPA 2)."""
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, N, head_dim]
        if rope is not None:  # a structural choice, not a branch on tensor values
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def checkpointed(function, x: torch.Tensor) -> torch.Tensor:
    """``function(x)``, keeping only ``x`` for the backward pass: the tensors
    ``function`` would save are recomputed from ``x`` when the gradient is taken."""
    if x.device.type == "xla":
        # One XLA graph holds the forward and the recomputation, and XLA's
        # common-subexpression elimination would merge them back (no memory
        # saved): torch_xla's checkpoint puts an optimization barrier between
        # them. It supports only the reentrant variant.
        from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

        return xla_checkpoint(function, x, use_reentrant=True)
    return torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False)


def layer_norm(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm``, written out on XLA devices.

    torch_xla lowers ``layer_norm`` to a batch norm over a ``[1, rows, E]``
    view of the input, and XLA's SPMD partitioner answers that by
    all-gathering the batch-sharded rows onto every device: each device then
    holds the global batch's activations in every LayerNorm (7.47 GB of
    all-gathers per update for ``small`` at the seeds' size,
    docs/performance.md). Mean and variance over the normalised axes are
    per-row reductions, which the partitioner keeps on each device's own
    rows. Computed in float32 (as the fused kernel does) and returned in the
    dtype ``F.layer_norm`` returns for the same input. Other devices keep the
    fused kernel. The branch is on the device type only, never on values.
    """
    if x.device.type != "xla":
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    return written_out_layer_norm(x, normalized_shape, weight, bias, eps)


def written_out_layer_norm(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """What :func:`layer_norm` computes on XLA, on any device:
    ``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last
    ``len(normalized_shape)`` axes, in float32."""
    dims = tuple(range(-len(normalized_shape), 0))
    x32 = x.float()
    mean = x32.mean(dim=dims, keepdim=True)
    centered = x32 - mean
    var = centered.square().mean(dim=dims, keepdim=True)  # biased, as layer_norm's
    y = centered * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(_layer_norm_dtype(x, weight))


def _layer_norm_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype ``F.layer_norm`` returns: float32 inside an autocast region
    of ``x``'s device (layer_norm runs in float32 there), else ``x``'s own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.float32
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, same state dict) through
    :func:`layer_norm`: written out on XLA, where the fused op makes SPMD
    all-gather the activations; the fused kernel elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    With :attr:`checkpoint_activations` set, a forward that builds a graph
    keeps only the block's input and recomputes the rest in backward:
    activation memory of one ``[B, N, E]`` tensor per block instead of about
    a dozen, for one more forward of the block. :mod:`octfw.diagnostics.memory`
    reads the same attribute to estimate the saving.
    """

    checkpoint_activations: bool = False

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, norm_eps: float = NORM_EPS):
        super().__init__()
        self.norm1 = LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads)
        self.norm2 = LayerNorm(dim, eps=norm_eps)
        self.mlp = MLP(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The block over ``x`` ``[B, N, E]``; ``rope``: the tokens' rotary tables
        (:func:`rope_tables`), None without rotary positions."""
        function = self._residual_branches if rope is None else partial(self._residual_branches, rope=rope)
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpointed(function, x)
        return function(x)

    def _residual_branches(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


def set_activation_checkpointing(blocks: nn.ModuleList, enabled: bool) -> None:
    """Checkpoint every block of ``blocks`` (see :class:`Block`) or none."""
    for block in blocks:
        block.checkpoint_activations = enabled


def init_weights(module: nn.Module) -> None:
    """Truncated-normal weights, zero biases, unit LayerNorm (ViT convention)."""
    if isinstance(module, (nn.Linear, nn.Conv3d)):
        nn.init.trunc_normal_(module.weight, std=INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def rescale_residual_branches(blocks: nn.ModuleList) -> None:
    """Divide each block's output projections by ``sqrt(2 * layer)``.

    Every block adds two branches to the residual stream; shrinking deeper
    ones keeps the stream's variance from growing with depth at init.
    """
    with torch.no_grad():
        for layer, block in enumerate(blocks, start=1):
            block.attn.proj.weight.div_(math.sqrt(2.0 * layer))
            block.mlp.fc2.weight.div_(math.sqrt(2.0 * layer))


class ViT3DEncoder(nn.Module):
    """Patch embedding + fixed sin-cos positions + pre-norm blocks + final norm.

    ``forward(volume, keep_idx=None)``: with ``keep_idx`` (int64 ``[B, K]``)
    only those K tokens enter the blocks, so the cost scales with the visible
    tokens; without it all N tokens are encoded. Returns ``[B, K or N, E]``.

    ``activation_checkpointing`` recomputes each block in backward (see
    :class:`Block`); a training-time choice, not part of :meth:`architecture`.
    ``standardise_input`` standardises each volume (:func:`standardise_volume`)
    before the patch projection; part of :meth:`architecture`, so an exported
    encoder does the same wherever it is loaded. ``position`` (one of
    :data:`POSITIONS`) and ``norm_eps`` (the LayerNorms' epsilon) let published
    weights run as they were trained (V-JEPA 2: ``"rope"`` and 1e-6); they are in
    :meth:`architecture` when they differ from the defaults, as is ``rope_span`` (V-JEPA
    2.1's in-plane rotary positions stretched to that grid, see :func:`rope_tables`).
    """

    def __init__(
        self,
        image_size: tuple[int, int, int],
        patch_size: tuple[int, int, int],
        in_channels: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float,
        activation_checkpointing: bool = False,
        standardise_input: bool = False,
        position: str = "sincos",
        norm_eps: float = NORM_EPS,
        rope_span: int | None = None,
    ):
        super().__init__()
        if position not in POSITIONS:
            raise ValueError(f"unknown position {position!r}; choose one of {', '.join(POSITIONS)}")
        if dim_rotated(embed_dim, num_heads) == 0 and position in ROTARY:
            raise ValueError(f"rotary positions need heads of at least 6 channels, got {embed_dim // num_heads}")
        self.position = position
        self.rope_span = rope_span
        self.norm_eps = float(norm_eps)
        self.standardise_input = bool(standardise_input)
        self.image_size = tuple(image_size)
        self.patch_size = tuple(patch_size)
        self.in_channels = in_channels
        self.depth = depth
        self.num_heads = num_heads
        self.mlp_ratio = mlp_ratio
        self.grid_size = grid_shape(self.image_size, self.patch_size)
        self.num_patches = math.prod(self.grid_size)
        self.embed_dim = embed_dim
        self.patch_embed = PatchEmbed3D(self.patch_size, in_channels, embed_dim)
        if position == "sincos":
            # Not persistent: derived from the geometry, so a checkpoint holds only
            # learned weights and never carries a stale grid.
            self.register_buffer(
                "pos_embed", sincos_pos_embed_3d(self.grid_size, embed_dim)[None], persistent=False
            )
        elif position == "learned":
            self.pos_embed = nn.Parameter(sincos_pos_embed_3d(self.grid_size, embed_dim)[None])
            self.pos_embed.no_weight_decay = True  # a position table, not a weight (timm's ViT: the same)
        # "rope": no table; every attention layer rotates its queries and keys (rope_tables).
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, norm_eps) for _ in range(depth))
        self.norm = LayerNorm(embed_dim, eps=norm_eps)
        self.apply(init_weights)
        self.patch_embed.reset_parameters()  # init_weights gave it the ViT default
        rescale_residual_branches(self.blocks)
        set_activation_checkpointing(self.blocks, activation_checkpointing)

    def architecture(self) -> dict:
        """The constructor arguments, as plain data: ``ViT3DEncoder(**enc.architecture())``
        rebuilds this network (an exported encoder records them)."""
        return {
            "image_size": list(self.image_size),
            "patch_size": list(self.patch_size),
            "in_channels": self.in_channels,
            "embed_dim": self.embed_dim,
            "depth": self.depth,
            "num_heads": self.num_heads,
            "mlp_ratio": self.mlp_ratio,
            "standardise_input": self.standardise_input,
            # Only where they differ from the defaults: exports of default encoders stay as they were.
            **({"position": self.position} if self.position != "sincos" else {}),
            **({"norm_eps": self.norm_eps} if self.norm_eps != NORM_EPS else {}),
            **({"rope_span": self.rope_span} if self.rope_span is not None else {}),
        }

    def forward(self, volume: torch.Tensor, keep_idx: torch.Tensor | None = None) -> torch.Tensor:
        return self.levels(volume, keep_idx, (self.depth,))[0]

    def levels(self, volume: torch.Tensor, keep_idx: torch.Tensor | None = None,
               depths: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """The tokens after each block in ``depths`` (1 = the first block), in order; the last
        block's through the final norm, as :meth:`forward` returns them. V-JEPA 2.1 predicts
        several depths at once."""
        tokens = self.input_tokens(volume, keep_idx)
        rope = self._rope(keep_idx, tokens.device)
        outputs = []
        for depth, block in enumerate(self.blocks, start=1):
            tokens = block(tokens, rope)
            if depth in depths:
                outputs.append(self.norm(tokens) if depth == self.depth else tokens)
        return outputs

    def input_tokens(self, volume: torch.Tensor, keep_idx: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens that enter the first block, ``[B, K or N, E]``: the patches (of the
        standardised volume with ``standardise_input``) with their absolute positions (none
        with rotary positions: the blocks apply those), only those at ``keep_idx`` if given."""
        statistics = None
        if self.standardise_input:  # a structural choice, not a branch on tensor values
            statistics = volume_statistics(volume, self.patch_size, keep_idx)
        tokens = self.patch_embed(volume, statistics)
        if self.position not in ROTARY:  # structural choices, not branches on tensor values
            tokens = tokens + self.pos_embed.to(tokens.dtype)
        if keep_idx is not None:
            tokens = gather_tokens(tokens, keep_idx)
        return tokens

    def run_blocks(self, tokens: torch.Tensor, start: int = 0, stop: int | None = None,
                   keep_idx: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` (from :meth:`input_tokens`, or from block ``start - 1``) through
        ``blocks[start:stop]``, without the final norm; fine-tuning freezes the first blocks."""
        rope = self._rope(keep_idx, tokens.device)
        for block in self.blocks[start:stop]:
            tokens = block(tokens, rope)
        return tokens

    def _rope(self, keep_idx: torch.Tensor | None,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary tables of the tokens at ``keep_idx`` (all without), None without rotary positions."""
        if self.position not in ROTARY:
            return None
        return rope_tables(self.grid_size, self.embed_dim // self.num_heads, keep_idx, device,
                           interleaved=self.position == "rope-interleaved", span=self.rope_span)
