"""Kernel fusion over a planned graph, for the CUDA backend: pairs of nodes one kernel runs.

`launch_lists(graph, plan, kernels, node_ptr)` gives, per segment and node, the kernel function
to call and the tensors it reads (`kernels`: each segment's kernel functions in node order,
`node_ptr`: each computed node's device address). Today one pattern is fused:

- `add(mul_mat(w, x), b)` with b a vector of the product's M rows (a linear layer's bias),
  where the add directly follows the product, is the product's only consumer and writes over
  the product's buffer (the planner's in-place rule): the product's slot does nothing and the
  add's runs `matmul.mul_mat_add_bias` on (w, x, b), one GEMM with the bias in cuBLAS's epilogue
  (the separate add read and wrote the whole F32 output again: 15 of SDXL's 100 ms of kernels).

Nothing runs between the two slots, so w and x are as the product would have read them, and the
planner placed no other live tensor in the product's buffer.
"""
from __future__ import annotations

from .matmul import mul_mat_add_bias


def _skip(node, xs, out, rt) -> None:
    """The slot of a node whose work a later fused kernel does."""


def _is_whole(t, node) -> bool:
    """Whether tensor `t` is node's output itself (not a view of part of it)."""
    return t.owner is node and t.offset == node.offset and tuple(t.ne) == tuple(node.ne) \
        and tuple(t.nb) == tuple(node.nb)


def _bias_of(add, mm) -> bool:
    y, b = add.src
    m = mm.ne[0]
    return (_is_whole(y, mm) and b.dtype.name in ("F32", "F16", "BF16") and b.ne[0] == m
            and all(d == 1 for d in b.ne[1:]) and b.nb[0] == b.dtype.type_size
            and tuple(add.ne) == tuple(mm.ne))


def launch_lists(graph, plan, kernels, node_ptr) -> list[list[tuple]]:
    """Per segment, [(fn, tensors it reads)] in node order: each node's own kernel on its
    sources, but for the fused pairs (see the module doc)."""
    uses: dict[int, int] = {}
    for n in graph.nodes:
        for s in n.src:
            uses[id(s.owner)] = uses.get(id(s.owner), 0) + 1
    outputs = {id(n) for n in plan.outputs}
    lists = []
    for seg, fns in zip(plan.segments, kernels):
        nodes = seg.nodes
        out = [(fn, tuple(n.src)) for fn, n in zip(fns, nodes)]
        for j in range(len(nodes) - 1):
            mm, add = nodes[j], nodes[j + 1]
            if (mm.op == "mul_mat" and add.op == "add" and uses.get(id(mm)) == 1 and id(mm) not in outputs
                    and node_ptr.get(id(add)) == node_ptr.get(id(mm)) and _bias_of(add, mm)):
                out[j] = (_skip, ())
                out[j + 1] = (mul_mat_add_bias, (*mm.src, add.src[1]))
        lists.append(out)
    return lists
