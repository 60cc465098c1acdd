"""Kernel fusion over a planned graph, for the CUDA backend: runs of nodes one kernel does.

`launch_lists(graph, plan, kernels, node_ptr)` gives, per segment and node, the kernel function
to call and the tensors it reads (`kernels`: each segment's kernel functions in node order,
`node_ptr`: each computed node's device address). Four patterns are fused:

- `add(mul_mat(w, x), b)` with b a vector of the product's M rows (a linear layer's bias),
  where the add directly follows the product, is the product's only consumer and writes over
  the product's buffer (the planner's in-place rule): the product's slot does nothing and the
  add's runs `matmul.mul_mat_add_bias` on (w, x, b), one GEMM with the bias in cuBLAS's epilogue
  (the separate add read and wrote the whole F32 output again).

- `add(add(mul_mat(w, x), b), r)` (r on either side), the same pair followed directly by the
  residual add of a transformer block, which writes over the same buffer and reads r of the
  output's size: the product's and the bias add's slots do nothing and the last runs
  `matmul.mul_mat_add_bias_residual`, the same GEMM reading r as cuBLASLt's C (beta 1).

- `cont(attention(q, k, v).permute(0, 2, 1, 3))`, the heads merged back into channels right
  after a flash-path attention that nothing else reads: the attention's slot does nothing and
  the cont's runs `attention.attention_into_cont`, the mma kernel writing the cont's layout
  through output strides (the planner places such a cont apart from the attention's inputs).

- `conv2d -> leaky_relu` and/or `conv2d -> scale -> add(., r)` after a conv that runs the direct
  3x3 kernel (ops/conv.takes_direct), each node the previous one's only consumer writing over its
  buffer: the conv's epilogue applies them (conv.Epilogue) in the last node's slot: ESRGAN's
  conv + activation and the scaled residual closing its dense blocks, one pass instead of three.

Nothing runs between the fused slots, so w, x and r are as the unfused kernels would have read
them, and the planner placed no other live tensor in the product's buffer.

`half_nodes(graph, plan, lists, node_ptr)` then picks the F32 results to store as F16, as
PyTorch's fp16 activations are, where that costs no accuracy the reader keeps: a node whose every
reader would round it to F16 anyway (a GEMM or conv on F16 weights reading it as x, the
attention's q/k/v, which the flash kernel and the F16 gemm path read as F16), or only moves it
on to a node stored as F16 too (cont/cast), or is the geglu (the one extra rounding: the
feed-forward's first product, F16 before its gelu, as in PyTorch); and whose own kernel can
write F16 (layer and group norms, geglu, cont/cast, whose kernels go by the device tensors'
dtypes, and a GEMM on dense F16 weights, its bias fused or not). Each store halves the node's
traffic and drops the packing pass of the GEMM or attention reading it (convert_f32_f16 and
attn_pack); a norm or cont writing F16 gives the very bits the
packing did. No reader may write over the node's buffer (different element sizes at one address).
"""
from __future__ import annotations

from .ops.attention import attention_into_cont, wants_f32
from .ops.attention import plan as attention_plan
from .ops.conv import Epilogue, bias_axis, conv2d, conv3x3_direct, takes_direct
from .ops.conv import gemm_dtype as conv_gemm_dtype
from .ops.layout import parts_are_runs
from .devtensor import padded_nb
from .ops.matmul import gemm_input_dtype, mul_mat, mul_mat_add_bias, mul_mat_add_bias_residual


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
        for j, cv in enumerate(nodes):
            if cv.op == "conv2d" and out[j][0] is not _skip and takes_direct(cv):
                _fuse_conv_epilogue(nodes, out, j, only_feeds)
        for j in range(len(nodes) - 1):
            att, c = nodes[j], nodes[j + 1]
            if (att.op == "attention" and attention_plan(att)[0] == "flash" and _merges_heads(c, att)
                    and uses.get(id(att)) == 1
                    and id(att) not in outputs and not _overlaps_sources(c, att, node_ptr)):
                out[j] = (_skip, ())
                out[j + 1] = (_writing_into(att), tuple(att.src))
        lists.append(out)
    return lists


def _fuse_conv_epilogue(nodes, out, j, only_feeds) -> None:
    """conv2d (direct path) -> [leaky_relu] -> [scale -> add(., r)], each the previous one's only
    consumer writing over its buffer: one conv3x3_direct with those ops in its epilogue, in the
    last node's slot (ESRGAN's conv + activation and its dense blocks' scaled residual)."""
    cv = nodes[j]
    if cv.dtype.name != "F32" or (len(cv.src) > 2 and bias_axis(cv.src[2], cv.ne[2]) is None):
        return
    k, epi = j, Epilogue()

    def next_if(op):
        nxt = nodes[k + 1] if k + 1 < len(nodes) else None
        ok = nxt is not None and nxt.op == op and only_feeds(nodes[k], nxt) and _is_whole(nxt.src[0], nodes[k])
        return nxt if ok else None

    act = next_if("leaky_relu")
    if act is not None:
        epi.slope, k = act.params["slope"], k + 1
    sc, res = next_if("scale"), None
    if sc is not None and k + 2 < len(nodes) and only_feeds(sc, nodes[k + 2]):
        res = _residual_of(nodes[k + 2], sc)
        if res is not None:
            epi.scale, epi.shift, k = sc.params["s"], sc.params["b"], k + 2
    if k == j:
        return
    for i in range(j, k):
        out[i] = (_skip, ())
    out[k] = (_conv_with(cv, epi, res is not None), tuple(cv.src) + ((res,) if res is not None else ()))


