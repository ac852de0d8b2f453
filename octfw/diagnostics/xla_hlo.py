"""What a compiled XLA program does, read from the HLO text XLA writes out:
its collectives (how many, how many bytes), the buffers of a given shape it
materialises, and the memory its buffer assignment reserves per device.

Why the text: with SPMD, torch_xla hands XLA one graph annotated with
shardings, and the collectives (the gradient all-reduce among them) are
inserted by XLA's partitioner during compilation. No torch_xla API returns
the compiled program; XLA's dump of the optimised module is the only place
they can be counted. Ask for it with ``XLA_FLAGS`` set to :func:`dump_flags`
and read the folder with :func:`compiled_modules`.

Everything but :func:`record_update_steps` is plain text parsing, without
torch or torch_xla; that one wraps the engine's update step and imports
torch_xla, so call it only in a process of its own (torch_xla patches torch
process-wide).
"""

from __future__ import annotations

import collections
import contextlib
import math
import re
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import attrs

__all__ = [
    "COLLECTIVE_OPCODES",
    "Array",
    "GradientMatch",
    "Instruction",
    "collective_totals",
    "collectives",
    "compiled_modules",
    "dump_flags",
    "gradient_rounds",
    "instructions",
    "match_gradients",
    "module_memory_bytes",
    "module_report",
    "record_update_steps",
    "trailing_square_buffers",
    "unoptimized",
]

#: Opcodes counted as collectives. ``all-reduce-start`` is how an asynchronous
#: all-reduce appears (its result has the all-reduce's shape); the other async
#: forms carry operand and result in one tuple and are not recognised.
COLLECTIVE_OPCODES = ("all-reduce", "all-reduce-start", "all-gather", "reduce-scatter", "all-to-all",
                      "collective-permute", "collective-broadcast")

# "  %name = SHAPE opcode(" or, in newer printers, without the "%"; ROOT marks the result.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s"
                          r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[a-z]+[0-9][a-z0-9]*)\[(?P<dims>[0-9,<=]*)\]")
_OP_TYPE = re.compile(r'op_type="([^"]*)"')
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")


@attrs.frozen
class Array:
    """One array of an instruction's result: element type and dimensions."""

    dtype: str  #: XLA's name: f32, bf16, s64, pred, ...
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        bits = 8 if self.dtype == "pred" else int(re.search(r"[0-9]+", self.dtype).group())
        return (self.elements * bits + 7) // 8


@attrs.frozen
class Instruction:
    """One HLO instruction: its result arrays (several for a tuple, e.g. a
    combined all-reduce) and, when torch_xla ran with ``XLA_HLO_DEBUG=1``,
    the aten op it came from."""

    name: str
    opcode: str
    arrays: tuple[Array, ...]
    computation: str
    op_type: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def dump_flags(folder: Path | str) -> str:
    """The ``XLA_FLAGS`` words that make XLA write every compiled module as text into ``folder``."""
    return f"--xla_dump_to={folder} --xla_dump_hlo_as_text"


def compiled_modules(folder: Path | str) -> list[Path]:
    """The optimised modules XLA dumped into ``folder``, in compilation order.

    XLA names them ``module_NNNN.<name>.<backend>_after_optimizations.txt``
    (``cpu_`` here); the same folder also holds the unoptimised text and, on
    the CPU, LLVM files, which are left out."""
    paths = Path(folder).glob("module_*after_optimizations.txt")
    return sorted(paths, key=lambda p: int(p.name.split(".", 1)[0].removeprefix("module_")))


def unoptimized(module: Path) -> Path:
    """The text of the same module as torch_xla handed it to XLA (before
    partitioning and optimisation: global shapes, the dtypes the model asked for)."""
    return module.with_name(re.sub(r"\.[a-z]*_?after_optimizations\.txt$", ".before_optimizations.txt", module.name))


def _arrays(shape: str) -> tuple[Array, ...]:
    return tuple(Array(m["dtype"], tuple(int(d.removeprefix("<=")) for d in m["dims"].split(",") if d))
                 for m in _ARRAY.finditer(shape))


