"""V-JEPA's attentive classifier over patch tokens, for a grid of members at once.

The function is V-JEPA's (``AttentiveClassifier``: one learned query token, a
cross-attention block, a linear head), used by the ``attentive-probe``
evaluator on frozen tokens and by ``fine-tune`` as its head:

- ``x``: the tokens standardised per channel with fixed statistics of the fit
  tokens (octfw's addition: frozen tokens share a large common direction that
  a per-token layer norm keeps; with the norm alone the probe first written
  for octfw predicted one class at learning rates up to 3e-3 after 100
  epochs), then ``z = LN1(x)`` (affine);
- the query ``q0`` (``[E]``) is projected, ``q = q0 W_q + b_q``, the tokens to
  keys ``z W_k`` and values ``z W_v + b_v``; ``H`` heads of width ``d = E / H``
  attend with ``softmax_t(q_h . k_t,h / sqrt(d))``; the heads' outputs are
  concatenated and projected (``W_o``, ``b_o``);
- residual and MLP: ``h = q0 + attention``, ``h = h + MLP(LN2(h))`` (``E ->
  mlp_ratio x E -> E``, GELU);
- ``logits = h W_c + b_c``.

There is no key bias: it adds the same score to every token, which the
softmax removes.

Computed without a ``members x batch x tokens x width`` tensor: the query
does not depend on the volume, so each head's score is one dot product of the
normalised token with ``W_k,h (q_h * gamma_1)`` (a ``[G, H, E]`` vector made once
per step; the layer norm's shift adds a constant to every score), and because
the attention weights sum to 1 the values are projected after the weighted
mean of the normalised tokens. A step holds ``G x B x H x (T + E)`` floats.
The results are those of the textbook order of operations (a test compares
them).

Parameters are plain tensors in a dict with a leading member axis ``G``
(:func:`attentive_forward`); :class:`AttentiveHead` is one member as an
``nn.Module`` for training with torch's optimizers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["INIT_STD", "MLP_RATIO", "layout", "decayed", "initial_parameters", "channel_statistics",
           "attentive_forward", "AttentiveHead", "epoch_order"]

#: V-JEPA's initialisation: weights from a normal truncated at two standard deviations.
INIT_STD = 0.02
#: V-JEPA's MLP width, a multiple of the token width.
MLP_RATIO = 4


def layout(width: int, n_classes: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one member's parameters, in a fixed order."""
    hidden = MLP_RATIO * width
    return {"query": (1, width), "ln1_w": (width,), "ln1_b": (width,),
            "w_q": (width, width), "b_q": (width,), "w_k": (width, width),
            "w_v": (width, width), "b_v": (width,), "w_o": (width, width), "b_o": (width,),
            "ln2_w": (width,), "ln2_b": (width,), "w_1": (width, hidden), "b_1": (hidden,),
            "w_2": (hidden, width), "b_2": (width,), "w_c": (width, n_classes), "b_c": (n_classes,)}


def decayed(shape: tuple[int, ...]) -> bool:
    """Whether weight decay applies to a parameter of one member's ``shape``: to the query token
    and the matrices, not to biases and norm scales (V-JEPA's evaluations: every parameter
    of more than one dimension)."""
    return len(shape) > 1


