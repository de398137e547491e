"""Values a traced pipeline stage takes from a stage other than the one just before it, carried
through the stages between.

torch's tracer lets a stage take values from any earlier stage (BERT's attention mask, made once
in the first stage, reaches every layer's stage) and from the model's inputs. shardwise runs
traced stages as a schedule runs any stage, and evaluates them the same way: each takes what the
stage before it returns. So before the stages are used, every such value is added to the inputs
and outputs of each stage it skips: a stage returns exactly what the next one takes, in the
order the next one takes it. Where torch's tracer left nothing to carry, nothing changes.

This module must not choose the split: it rewrites the stages of one torch already made.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import fx

Source = tuple[int, int | None]
"""Where a stage's input comes from: (stage, index in its outputs, None for its only output);
stage -1 is the model's input (the index is the placeholder's position)."""


def carry_skipped_values(pipe: Any) -> None:
    """Rewrite the stages of `pipe` (torch's traced `Pipe`) so that each takes only what the
    stage before it returns; a no-op where that holds already. Raises ValueError where the
    stages are joined by anything but their outputs (code between them in torch's graph)."""
    from torch.distributed.pipelining._IR import get_submod_name

    count = pipe.num_stages
    stage_of = {get_submod_name(i): i for i in range(count)}
    calls = {
        stage_of[n.target]: n
        for n in pipe.split_gm.graph.nodes
        if n.op == "call_module" and n.target in stage_of
    }
    roots = [n for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]
    takes = {i: [_source(a, stage_of, roots) for a in calls[i].args] for i in range(count)}
    if all(source[0] == i - 1 for i in range(1, count) for source in takes[i]):
        return
    own = {i: len(takes[i]) for i in range(count)}
    for i in range(count - 1, 0, -1):  # what a stage takes from further back, the one before too
        for source in takes[i]:
            if source[0] < i - 1 and source not in takes[i - 1]:
                takes[i - 1].append(source)
    if any(source[0] != -1 for source in takes[0]) or len(takes[0]) != own[0]:
        raise ValueError("the first stage would have to take more than the model's input")
    for i in range(count):
        module = pipe.get_stage_module(i)
        _rewrite(module.graph, i, takes[i], own[i], takes.get(i + 1))
        module.recompile()


def _source(node: Any, stage_of: dict[str, int], roots: list[fx.Node]) -> Source:
    if node.op == "placeholder":
        return (-1, roots.index(node))
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if source.op == "call_module" and source.target in stage_of:
            return (stage_of[source.target], int(node.args[1]))
    if node.op == "call_module" and node.target in stage_of:
        return (stage_of[node.target], None)
    raise ValueError(f"a stage takes {node.op} {node.target}, not another stage's output")


def _rewrite(
    graph: fx.Graph, index: int, takes: list[Source], own: int, gives: list[Source] | None
) -> None:
    """Give stage `index` an input for each value it carries, and make it return `gives` (what
    the next stage takes), in order."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    held = dict(zip(takes[:own], placeholders, strict=True))
    last = placeholders[-1]
    for source in takes[own:]:
        with graph.inserting_after(last):
            last = held[source] = graph.placeholder(f"carried_{source[0] + 1}_{source[1]}")
    if gives is None:
        return  # the last stage returns what the model does
    output = next(n for n in graph.nodes if n.op == "output")
    produced = output.args[0]

    def value(source: Source) -> Any:
        if source[0] != index:
            return held[source]
        return produced if source[1] is None else produced[source[1]]

    output.args = (tuple(value(source) for source in gives),)
    graph.lint()
