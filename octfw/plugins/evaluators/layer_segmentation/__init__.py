"""The ``layer-segmentation`` evaluator: retinal layers segmented from the encoder's tokens.

Config, factory and registration; the class is :mod:`.evaluator`, the decoders and training
:mod:`.algorithm`, the metrics :mod:`.metrics`.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import choices, component_table, doc, in_range, non_negative, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Evaluator

__all__ = ["LayerSegmentationConfig", "build"]


def _blocks(instance: Any, attribute: attrs.Attribute, value: int | str) -> None:
    # bool is an int to Python; `blocks = true` is a mistake, not block 1.
    if value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    raise ValueError(f"must be 0 (frozen), a number of last blocks k >= 1 or 'all', got {value!r}")


def _domains(instance: Any, attribute: attrs.Attribute, value: list[str] | None) -> None:
    if value is not None and (not value or not all(isinstance(d, str) and d for d in value)):
        raise ValueError(f"must be a non-empty list of domain names, got {value!r}")


@attrs.frozen
class LayerSegmentationConfig:
    """A light decoder (UNETR-style from the tokens of several blocks, or linear per patch) predicts
    every voxel's retinal layer, on a frozen or partly fine-tuned encoder, from the labelled volumes
    a budget allows; Dice per layer, mean Dice and boundary error in micrometres, with patient-level
    bootstrap intervals, per vendor, and in-vendor against cross-vendor with `train_domains`."""

    dataset: dict[str, Any] = component_table(
        "dataset",
        "dataset with layer labels per volume, a component table: { name = \"synthetic-oct\" } or "
        "{ name = \"phantom-oct\", family = \"held-out\" } (both write them), or { name = \"dicom\", "
        "path = \"cohort.jsonl\" } (a manifest with layers and layer_names columns)",
    )
    test_dataset: dict[str, Any] | None = component_table(
        "dataset",
        "held-out dataset table with layer labels; unset: `dataset` is split by train_fraction",
        default=None,
    )
    train_fraction: float = doc(
        "share of the training vendors' patients the decoder may be trained on when test_dataset is "
        "unset (whole patients, stratified by vendor)",
        default=0.5, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    val_fraction: float = doc(
        "share of the train split held out to choose the epoch (whole patients); the test split never "
        "chooses",
        default=0.25, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    train_domains: list[str] | None = doc(
        "vendors (domains) whose volumes may be labelled, e.g. [\"heidelberg\"]: the others are only "
        "tested on, and the report adds in_vendor_ (held-out volumes of these) and cross_vendor_ "
        "(the others) metrics; unset: every vendor is trained and tested on",
        default=None, validator=_domains,
    )
    split_seed: int = doc(
        "seed of the splits, the --shots draws and the bootstrap (independent of the run's seed)",
        default=0, validator=non_negative,
    )
    every_steps: int | None = doc(
        "evaluate every N update steps; unset: only at the end of training",
        default=None, validator=positive,
    )
    batch_size: int = doc("volumes per forward pass when encoding and predicting", default=4, validator=positive)
    bootstrap: int = doc(
        "bootstrap resamples of the test split's patients for the 95 % intervals; 0: no intervals",
        default=1000, validator=non_negative,
    )
    decoder: str = doc(
        "'unetr': the tokens of `taps` evenly spaced blocks and the volume, upsampled to voxels by "
        "transposed convolutions and fused (UNETR); 'linear': the final tokens alone, a linear map to "
        "each patch's voxels",
        default="unetr", validator=choices("unetr", "linear"),
    )
    taps: int = doc(
        "blocks whose tokens the unetr decoder reads, evenly spaced, the last block included (UNETR: 4)",
        default=4, validator=positive,
    )
    decoder_width: int = doc("channels of the unetr decoder's convolutions", default=16, validator=positive)
    blocks: int | str = doc(
        "what trains under the decoder: 0, the encoder frozen (its tokens computed once); k, its last "
        "k blocks and final norm; 'all', the whole encoder, patch embedding included",
        default=0, validator=_blocks,
    )
    epochs: int = doc("passes over the labelled volumes (or min_steps updates, whichever is more)",
                      default=30, validator=positive)
    min_steps: int = doc(
        "update steps at least, whatever the label budget: 1 labelled volume trains min_steps steps, "
        "not epochs (an epoch of one volume is one step); 0: epochs alone",
        default=1000, validator=non_negative,
    )
    validations: int = doc(
        "times the validation split is scored, evenly spaced over the fit (the last after its last step); "
        "the best chooses the network that predicts the test split",
        default=10, validator=positive,
    )
    fit_batch_size: int = doc(
        "volumes per update step (capped at the labelled volumes; every step is full)",
        default=4, validator=positive,
    )
    lr: float = doc(
        "peak AdamW learning rate of the decoder and the final norm (10 % warmup, then cosine to 0); "
        "block i of depth L gets lr x layer_decay ^ (L - i), the patch embedding lr x layer_decay ^ (L + 1)",
        default=3e-3, validator=positive,
    )
    layer_decay: float = doc(
        "layer-wise learning-rate decay in (0, 1] of the encoder's blocks that train",
        default=0.75, validator=in_range(0.0, 1.0, low_open=True),
    )
    weight_decay: float = doc(
        "decoupled AdamW weight decay of the matrices (none on biases and norm scales)",
        default=0.05, validator=non_negative,
    )
    seed: int = doc("seed of the decoder's initial weights and the mini-batch order", default=0,
                    validator=non_negative)


def build(config: LayerSegmentationConfig, ctx: BuildContext) -> Evaluator:
    from octfw.plugins.evaluators.layer_segmentation.evaluator import LayerSegmentationEvaluator

    return LayerSegmentationEvaluator.from_config(config, ctx)


@hookimpl
def octfw_register_evaluators(register: Register) -> None:
    register(
        "layer-segmentation",
        LayerSegmentationConfig,
        build,
        "Retinal layers segmented per voxel by a light decoder (UNETR-style or linear) on the frozen or "
        "fine-tuned encoder; Dice per layer, boundary error in µm, per vendor and across vendors.",
    )
