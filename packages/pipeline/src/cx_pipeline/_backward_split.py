"""Zero-bubble backward: input gradients now, weight gradients later, without computing anything twice.

`backward_input` walks the autograd graph of one stage's forward, finds the *intermediate* nodes that sit on the
path to the stage inputs and also feed a weight-only subgraph (for a linear layer: its matmul node), and records the
gradient arriving at each of them while computing the input gradients. `WeightGrad.run` later starts autograd at
those nodes (public `GradientEdge`s) with the recorded gradients, restricted to the parameters behind them, so each
node recomputes only its weight-side outputs. Where a parameter is also reachable along the input path (weights shared
inside one chunk), that restriction cannot avoid counting twice, so the weight pass recomputes the whole backward
restricted to the parameters instead (correct, slower; reported by `WeightGrad.recomputes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGrad", "backward_input"]


def _node(tensor: torch.Tensor) -> Node | None:
    if not tensor.requires_grad:
        return None
    node: Node = get_gradient_edge(tensor).node
    return node


def _bits(mask: int) -> set[int]:
    return {i for i in range(mask.bit_length()) if mask >> i & 1}


def _analyse(
    roots: Sequence[Node], inputs: dict[Node, int], params: dict[Node, int]
) -> tuple[dict[Node, list[Node]], dict[Node, int], dict[Node, int]]:
    """One walk of the graph below `roots`: every node's children, and the inputs and parameters reachable from
    it (bit masks over their indices). Bit masks and one walk keep this cheap: it runs per micro-batch."""
    children: dict[Node, list[Node]] = {}
    to_inputs: dict[Node, int] = {}
    to_params: dict[Node, int] = {}
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if node in to_inputs:
            continue
        if expanded:
            reach_in = 1 << inputs[node] if node in inputs else 0
            reach_param = 1 << params[node] if node in params else 0
            for child in children[node]:
                reach_in |= to_inputs[child]
                reach_param |= to_params[child]
            to_inputs[node] = reach_in
            to_params[node] = reach_param
        else:
            if node not in children:
                children[node] = [child for child, _ in node.next_functions if child is not None]
            stack.append((node, True))
            stack.extend((child, False) for child in children[node] if child not in to_inputs)
    return children, to_inputs, to_params


class WeightGrad:
    """The deferred weight-gradient pass of one stage and micro-batch."""

    def __init__(
        self,
        groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]],
        fallback: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None,
    ) -> None:
        self._groups = groups
        self._fallback = fallback

    @property
    def recomputes(self) -> bool:
        return self._fallback is not None

    def run(self) -> None:
        """Accumulate the weight gradients into `.grad` (through AccumulateGrad, so gradient hooks fire)."""
        if self._fallback is not None:
            outputs, grads, params = self._fallback
            torch.autograd.backward(outputs, grads, inputs=params)
        # retain_graph: groups can share nodes below their sources; the graph goes when the step drops its outputs
        for edges, grads, params in self._groups:
            torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
        self._groups = []
        self._fallback = None


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGrad]:
    """Gradients of `inputs` now (None where unused); the parameters' gradients as a `WeightGrad` to run later."""
    roots = [node for node in (_node(o) for o in outputs) if node is not None]
    input_index = {node: i for i, node in enumerate(n for n in (_node(x) for x in inputs) if n is not None)}
    trainable = [p for p in params if p.requires_grad]
    param_index = {get_gradient_edge(p).node: i for i, p in enumerate(trainable)}
    children, to_inputs, to_params = _analyse(roots, input_index, param_index)

    # Weight-side edges: (node on the input path) -> (child that reaches parameters but not inputs).
    captured: dict[Node, list[Any]] = {}
    weight_sources: list[tuple[Node, int]] = []
    input_sides: dict[Node, int] = {}
    shared = False
    for node, reached_inputs in to_inputs.items():
        if not reached_inputs:
            continue
        weight_side = 0
        input_side = 0
        for child in children[node]:
            if to_inputs[child]:
                input_side |= to_params[child]
            else:
                weight_side |= to_params[child]
        if weight_side:
            weight_sources.append((node, weight_side))
            input_sides[node] = input_side
            shared |= bool(weight_side & input_side)
    param_only_roots = [(o, g) for o, g in zip(outputs, grads, strict=True) if (n := _node(o)) and not to_inputs[n]]

    reachable_mask = 0
    for root in roots:
        reachable_mask |= to_params[root]
    reachable = sorted(_bits(reachable_mask))
    recompute = WeightGrad([], (list(outputs), list(grads), [trainable[i] for i in reachable]))
    if shared:
        return _grad_inputs(outputs, grads, inputs), recompute

    handles = []
    for node, _ in weight_sources:

        def hook(grad_outputs: tuple[Any, ...], node: Node = node) -> None:
            captured[node] = list(grad_outputs)

        handles.append(node.register_prehook(hook))
    try:
        grads_in = _grad_inputs(outputs, grads, inputs)
    finally:
        for handle in handles:
            handle.remove()

    # Group the sources by the parameters they feed (union of overlapping parameter sets), one autograd call each.
    groups: list[tuple[list[GradientEdge], list[torch.Tensor], set[int]]] = []
    for node, mask in weight_sources:
        param_ids = _bits(mask)
        edges = [GradientEdge(node, i) for i, g in enumerate(captured.get(node, [])) if g is not None]
        values = [g for g in captured.get(node, []) if g is not None]
        if not edges:
            continue
        merged = [grp for grp in groups if grp[2] & param_ids]
        for grp in merged:
            groups.remove(grp)
            edges += grp[0]
            values += grp[1]
            param_ids = param_ids | grp[2]
        groups.append((edges, values, set(param_ids)))
    # A group's autograd call must not reach its parameters along a source's input side (that would count a
    # path twice); grouping can bring such parameters together, so check the groups as formed.
    if any(_bits(input_sides[edge.node]) & ids for edges, _, ids in groups for edge in edges):
        return grads_in, recompute
    if param_only_roots:  # outputs that never touch the inputs: one call from them (they may share a subgraph)
        reached: set[int] = set()
        for output, _ in param_only_roots:
            origin = _node(output)
            assert origin is not None
            reached |= _bits(to_params[origin])
        groups.append(([get_gradient_edge(o) for o, _ in param_only_roots], [g for _, g in param_only_roots], reached))
    plan = [(edges, values, [trainable[i] for i in sorted(ids)]) for edges, values, ids in groups if ids]
    return grads_in, WeightGrad(plan, None)


def _grad_inputs(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    wanted = [x for x in inputs if x.requires_grad]
    if not wanted:
        return [None] * len(inputs)
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    result = torch.autograd.grad(
        [o for o, _ in pairs], wanted, [g for _, g in pairs], retain_graph=True, allow_unused=True
    )
    by_id = {id(x): r for x, r in zip(wanted, result, strict=True)}
    return [by_id.get(id(x)) for x in inputs]
