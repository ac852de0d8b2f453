"""What ``torch.compile`` makes of one training step: graphs, graph breaks, recompilations.

``octfw check`` reports it for a recipe with ``engine.compile = true``. A graph
break splits the step into several compiled graphs with Python in between,
and code resumed after a break can recompile on every update step (it did,
after a break in ``effective_rank``: 69 s for the first step of ``tiny``,
3.8 s for each of the next nine; benchmarks/accelerators/README.md). Both are cheap to see
here and costly to find on an accelerator.

Dynamo only, no Inductor: graphs are captured (``torch._dynamo.explain``) and
the backward is traced by AOTAutograd (``aot_eager``), then run eagerly, so
the report takes seconds where compiling takes minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs
import torch

__all__ = ["GraphBreak", "CompileReport", "compile_report"]


@attrs.frozen
class GraphBreak:
    """One place dynamo stopped tracing: why, and where in the user's code."""

    reason: str  #: dynamo's reason, its first line
    location: str  #: ``file:line in function`` of the innermost user frame, or "" when unknown

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}" if self.location else self.reason


@attrs.frozen
class CompileReport:
    """Dynamo's view of one training step (forward and loss; the backward traced)."""

    graphs: int  #: graphs captured from the forward and loss
    breaks: tuple[GraphBreak, ...]  #: graph breaks in them, each with its reason
    #: graphs compiled again by a second, identical step (0: the step compiles once)
    recompilations: int

    def summary(self) -> str:
        """``torch.compile: 1 graph, 0 graph breaks; ...``: the line ``octfw check`` prints."""
        graphs = f"{self.graphs} graph{'' if self.graphs == 1 else 's'}"
        breaks = f"{len(self.breaks)} graph break{'' if len(self.breaks) == 1 else 's'}"
        again = ("a second step recompiles nothing" if self.recompilations == 0
                 else f"a second step compiled {self.recompilations} graph(s) again")
        return f"torch.compile: {graphs}, {breaks} in forward and loss; backward traced; {again}"

    @property
    def clean(self) -> bool:
        return not self.breaks and self.recompilations == 0


def _location(frame: Any) -> str:
    if frame is None:
        return ""
    filename = Path(frame.filename)
    parts = filename.parts
    shown = Path(*parts[parts.index("octfw"):]) if "octfw" in parts else filename  # the package's own files
    return f"{shown}:{frame.lineno} in {frame.name}"


def _first_line(reason: str) -> str:
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    # dynamo's messages open with a title ("Unsupported function call") then "Explanation: ..."
    explanation = next((line for line in lines if line.startswith("Explanation:")), None)
    head = lines[0] if lines else "(no reason given)"
    return f"{head}: {explanation[len('Explanation:'):].strip()}" if explanation else head


def compile_report(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   loss: Callable[[Any], torch.Tensor] = lambda out: out.loss) -> CompileReport:
    """Graphs, graph breaks and recompilations of ``model(batch)`` and its backward.

    The model runs three times (one capture, two compiled steps); gradients
    accumulate in ``.grad`` and dynamo's caches are reset before and after.
    ``loss`` picks the scalar to back-propagate from the model's output.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    # explain counts breaks as graphs - 1, which misses a break after the
    # last graph (one at the end of forward, as ModelOutput's was); its
    # break_reasons lists every one.
    explained = torch._dynamo.explain(model)(batch)
    breaks = tuple(GraphBreak(_first_line(r.reason), _location(r.user_stack[-1] if r.user_stack else None))
                   for r in explained.break_reasons)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")  # forward and backward traced, run eagerly
    try:
        loss(compiled(batch)).backward()
        first = counters["stats"]["unique_graphs"]
        loss(compiled(batch)).backward()
        again = counters["stats"]["unique_graphs"] - first
    finally:
        torch._dynamo.reset()
    return CompileReport(graphs=explained.graph_count, breaks=breaks, recompilations=again)
