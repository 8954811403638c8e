"""backward(): the reverse walk over the recorded graph.

The nodes reachable from the root are put in topological order by an explicit-stack depth-first
search (no recursion, so a graph of any depth works), every one is checked before any gradient
is computed (a freed graph or a modified saved tensor raises before a leaf's `.grad` changes),
then each node runs once, after every node that feeds it a gradient: the gradients arriving at a
node from several paths are summed first."""

import numpy as np

from aieng.scratch.node import Node


def topological_order(root: Node) -> list[Node]:
    """Reachable nodes, each after all the nodes that send it a gradient (reverse postorder)."""
    order: list[Node] = []
    visited = {root}
    stack = [(root, iter(root.next_nodes))]
    while stack:
        node, children = stack[-1]
        for child in children:
            if child is not None and child not in visited:
                visited.add(child)
                stack.append((child, iter(child.next_nodes)))
                break
        else:
            stack.pop()
            order.append(node)
    order.reverse()
    return order


def run_backward(root: Node, grad: np.ndarray, retain_graph: bool) -> None:
    order = topological_order(root)
    for node in order:
        node.check()
    pending: dict[Node, np.ndarray] = {root: grad}
    for node in order:
        node_grad = pending.pop(node, None)
        if node_grad is None:  # every path to it carried no gradient
            continue
        input_grads = node.apply(node_grad)
        if not retain_graph:
            node.release()
        for next_node, g in zip(node.next_nodes, input_grads, strict=True):
            if next_node is None or g is None:
                continue
            previous = pending.get(next_node)
            pending[next_node] = g if previous is None else previous + g