def initial_parameters(width: int, n_classes: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One member's starting values: V-JEPA's (truncated normal weights and query, zero biases,
    unit norm scales; the two matrices that write into the residual scaled by 1 / sqrt(2))."""
    params = {}
    for name, shape in layout(width, n_classes).items():
        if name in ("ln1_w", "ln2_w"):
            value = torch.ones(shape)
        elif name.startswith(("b_", "ln")):
            value = torch.zeros(shape)
        else:
            value = nn.init.trunc_normal_(torch.empty(shape), std=INIT_STD, a=-2 * INIT_STD, b=2 * INIT_STD,
                                          generator=generator)
            if name in ("w_o", "w_2"):  # V-JEPA rescales a block's output layers by sqrt(2 x depth)
                value = value / math.sqrt(2.0)
        params[name] = value
    return params


def channel_statistics(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """``mean`` and ``scale`` ([E] each) of every token of ``[N, T, E]``; a constant channel stays at 0."""
    channels = tokens.detach().float().reshape(-1, tokens.shape[-1])
    return {"mean": channels.mean(dim=0), "scale": channels.std(dim=0, correction=0).clamp_min(1e-6)}


def attentive_forward(params: dict[str, torch.Tensor], tokens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, T, E]`` tokens -> ``[G, B, K]`` logits of every member; ``params`` are ``[G, ...]``
    (with the channel ``mean`` and ``scale``, ``[E]``, shared)."""
    x = (tokens.float() - params["mean"]) / params["scale"]
    members, _, width = params["query"].shape
    query_token = params["query"][:, 0]
    head = width // num_heads
    normed = F.layer_norm(x, (width,))  # LN1 without its affine, shared by every member
    query = torch.einsum("ge,gef->gf", query_token, params["w_q"]) + params["b_q"]
    w_k = params["w_k"].reshape(members, width, num_heads, head)
    # score_t = q_h . (gamma * n_t + beta) W_k,h: the beta term is the same for every token
    probe = torch.einsum("gehd,ghd->ghe", w_k, query.reshape(members, num_heads, head))
    probe = probe * params["ln1_w"][:, None] / math.sqrt(head)
    weights = torch.softmax(torch.einsum("bte,ghe->gbht", normed, probe), dim=-1)  # [G, B, H, T]
    mixed = torch.einsum("gbht,bte->gbhe", weights, normed)
    mixed = mixed * params["ln1_w"][:, None, None] + params["ln1_b"][:, None, None]  # mean of LN1(x)
    w_v = params["w_v"].reshape(members, width, num_heads, head)
    values = torch.einsum("gbhe,gehd->gbhd", mixed, w_v).reshape(members, -1, width) + params["b_v"][:, None]
    hidden = query_token[:, None] + torch.einsum("gbe,gef->gbf", values, params["w_o"]) + params["b_o"][:, None]
    normed2 = F.layer_norm(hidden, (width,)) * params["ln2_w"][:, None] + params["ln2_b"][:, None]
    inner = F.gelu(torch.einsum("gbe,gef->gbf", normed2, params["w_1"]) + params["b_1"][:, None])
    hidden = hidden + torch.einsum("gbf,gfe->gbe", inner, params["w_2"]) + params["b_2"][:, None]
    return torch.einsum("gbe,gek->gbk", hidden, params["w_c"]) + params["b_c"][:, None]


class AttentiveHead(nn.Module):
    """One member as a module: ``[B, T, E]`` tokens -> ``[B, K]`` logits (fine-tuning's head).

    The channel standardisation is a buffer, identity until :meth:`standardise_on`.
    Parameters carry no member axis: the 1-D ones are the biases and norm scales.
    """

    def __init__(self, width: int, n_classes: int, num_heads: int, generator: torch.Generator):
        super().__init__()
        if width % num_heads:
            raise ValueError(f"the tokens' width {width} is not a multiple of num_heads = {num_heads}")
        self.num_heads = num_heads
        self.params = nn.ParameterDict({name: nn.Parameter(value) for name, value in
                                        initial_parameters(width, n_classes, generator).items()})
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("scale", torch.ones(width))

    @torch.no_grad()
    def standardise_on(self, tokens: torch.Tensor) -> None:
        for name, value in channel_statistics(tokens).items():
            getattr(self, name).copy_(value)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        params = {name: value[None] for name, value in self.params.items()}
        return attentive_forward({**params, "mean": self.mean, "scale": self.scale}, tokens, self.num_heads)[0]


def epoch_order(n: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``[steps, batch_size]`` indices of one epoch of an attentive head's training (the probe's
    and fine-tuning's): a permutation, wrapped to fill its last batch, so every step has the
    same shape (one XLA graph)."""
    steps = math.ceil(n / batch_size)
    order = torch.randperm(n, generator=generator)
    return order.repeat(math.ceil(steps * batch_size / n))[:steps * batch_size].reshape(steps, batch_size)
