"""The model stage's contract: what ``forward`` returns (:class:`ModelOutput`), what every
model has (:class:`Model`) and the optional capabilities the engine, the evaluators and the
commands use when a model has them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, runtime_checkable

from octfw.types.capability import _CapabilityMeta

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = [
    "ModelOutput", "Model", "EMAModel", "ParamGroupsModel", "EmbeddingModel",
    "ExportableEncoder", "EncoderModel", "BlockwiseEncoder", "CountingModel", "ActivationCheckpointing",
]


@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """What a model's ``forward`` returns. Every field is a device tensor.

    Reading any field on the host forces a device-to-host sync; the engine
    does so only on log steps.

    A frozen dataclass rather than attrs: ``torch.compile`` (dynamo) traces a
    dataclass's ``__init__``, but not the ``object.__setattr__.__get__`` of a
    frozen attrs class, where it broke the graph at the end of every model's
    ``forward`` (``tests/test_compile.py``).
    """

    loss: "torch.Tensor"  #: scalar float32, the value that is back-propagated
    per_sample_loss: "torch.Tensor"  #: float32 ``[B]``, for per-domain logging
    metrics: Mapping[str, "torch.Tensor"] = dataclasses.field(default_factory=dict)  #: scalars
    #: Optional float32 square matrix: the Gram matrix of a fixed-size sample of the exported
    #: network's tokens (:func:`octfw.models.health.rank_gram`). The engine copies it to the
    #: host on log steps only and logs its RankMe (``rankme``, ``rankme_max``), a decomposition
    #: the device should not do every step.
    health_gram: "torch.Tensor | None" = None


@runtime_checkable
class Model(Protocol, metaclass=_CapabilityMeta):
    """What the engine trains: in practice a ``torch.nn.Module``.

    ``model(batch)`` (that is, ``forward``) takes the collated batch, a dict
    of device tensors keyed as the transform's :meth:`Transform.batch_spec`
    (plus ``domain_id``), and returns a :class:`ModelOutput`. ``inputs``
    names the keys it reads: a key the transform does not make is refused
    when the run is built. The other members are the ``nn.Module``
    methods the engine, ``octfw check`` and the evaluators call: placing the
    model on its device, the optimizer's parameters, checkpoints, and
    switching between training and evaluation.

    Hot path: ``forward`` runs every micro-step and must not force a
    device-to-host sync.
    """

    inputs: tuple[str, ...]

    def forward(self, batch: Mapping[str, "torch.Tensor"]) -> ModelOutput: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator["torch.nn.Parameter"]: ...

    def modules(self) -> Iterator[Any]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


@runtime_checkable
class EMAModel(Model, Protocol):
    """Optional: a model with an EMA target encoder (V-JEPA's ``vjepa3d``).

    ``ema_update(momentum)`` runs after every optimizer step when the
    schedule gives an EMA momentum. ``momentum`` is a device scalar; 1.0
    means "leave the EMA as it is", which is how a vetoed update leaves it
    untouched. Hot path: must not force a sync.
    """

    def ema_update(self, momentum: "torch.Tensor | float") -> None: ...


@runtime_checkable
class ParamGroupsModel(Model, Protocol):
    """Optional: the model chooses its optimizer groups.

    ``param_groups(weight_decay) -> [{"params": [...], "weight_decay": w, ...}]``
    over the trainable parameters; the engine asks at weight decay 1.0 to
    learn which groups decay (``weight_decay > 0``). Without it every
    trainable parameter is one decaying group.
    """

    def param_groups(self, weight_decay: float) -> list[dict]: ...


@runtime_checkable
class EmbeddingModel(Protocol, metaclass=_CapabilityMeta):
    """Optional: the frozen representation evaluators measure.

    ``embed(volume)`` takes float32 ``[B, C, D, H, W]`` and returns the
    target encoder's tokens ``[B, N, E]`` (or pooled ``[B, E]``). The
    evaluators call it under ``torch.no_grad``; without it they call
    ``model(volume)`` (an encoder on its own).
    """

    def embed(self, volume: "torch.Tensor") -> "torch.Tensor": ...


@runtime_checkable
class ExportableEncoder(Protocol, metaclass=_CapabilityMeta):
    """An encoder ``octfw export`` and ``run.export_encoder`` can write out.

    ``architecture()`` returns its constructor arguments as plain data (an
    export records them); ``encoder(volume)`` maps ``[B, C, D, H, W]`` to
    tokens ``[B, N, E]``; its ``state_dict`` holds the weights. The export
    formats rebuild the network as :class:`octfw.models.vit3d.ViT3DEncoder`,
    so ``octfw export`` also requires that class.
    """

    def architecture(self) -> dict: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator["torch.nn.Parameter"]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...


@runtime_checkable
class BlockwiseEncoder(Protocol, metaclass=_CapabilityMeta):
    """An encoder that an evaluator runs in pieces (the built-in 3D ViT): the fine-tune
    evaluators freeze its first blocks and train the rest.

    ``input_tokens(volume)``: float32 ``[B, C, D, H, W]`` to the tokens ``[B, N, E]`` that
    enter the first block (what the encoder does before its blocks, e.g. standardising the
    volume and adding positions, stays its own); ``run_blocks(tokens, start, stop)``: those
    tokens through ``blocks[start:stop]`` (rotary positions are applied there); ``norm``:
    the final norm; ``blocks``, ``patch_embed``: the modules that train (layer-wise learning
    rates are set by their names); ``embed_dim``: the token width.
    """

    embed_dim: int
    blocks: Any
    patch_embed: Any
    norm: Any

    def input_tokens(self, volume: "torch.Tensor") -> "torch.Tensor": ...

    def run_blocks(self, tokens: "torch.Tensor", start: int = 0, stop: int | None = None) -> "torch.Tensor": ...


@runtime_checkable
class EncoderModel(Protocol, metaclass=_CapabilityMeta):
    """Optional: a model whose ``encoder`` is the network to keep after pretraining
    (the target encoder); exported when it is an :class:`ExportableEncoder`,
    and what the ``fine-tune`` evaluator trains."""

    encoder: Any


@runtime_checkable
class CountingModel(Protocol, metaclass=_CapabilityMeta):
    """Optional: ``count_parameters() -> {"encoder": n, "predictor": m, ...}``, shown by
    ``octfw check`` (else the number of trainable parameters)."""

    def count_parameters(self) -> dict[str, int]: ...


@runtime_checkable
class ActivationCheckpointing(Protocol, metaclass=_CapabilityMeta):
    """Optional, on a **submodule** of a model: its activations can be recomputed in backward.

    ``checkpoint_activations`` says whether it does; ``octfw check``'s memory
    estimate toggles it to measure the saving (the built-in ViT blocks).
    """

    checkpoint_activations: bool