def instructions(hlo_text: str, entry_only: bool = False) -> list[Instruction]:
    """Every instruction of a module's text; with ``entry_only`` only those of
    the entry computation, whose results are the buffers the program
    materialises (instructions inside a fused computation are not)."""
    out: list[Instruction] = []
    computation, in_entry = "", False
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and " = " not in line.split("{", 1)[0]:
            computation, in_entry = header["name"], bool(header["entry"])
            continue
        if entry_only and not in_entry:
            continue
        match = _INSTRUCTION.match(line)
        if match:
            op_type = _OP_TYPE.search(match["rest"])
            out.append(Instruction(match["name"], match["opcode"], _arrays(match["shape"]), computation,
                                   op_type.group(1) if op_type else None))
    return out


def collectives(hlo_text: str) -> list[Instruction]:
    """The collective operations of a compiled (partitioned) module."""
    return [i for i in instructions(hlo_text) if i.opcode in COLLECTIVE_OPCODES]


def collective_totals(ops: Iterable[Instruction]) -> dict[str, dict[str, int]]:
    """Count and result bytes per collective opcode (``-start`` folded into its op)."""
    totals: dict[str, dict[str, int]] = {}
    for op in ops:
        entry = totals.setdefault(op.opcode.removesuffix("-start"), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += op.nbytes
    return totals


@attrs.frozen
class GradientMatch:
    """All-reduces paired with gradients by element count."""

    rounds: int  #: times every gradient was to be found (backward passes in the graph)
    missing: list[int]  #: one size (elements) per gradient all-reduce not found
    extra: list[Instruction]  #: all-reduces left over: not gradients (loss sums, metrics, ...)
    gradient_bytes: int  #: bytes of the all-reduces paired with gradients

    @property
    def extra_bytes(self) -> int:
        return sum(op.nbytes for op in self.extra)


def _by_size(all_reduces: Iterable[Instruction]) -> dict[int, list[tuple[Instruction, Array]]]:
    pool: dict[int, list[tuple[Instruction, Array]]] = collections.defaultdict(list)
    for op in all_reduces:
        for array in op.arrays:  # a combined all-reduce holds several gradients
            pool[array.elements].append((op, array))
    return pool


def gradient_rounds(all_reduces: Iterable[Instruction], gradient_sizes: Iterable[int]) -> int:
    """How many times over every gradient size is all-reduced: 1 for a graph
    with one backward pass, 0 when some gradient is not all-reduced at all."""
    pool, wanted = _by_size(all_reduces), collections.Counter(gradient_sizes)
    return min((len(pool[size]) // count for size, count in wanted.items()), default=0)


def match_gradients(all_reduces: Iterable[Instruction], gradient_sizes: Iterable[int],
                    rounds: int = 1) -> GradientMatch:
    """Pair all-reduces with gradients by element count, ``rounds`` times
    over (once per backward pass in the graph).

    Element counts, not shapes: XLA may lay a gradient out transposed (a
    Conv3d weight's all-reduce is channels-last). What is not paired is
    ``extra``: the loss, metric and counter sums of the step. Among
    all-reduces of one size, which ones count as extra is arbitrary; the
    byte totals are exact."""
    pool, wanted = _by_size(all_reduces), collections.Counter(gradient_sizes)
    missing, extra, paired_bytes = [], [], 0
    for size in sorted(set(pool) | set(wanted)):
        entries, needed = pool.get(size, []), wanted.get(size, 0) * rounds
        missing += [size] * max(0, needed - len(entries))
        paired_bytes += sum(array.nbytes for _, array in entries[:needed])
        extra += [op for op, _ in entries[needed:]]
    unique = list({op.name: op for op in extra}.values())
    return GradientMatch(rounds=rounds, missing=missing, extra=unique, gradient_bytes=paired_bytes)


def trailing_square_buffers(hlo_text: str, size: int) -> list[Instruction]:
    """Buffers of the entry computation whose last two dimensions are
    ``size x size``: at ``size`` = tokens, the attention scores and
    probabilities a decomposed attention materialises."""
    return [i for i in instructions(hlo_text, entry_only=True)
            if any(len(a.dims) >= 3 and a.dims[-2:] == (size, size) for a in i.arrays)]


def module_memory_bytes(module: Path) -> int | None:
    """Bytes XLA's buffer assignment reserves for one device's program (its
    ``-memory-usage-report``); None when XLA wrote no report."""
    report = module.with_name(module.name.removesuffix(".txt") + "-memory-usage-report.txt")
    if not report.exists():
        return None
    match = re.search(r"Total bytes used: ([0-9]+)", report.read_text())
    return int(match.group(1)) if match else None


def module_report(module: Path, gradient_sizes: list[int], tokens: Iterable[int] = ()) -> dict[str, Any]:
    """One compiled module as JSON-ready data: its collectives, the all-reduces
    paired with the gradients (``gradient_sizes``: elements per trainable
    parameter), XLA's per-device memory and, for each size in ``tokens``, the
    attention buffers of ``size x size`` it materialises and the score
    matmuls torch_xla emitted (global shapes, the dtypes the model asked for)."""
    text = module.read_text()
    ops = collectives(text)
    all_reduces = [op for op in ops if op.opcode.startswith("all-reduce")]
    rounds = gradient_rounds(all_reduces, gradient_sizes)
    match = match_gradients(all_reduces, gradient_sizes, rounds=max(rounds, 1))
    before = unoptimized(module)
    before_text = before.read_text() if before.exists() and tokens else ""
    return {
        "name": module.name, "memory_bytes": module_memory_bytes(module),
        "collectives": collective_totals(ops),
        "all_reduce_dtypes": sorted({a.dtype for op in all_reduces for a in op.arrays}),
        "gradient_rounds": rounds, "missing": match.missing, "gradient_bytes": match.gradient_bytes,
        "extra": [{"dims": [list(a.dims) for a in op.arrays], "dtype": op.arrays[0].dtype, "op_type": op.op_type}
                  for op in match.extra],
        "extra_bytes": match.extra_bytes,
        "all_gathers": [{"dims": list(op.arrays[0].dims), "bytes": op.nbytes, "op_type": op.op_type}
                        for op in ops if op.opcode == "all-gather"],
        "attention_buffers": [
            {"tokens": size, "opcode": op.opcode, "dtype": op.arrays[0].dtype, "dims": list(op.arrays[0].dims),
             "bytes": op.nbytes, "op_type": op.op_type}
            for size in tokens for op in trailing_square_buffers(text, size)],
        "attention_score_dots_before_optimization": [
            {"tokens": size, "dtype": op.arrays[0].dtype, "dims": list(op.arrays[0].dims)}
            for size in tokens for op in trailing_square_buffers(before_text, size) if op.opcode == "dot"],
    }


@contextlib.contextmanager
def record_update_steps(dump: Path | str) -> Iterator[list[dict[str, Any]]]:
    """While open, every ``Trainer.update`` call appends a row: the update
    step, its wall time, the graphs it compiled (count, seconds from
    torch_xla's ``CompileTime``, the module files XLA dumped into ``dump``)
    and the graphs it executed. The first trainer is ``rows[0]["trainer"]``.

    Each update waits for its graphs to finish (executions are counted when
    they end), so the engine's host/device overlap is gone while recording:
    times here are per step, not throughput."""
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from octfw.engine.trainer import Trainer

    def metric(name: str, field: int) -> int:
        data = met.metric_data(name)
        return data[field] if data else 0

    def counters() -> tuple[int, int, int]:
        executions = metric("ExecuteTime", 0) + metric("ExecuteReplicatedTime", 0)
        return metric("CompileTime", 0), metric("CompileTime", 1), executions

    rows: list[dict[str, Any]] = []
    real_update = Trainer.update

    def recorded_update(self, update_step):
        known, (compiles, compile_ns, executions) = set(compiled_modules(dump)), counters()
        started = time.perf_counter()
        result = real_update(self, update_step)
        xm.wait_device_ops()
        wall = time.perf_counter() - started
        after = counters()
        rows.append({"step": update_step, "wall_s": wall, "compiles": after[0] - compiles,
                     "compile_s": (after[1] - compile_ns) / 1e9, "executions": after[2] - executions,
                     "compiled": [p.name for p in compiled_modules(dump) if p not in known],
                     **({"trainer": self} if not rows else {})})
        return result

    Trainer.update = recorded_update
    try:
        yield rows
    finally:
        Trainer.update = real_update
