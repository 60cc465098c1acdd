"""Kernel fusion over a planned graph, for the CUDA backend: runs of nodes one kernel does.

`launch_lists(graph, plan, kernels, node_ptr)` gives, per segment and node, the kernel function
to call and the tensors it reads (`kernels`: each segment's kernel functions in node order,
`node_ptr`: each computed node's device address). Two patterns are fused:

- `add(mul_mat(w, x), b)` with b a vector of the product's M rows (a linear layer's bias),
  where the add directly follows the product, is the product's only consumer and writes over
  the product's buffer (the planner's in-place rule): the product's slot does nothing and the
  add's runs `matmul.mul_mat_add_bias` on (w, x, b), one GEMM with the bias in cuBLAS's epilogue
  (the separate add read and wrote the whole F32 output again: 15 of SDXL's 100 ms of kernels).

- `add(add(mul_mat(w, x), b), r)` (r on either side), the same pair followed directly by the
  residual add of a transformer block, which writes over the same buffer and reads r of the
  output's size: the product's and the bias add's slots do nothing and the last runs
  `matmul.mul_mat_add_bias_residual`, the same GEMM reading r as cuBLASLt's C (beta 1).

Nothing runs between the fused slots, so w, x and r are as the unfused kernels would have read
them, and the planner placed no other live tensor in the product's buffer.
"""
from __future__ import annotations

from .matmul import mul_mat_add_bias, mul_mat_add_bias_residual


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


def _residual_of(r, add) -> object | None:
    """The residual operand when node `r` is add(add_node, res) or add(res, add_node) with res a
    contiguous F32 tensor of the output's shape (what cuBLASLt reads as C); else None."""
    if r.op != "add" or tuple(r.ne4) != tuple(add.ne4) or r.dtype.name != "F32":
        return None
    a, b = r.src
    y, res = (a, b) if a.owner is add else (b, a)
    if (not _is_whole(y, add) or res.owner is add or tuple(res.ne4) != tuple(add.ne4)
            or res.dtype.name != "F32" or not res.is_contiguous()):
        return None
    return res


def launch_lists(graph, plan, kernels, node_ptr) -> list[list[tuple]]:
    """Per segment, [(fn, tensors it reads)] in node order: each node's own kernel on its
    sources, but for the fused pairs and triples (see the module doc)."""
    uses: dict[int, int] = {}
    for n in graph.nodes:
        for s in n.src:
            uses[id(s.owner)] = uses.get(id(s.owner), 0) + 1
    outputs = {id(n) for n in plan.outputs}

    def only_feeds(node, nxt) -> bool:
        # node's single consumer is nxt, which writes over node's buffer
        return (uses.get(id(node)) == 1 and id(node) not in outputs
                and node_ptr.get(id(nxt)) == node_ptr.get(id(node)))

    lists = []
    for seg, fns in zip(plan.segments, kernels):
        nodes = seg.nodes
        out = [(fn, tuple(n.src)) for fn, n in zip(fns, nodes)]
        j = 0
        while j < len(nodes) - 1:
            mm, add = nodes[j], nodes[j + 1]
            if not (mm.op == "mul_mat" and add.op == "add" and only_feeds(mm, add) and _bias_of(add, mm)):
                j += 1
                continue
            r = nodes[j + 2] if j + 2 < len(nodes) else None
            res = _residual_of(r, add) if r is not None and only_feeds(add, r) else None
            out[j] = (_skip, ())
            if res is None:
                out[j + 1] = (mul_mat_add_bias, (*mm.src, add.src[1]))
                j += 2
            else:
                out[j + 1] = (_skip, ())
                out[j + 2] = (mul_mat_add_bias_residual, (*mm.src, add.src[1], res))
                j += 3
        lists.append(out)
    return lists
