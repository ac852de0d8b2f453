"""The batch: each declared key's arrays stacked into one tensor, and stored views made float32.

:func:`collate` stacks what the transform returns for each sample, refusing
anything its ``batch_spec`` does not declare (:class:`ContractError`); in a
loader worker the batch is stacked straight into shared memory. A view that
is the same volume as an earlier one (nothing augmented it) travels once
(``share_views``, restored by :func:`with_aliases` after the transfer).

Views travel as stored (uint8 or float16) and become float32 where they
arrive (:func:`float_views`, on the device); :func:`collate_float_views`
converts them in the loader instead, for the cpu device.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from octfw.display.errors import ContractError
from octfw.types import DOMAIN_ID_KEY, UINT8_SCALE, BatchKey, STORED_VIEW_DTYPES, dequantize

__all__ = ["collate", "collate_float_views", "float_views", "shared_views", "view_keys", "with_aliases"]


def view_keys(spec: Mapping[str, BatchKey]) -> tuple[str, ...]:
    """The keys of a batch specification that are views (images the model reads as float32)."""
    return tuple(key for key, field in spec.items() if field.view)


_STORED_TORCH_DTYPES = tuple(getattr(torch, name) for name in STORED_VIEW_DTYPES)


def float_views(tensors: Mapping[str, Any], views: tuple[str, ...]) -> dict[str, Any]:
    """The batch with its ``views`` that travel as stored (uint8 ``b / 255`` or float16,
    :data:`~octfw.types.STORED_VIEW_DTYPES`) as float32 intensities, converted where they are
    (on the device, after the transfer): the one place a stored view becomes model input,
    bit for bit what :func:`~octfw.types.dequantize` gives on the host."""
    out = dict(tensors)
    for key in views:
        view = out.get(key)
        if isinstance(view, torch.Tensor) and view.dtype in _STORED_TORCH_DTYPES:
            if view.device.type == "cpu":  # numpy's cast is 3x torch's on the host, and bitwise the same
                out[key] = torch.from_numpy(dequantize(view.numpy()))
            elif view.dtype == torch.uint8:
                out[key] = view.to(torch.float32).mul_(UINT8_SCALE)
            else:  # float16 -> float32 is exact
                out[key] = view.to(torch.float32)
        elif isinstance(view, np.ndarray) and view.dtype.name in STORED_VIEW_DTYPES:
            out[key] = dequantize(view)
    return out


def shared_views(arrays: Mapping[str, Any], views: tuple[str, ...]) -> dict[str, str]:
    """Each view that is the same array as an earlier view of the sample (nothing augmented
    it) -> that earlier view."""
    aliases: dict[str, str] = {}
    for i, key in enumerate(views):
        source = next((earlier for earlier in views[:i] if earlier not in aliases
                       and _same_array(arrays.get(earlier), arrays.get(key))), None)
        if source is not None:
            aliases[key] = source
    return aliases


def collate_float_views(items: list[dict[str, Any]], spec: Mapping[str, BatchKey],
                        share_views: bool = False) -> dict[str, Any]:
    """:func:`collate`, with stored (uint8, float16) views converted to float32 in the loader (for the cpu
    device, where the training process has no device to do it on). Each sample's views are
    converted before the stacking, so in a worker the float32 batch is stacked straight into
    shared memory, not converted afterwards and copied there."""
    views = view_keys(spec)
    converted = []
    for item in items:
        arrays = item["arrays"]
        floats = float_views(arrays, views)
        if share_views:  # converted once, still one volume
            floats.update({key: floats[source] for key, source in shared_views(arrays, views).items()})
        converted.append({**item, "arrays": floats})
    return collate(converted, spec, share_views)


def collate(items: list[dict[str, Any]], spec: Mapping[str, BatchKey], share_views: bool = False) -> dict[str, Any]:
    """Stack each declared key's arrays into a batch tensor; keep provenance and quarantine
    records on the host. A key the transform returns but does not declare, a declared key it
    does not return, or an array of another shape than declared is a :class:`ContractError`:
    nothing is dropped or reshaped silently.

    ``share_views``: where every sample's view is the same array as an earlier view (nothing
    augments them), the batch carries the volume once: ``tensors`` lacks the later view and
    ``aliases`` maps it to the earlier, restored after the transfer to the device
    (:func:`with_aliases`). Half the shared memory, pinned memory and copy bytes."""
    for item in items:
        _check_declared(item["arrays"], spec)
    aliases = shared_views(items[0]["arrays"], view_keys(spec)) if share_views else {}
    aliases = {key: source for key, source in aliases.items()
               if all(_same_array(item["arrays"][source], item["arrays"][key]) for item in items)}
    tensors = {}
    for key in (*spec, DOMAIN_ID_KEY):
        if key in aliases:
            continue
        arrays = [np.asarray(item["arrays"][key]) for item in items]
        declared = spec[key].shape if key in spec else ()
        wrong = next((a.shape for a in arrays if a.shape != tuple(declared)), None)
        if wrong is not None:
            raise ContractError(f"transform output {key!r} has shape {list(wrong)} per sample; "
                                f"its batch_spec declares {list(declared)}")
        tensors[key] = _stack(arrays)
    return {
        "tensors": tensors,
        "aliases": aliases,
        "provenance": [item["provenance"] for item in items],
        "quarantined": [q for item in items for q in item["quarantined"]],
    }


def _check_declared(arrays: Mapping[str, Any], spec: Mapping[str, BatchKey]) -> None:
    returned = set(arrays) - {DOMAIN_ID_KEY}
    if returned != set(spec):
        extra, missing = sorted(returned - set(spec)), sorted(set(spec) - returned)
        raise ContractError("transform output does not match its batch_spec: "
                            + "; ".join(([f"returns undeclared {', '.join(map(repr, extra))}"] if extra else [])
                                        + ([f"lacks declared {', '.join(map(repr, missing))}"] if missing else [])))


def with_aliases(tensors: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """The batch's tensors with each aliased key pointing at the tensor it shares (see :func:`collate`)."""
    return {**tensors, **{key: tensors[source] for key, source in aliases.items()}}


def _same_array(a: Any, b: Any) -> bool:
    """Whether two arrays are views of the same memory with the same layout (the same volume)."""
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        return False
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)


def _stack(arrays: list[np.ndarray]) -> torch.Tensor:
    """One batch tensor. In a loader worker it is made in shared memory, as torch's
    ``default_collate`` makes it: the batch then reaches the training process without being
    copied into shared memory again (a batch of views at the seeds' size is 300 MB)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.from_numpy(np.stack(arrays))  # numpy's allocator: huge pages, fewer faults
    dtype = torch.from_numpy(np.empty(0, arrays[0].dtype)).dtype
    shape = (len(arrays), *arrays[0].shape)
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(math.prod(shape))
    out = torch.empty(0, dtype=dtype).new(storage).view(shape)
    np.stack(arrays, out=out.numpy())
    return out