def _conv_with(cv, epi, has_residual: bool):
    """The kernel function of a fused conv's last slot: conv3x3_direct of conv node `cv` with
    `epi`, reading (x, w[, bias][, residual])."""
    has_bias = len(cv.src) > 2
    def conv3x3_epilogue(node, xs, out, rt):
        e = Epilogue(epi.slope, epi.scale, epi.shift, xs[-1] if has_residual else None)
        conv3x3_direct(rt, xs[0], xs[1], xs[2] if has_bias else None, out, e)
    conv3x3_epilogue.direct_conv = cv
    return conv3x3_epilogue


def _merges_heads(c, att) -> bool:
    """Whether node c is cont(att.permute(0, 2, 1, 3)) of att's whole contiguous output."""
    if c.op != "cont" or c.dtype.name != "F32":
        return False
    v = c.src[0]
    ne, nb = att.ne4, padded_nb(att)
    return (v.owner is att and v.offset == att.offset and att.is_contiguous()
            and v.ne4 == (ne[0], ne[2], ne[1], ne[3]) and padded_nb(v) == (nb[0], nb[2], nb[1], nb[3]))


def _overlaps_sources(c, att, node_ptr) -> bool:
    """Whether c's buffer overlaps a computed source of att (the planner may put c where a
    source that att reads for the last time was): att cannot then write c while reading it."""
    lo, hi = node_ptr[id(c)], node_ptr[id(c)] + c.nbytes
    for s in att.src:
        o = s.owner
        if o.op is not None and id(o) in node_ptr and node_ptr[id(o)] < hi and lo < node_ptr[id(o)] + o.nbytes:
            return True
    return False


def _writing_into(att):
    """The kernel function of the cont slot: `att` written straight as the cont's output."""
    def attention_into_cont_(node, xs, out, rt):
        attention_into_cont(att, xs, out, rt)
    attention_into_cont_.__name__ = "attention_into_cont"
    return attention_into_cont_


_HALF_WRITERS = ("layer_norm", "layer_norm_affine", "group_norm", "group_norm_affine", "geglu", "cont", "cast")
_CONVS = ("conv1d", "conv2d", "conv3d")


def _writes_half(node, fn, srcs) -> bool:
    if fn is mul_mat or fn is mul_mat_add_bias:
        return srcs[0].dtype.name == "F16"
    if fn is conv2d or getattr(fn, "direct_conv", None) is not None:   # conv3x3_mma writes F16
        cv = getattr(fn, "direct_conv", node)
        return takes_direct(cv) and (len(cv.src) < 3 or bias_axis(cv.src[2], cv.ne[2]) is not None)
    if node.op == "concat":       # ops/layout.concat converts F32 sources into one contiguous run each
        return parts_are_runs(node.ne4, node.params["dim"]) and all(s.dtype.name in ("F32", "F16", "BF16")
                                                                    for s in node.src)
    return fn is not _skip and node.op in _HALF_WRITERS and node.src[0].dtype.name in ("F32", "F16", "BF16")


def _reads_half(reader, i, half) -> bool:
    """Whether `reader`, taking the node as its source i, loses nothing when that is F16."""
    op = reader.op
    if op == "mul_mat":
        return i == 1 and gemm_input_dtype(*reader.src) == "F16"
    if op in _CONVS:
        return i == 0 and conv_gemm_dtype(reader.src[1]) == "F16"
    if op == "attention":
        return i < 3 and not wants_f32(reader)
    if op == "geglu":
        return True
    if op in ("cont", "cast"):
        return id(reader) in half or reader.dtype.name == "F16"
    if op == "concat":
        return id(reader) in half
    return False


def half_nodes(graph, plan, lists, node_ptr) -> set[int]:
    """ids of the nodes whose F32 results are stored as F16 (see the module doc); `lists` are
    launch_lists' per-segment [(fn, srcs)] (a fused slot's node is judged by the fused kernel).
    Readers come after their sources, so a walk from the end knows each reader's choice."""
    readers: dict[int, list] = {}
    for n in graph.nodes:
        for i, s in enumerate(n.src):
            readers.setdefault(id(s.owner), []).append((n, i))
    launch = {id(n): entry for seg, lst in zip(plan.segments, lists) for n, entry in zip(seg.nodes, lst)}
    outputs = {id(n) for n in plan.outputs}
    half: set[int] = set()
    for n in reversed(graph.nodes):
        entry = launch.get(id(n))
        if entry is None or id(n) in outputs or n.dtype.name != "F32" or not _writes_half(n, *entry):
            continue
        rs = readers.get(id(n), ())
        if rs and all(_reads_half(r, i, half) and node_ptr.get(id(r)) != node_ptr[id(n)] for r, i in rs):
            half.add(id(n))
    return half
