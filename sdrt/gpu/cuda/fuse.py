"""Kernel fusion over a planned graph, for the CUDA backend: runs of nodes one kernel does.

`launch_lists(graph, plan, kernels, node_ptr)` gives, per segment and node, the kernel function
to call and the tensors it reads (`kernels`: each segment's kernel functions in node order,
`node_ptr`: each computed node's device address). These patterns are fused:

- `add(mul_mat(w, x), b)` with b a vector of the product's M rows (a linear layer's bias),
  where the add directly follows the product, is the product's only consumer and writes over
  the product's buffer (the planner's in-place rule): the product's slot does nothing and the
  add's runs `matmul.mul_mat_add_bias` on (w, x, b), one GEMM with the bias in cuBLAS's epilogue
  (the separate add read and wrote the whole F32 output again).

- `add(add(mul_mat(w, x), b), r)` (r on either side), the same pair followed directly by the
  residual add of a transformer block, which writes over the same buffer and reads r of the
  output's size: the product's and the bias add's slots do nothing and the last runs
  `matmul.mul_mat_add_bias_residual`, the same GEMM reading r as cuBLASLt's C (beta 1).

- `gelu_tanh(add(mul_mat(w, x), b))`, the bias pair followed directly by a tanh GELU (a DiT
  MLP's fc1) writing over the same buffer: one GEMM with cuBLASLt's GELU-bias epilogue (whose GELU
  is the tanh form) in the gelu's slot, `matmul.mul_mat_add_bias_gelu` (the bias GEMM into scratch
  and the gelu kernel where cuBLASLt refuses).

- the DiT modulation `add(mul(layer_norm(x), s), shift)` (layer_norm without affine, or the
  affine op with neither; s and shift vectors broadcasting over x's tokens, [C, 1, N]; the mul
  and the add the only readers of the node before, other nodes such as the `scale(s, 1, 1)`
  that makes s may run in between): `norm.layer_norm_modulated` in the add's slot, one pass
  instead of three, rounded after the product and after the sum as the separate kernels.

- `mul(rms_norm(x), w)`, w a vector of x's ne[0] values (the DiT blocks' QK RMSNorm, the mul
  the norm's only reader): `norm.rms_norm_scaled`, the rms kernel with w as its weight, in the
  mul's slot (bit for bit: the product is rounded as the mul's). When the mul's only reader is
  `rope(., pe)` with interleaved pairs over a whole head of 16 to 256 (`norm.takes_rms_rope`):
  `norm.rms_norm_rope` in the rope's slot instead, norm, weight and rotation in one pass; when
  it is `mul(., s)`, s broadcasting over the rows (Z-Image's adaLN `1 + scale`),
  `norm.rms_norm_modulated` in that mul's slot.

- the gated residual `add(x, mul(y, g))` (either operand order of either op; x, y of the
  output's shape, g broadcasting, all F32, the mul read only by the add): `elementwise.gated_add`
  in the add's slot (y is usually a bias GEMM's output, so the chain is two kernels, not three).

- the SwiGLU `mul(silu(a), b)` (either order; F32, the silu read only by the mul):
  `elementwise.silu_mul` in the mul's slot, which writes F16/BF16 when the GEMM reading it
  wants that (Z-Image's feed-forward, the Qwen LLM text encoders').

  For these chains, which read their inputs in a later slot than the unfused kernels did, no node
  that still writes in between, nor the fused output, may overlap a computed input's buffer
  (`_chain_reads_safe`), except the gated add's or SwiGLU's output exactly over an operand (in place).

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

`layout(graph, plan, kernels, fusing, store_half)` does both and lays the nodes out again with the
half-stored ones in half their bytes (so storing them lowers the peak, not only the traffic).

`half_nodes(graph, plan, lists, node_ptr)` then picks the F32 results to store in half precision,
{id: "F16" or "BF16"}, as PyTorch's fp16/bf16 activations are, where that costs no accuracy the
reader keeps: a node whose every reader would round it to that one dtype anyway (a GEMM reading
it as x in its GEMM dtype, the F16 weights' F16 and the BF16 weights' BF16 (ops/matmul
gemm_input_dtype); a conv on F16 weights; the attention's q/k/v, which the flash kernel and the
F16 gemm path read as F16 whatever the model's dtype), or only moves it on to a node stored in
that dtype too (cont/cast/concat), or is the geglu (the one extra rounding: the feed-forward's
first product, in the GEMM's dtype before its gelu, as in PyTorch). Readers that disagree (a BF16
GEMM and the F16 attention), or any reader keeping F32 (norms, residual adds, rms_norm inputs):
the node stays F32. And whose own kernel can write that dtype (`_writable`): layer and group
norms, the modulation, geglu, cont/cast and concat (by the device tensors' dtypes), unary and
binary ops of F32 operands (their `_to_f16`/`_to_bf16` kernels: the gelu before a GEMM, the
modulation's add where unfused), rope (F16, for the attention), a GEMM on dense F16/BF16 weights
(its own dtype; bias or GELU-bias fused or not), and the attention into its cont (the flash
kernels write F32, F16 or BF16: the out-projection's BF16). Each store halves the node's traffic and drops the packing pass of
the GEMM or attention reading it (convert_f32_f16/bf16 and attn_pack); the stored bits are the
very bits the packing would have made. No reader may write over the node's buffer, nor may the
node be written over a buffer its own kernel reads (different element sizes at one address:
`_over_a_source`; a slot whose kernel writes scratch first, `staged`, may).
"""
from __future__ import annotations

from ...ops.registry import FLOATS, ops_of_kind
from .ops.attention import attention_into_cont, wants_f32
from .ops.attention import plan as attention_plan
from .ops.conv import Epilogue, bias_axis, conv2d, conv3x3_direct, takes_direct, takes_winograd
from .ops.conv import gemm_dtype as conv_gemm_dtype
from .ops.elementwise import binary, gated_add, silu_mul, unary
from .ops.layout import concat
from .devtensor import padded_nb
from ..device_backend import node_addresses
from .ops.matmul import (gemm_input_dtype, mul_mat, mul_mat_add_bias, mul_mat_add_bias_gelu,
                         mul_mat_add_bias_residual)
from .ops.norm import (layer_norm_modulated, rms_norm_modulated, rms_norm_rope, rms_norm_rope_staged, rms_norm_scaled,
                       takes_rms_rope)


HALF = ("F16", "BF16")


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
        out = _Slots((fn, tuple(n.src)) for fn, n in zip(fns, nodes))
        out.own = fns
        j = 0
        while j < len(nodes) - 1:
            mm, add = nodes[j], nodes[j + 1]
            if not (mm.op == "mul_mat" and add.op == "add" and only_feeds(mm, add) and _bias_of(add, mm)):
                j += 1
                continue
            r = nodes[j + 2] if j + 2 < len(nodes) else None
            res = _residual_of(r, add) if r is not None and only_feeds(add, r) else None
            out[j] = (_skip, ())
            if res is None and r is not None and _gelu_of(r, add) and only_feeds(add, r):
                out[j + 1] = (_skip, ())
                out[j + 2] = (mul_mat_add_bias_gelu, (*mm.src, add.src[1]))
                j += 3
            elif res is None:
                out[j + 1] = (mul_mat_add_bias, (*mm.src, add.src[1]))
                j += 2
            else:
                out[j + 1] = (_skip, ())
                out[j + 2] = (mul_mat_add_bias_residual, (*mm.src, add.src[1], res))
                j += 3
        for j, cv in enumerate(nodes):
            if cv.op == "conv2d" and out.is_own(j) and takes_direct(cv):
                _fuse_conv_epilogue(nodes, out, j, only_feeds)
        for j, n in enumerate(nodes):
            if not out.is_own(j):            # already part of an earlier fusion
                continue
            if n.op in ("layer_norm", "layer_norm_affine"):
                _fuse_modulation(nodes, out, j, uses, outputs, node_ptr)
            elif n.op == "rms_norm":
                _fuse_rms_scale(nodes, out, j, uses, outputs, node_ptr)
            elif n.op == "mul":
                _fuse_gated_residual(nodes, out, j, uses, outputs, node_ptr)
            elif n.op == "silu" and fns[j] is unary:
                _fuse_silu_mul(nodes, out, j, uses, outputs, node_ptr)
        for j in range(len(nodes) - 1):
            att, c = nodes[j], nodes[j + 1]
            if (att.op == "attention" and out.is_own(j) and out.is_own(j + 1) and attention_plan(att)[0] == "flash"
                    and _merges_heads(c, att)
                    and uses.get(id(att)) == 1
                    and id(att) not in outputs and not _overlaps_sources(c, att, node_ptr)):
                out[j] = (_skip, ())
                out[j + 1] = (_writing_into(att), tuple(att.src))
        lists.append(out)
    return lists


def _gelu_of(g, add) -> bool:
    """Whether node g is gelu_tanh of add's whole F32 output (cuBLASLt's GELU is the tanh form)."""
    return g.op == "gelu_tanh" and g.dtype.name == "F32" and add.dtype.name == "F32" and _is_whole(g.src[0], add)


class Addresses(dict):
    """{id(node): address}, with the bytes of the nodes a plan laid out in fewer than their F32
    size (`layout`'s half-sized ones): the overlap checks below read a node's extent here."""

    def __init__(self, ptr, sized=None):
        super().__init__(ptr)
        self.sized = sized or {}


def _extent(n, node_ptr) -> int:
    return getattr(node_ptr, "sized", {}).get(id(n), n.nbytes)


def _buffer_overlaps(a, b, node_ptr) -> bool:
    """Whether computed nodes a and b have overlapping buffers."""
    if id(a) not in node_ptr or id(b) not in node_ptr:
        return False
    pa, pb = node_ptr[id(a)], node_ptr[id(b)]
    return pa < pb + _extent(b, node_ptr) and pb < pa + _extent(a, node_ptr)


def _chain_reads_safe(nodes, out, j, k, skipped, reads, node_ptr, in_place=()) -> bool:
    """A chain nodes[j..k] fused into nodes[k]'s slot reads `reads` later than the unfused
    kernels did: no node that still writes in between (not in `skipped`, its slot not already
    fused away), nor nodes[k]'s output, may write over a computed tensor among them; except
    nodes[k]'s output exactly over one of `in_place` (same address and layout: an element-wise
    kernel reads an element before writing it)."""
    last = nodes[k]
    for t in reads:
        o = t.owner
        if o.op is None:
            continue
        for i in range(j, k + 1):
            n = nodes[i]
            if id(n) in skipped or out[i][0] is _skip or n is o or not _buffer_overlaps(n, o, node_ptr):
                continue
            if n is last and any(t is r for r in in_place) and _is_whole(t, o) and node_ptr[id(n)] == node_ptr[id(o)] \
                    and o.is_contiguous() and tuple(o.ne4) == tuple(n.ne4):
                continue
            return False
    return True


class _Slots(list):
    """A segment's launch list, [(fn, tensors it reads)], with `own` the nodes' own kernels: a
    slot holding something else is a fused kernel or skipped, and takes part in no other fusion."""
    own: list

    def is_own(self, k) -> bool:
        return self[k][0] is self.own[k]


def _sole_reader(nodes, out, j, node, uses, op: str) -> int | None:
    """Index of the node after j reading `node` when that is node's only reader, runs `op` and
    is not part of a fusion already."""
    if uses.get(id(node)) != 1:
        return None
    for k in range(j + 1, len(nodes)):
        if any(s.owner is node for s in nodes[k].src):
            return k if nodes[k].op == op and out.is_own(k) else None
    return None


def _binary_reader(nodes, out, j, node, uses, outputs, op: str):
    """(index, other operand) of F32 `node`'s only reader when that is an F32 binary `op` of
    node's shape over node's whole output and one other tensor (node not a graph output);
    (None, None) otherwise."""
    if id(node) in outputs or node.dtype.name != "F32":
        return None, None
    k = _sole_reader(nodes, out, j, node, uses, op)
    if k is None:
        return None, None
    other = _other(nodes[k], node)
    if other is None or nodes[k].dtype.name != "F32" or tuple(nodes[k].ne4) != tuple(node.ne4):
        return None, None
    return k, other


def _other(node, prev):
    """node's operand that is not prev's whole output, when node is binary over (prev, other)."""
    a, b = node.src
    if _is_whole(a, prev) and b.owner is not prev:
        return b
    if _is_whole(b, prev) and a.owner is not prev:
        return a
    return None


def _broadcasts_to(t, ne4) -> bool:
    return t.dtype.name in FLOATS and all(n in (1, m) for n, m in zip(t.ne4, ne4))


def _fuse_modulation(nodes, out, j, uses, outputs, node_ptr) -> None:
    """layer_norm(x) -> mul(., scale) -> add(., shift) (a DiT block's modulation; scale and shift
    F32/F16/BF16 vectors broadcasting over x's tokens, the mul and add possibly a few nodes later,
    each the previous one's only reader): one layer_norm_modulated in the add's slot."""
    ln = nodes[j]
    if ln.src[0].dtype.name != "F32" or ln.dtype.name != "F32" or len(ln.src) != 1 or id(ln) in outputs:
        return
    km = _sole_reader(nodes, out, j, ln, uses, "mul")
    if km is None or id(nodes[km]) in outputs:
        return
    mul = nodes[km]
    ka = _sole_reader(nodes, out, km, mul, uses, "add")
    if ka is None:
        return
    add = nodes[ka]
    scale, shift = _other(mul, ln), _other(add, mul)
    ne = tuple(ln.ne4)
    if (scale is None or shift is None or tuple(mul.ne4) != ne or tuple(add.ne4) != ne or add.dtype.name != "F32"
            or not _broadcasts_to(scale, ne) or not _broadcasts_to(shift, ne)):
        return
    x = ln.src[0]
    skipped = {id(ln), id(mul)}
    if not _chain_reads_safe(nodes, out, j, ka, skipped, (x, scale, shift), node_ptr):
        return
    out[j], out[km] = (_skip, ()), (_skip, ())
    out[ka] = (_norm_slot(layer_norm_modulated, ln, writes=HALF), (x, scale, shift))


def _norm_slot(kernel, norm, **marks):
    """The kernel function of a fused norm chain's last slot: `kernel(rt, *xs, out, eps)` with the
    eps of norm node `norm` (layer_norm_modulated, rms_norm_scaled); `marks` are attributes other
    passes read (`writes`: the dtypes _writable may store it as)."""
    eps = float(norm.params["eps"])

    def slot(node, xs, out, rt):
        kernel(rt, *xs, out, eps)
    slot.__name__ = kernel.__name__
    for k, v in marks.items():
        setattr(slot, k, v)
    return slot


def _fuse_rms_scale(nodes, out, j, uses, outputs, node_ptr) -> None:
    """rms_norm(x) -> mul(., w), w a vector of x's ne[0] values, the mul the norm's only reader
    (the DiT blocks' QK RMSNorm): the rms kernel with w as its weight, in the mul's slot."""
    rn = nodes[j]
    km, w = _binary_reader(nodes, out, j, rn, uses, outputs, "mul")
    if (km is None or rn.src[0].dtype.name != "F32" or w.dtype.name not in FLOATS or w.ne4[0] != rn.ne4[0]
            or any(d != 1 for d in w.ne4[1:])):
        return
    x = rn.src[0]
    if not _chain_reads_safe(nodes, out, j, km, {id(rn)}, (x, w), node_ptr):
        return
    out[j] = (_skip, ())
    out[km] = (_norm_slot(rms_norm_scaled, rn, writes=HALF), (x, w))
    if not _fuse_rms_modulation(nodes, out, j, km, uses, outputs, node_ptr):
        _fuse_rms_rope(nodes, out, j, km, uses, outputs, node_ptr)


def _fuse_rms_modulation(nodes, out, j, km, uses, outputs, node_ptr) -> bool:
    """The fused rms_norm(x) * w at km read only by mul(., s), s a float view of x's ne[0] values
    broadcasting over its rows (Z-Image's adaLN: s = 1 + scale, [C, 1, N]): rms_norm_modulated
    in that mul's slot, which may write the F16/BF16 of the GEMM reading it."""
    rn, mul = nodes[j], nodes[km]
    k2, s = _binary_reader(nodes, out, km, mul, uses, outputs, "mul")
    (x, w), ne = out[km][1], tuple(mul.ne4)
    if (k2 is None or not _broadcasts_to(s, ne) or s.ne4[0] != ne[0]
            or not _chain_reads_safe(nodes, out, j, k2, {id(rn), id(mul)}, (x, w, s), node_ptr)):
        return False
    out[km] = (_skip, ())
    out[k2] = (_norm_slot(rms_norm_modulated, rn, writes=HALF), (x, w, s))
    return True


def _fuse_rms_rope(nodes, out, j, km, uses, outputs, node_ptr) -> None:
    """The fused QK norm rms_norm(x) * w at km read only by rope(., pe) (a DiT block's attention
    input): rms_norm_rope in the rope's slot, one warp per row reading x once."""
    rn, mul = nodes[j], nodes[km]
    kr = _sole_reader(nodes, out, km, mul, uses, "rope") if id(mul) not in outputs else None
    if kr is None:
        return
    rope = nodes[kr]
    x, w = out[km][1]
    pe = rope.src[1]
    skipped = {id(rn), id(mul), id(rope)}
    if (not _is_whole(rope.src[0], mul) or rope.dtype.name != "F32"
            or not takes_rms_rope(x, w, pe, bool(rope.params["interleaved"]))
            or not _chain_reads_safe(nodes, out, j, kr, skipped, (x, w, pe), node_ptr)):
        return
    # the rope's buffer may be x's, dead after the norm in the unfused order (Qwen-Image's to_q
    # output): the kernel then writes scratch, copied over after (rows change place in a rope)
    staged = any(t.owner.op is not None and _buffer_overlaps(rope, t.owner, node_ptr) for t in (x, w, pe))
    out[km] = (_skip, ())
    out[kr] = (_norm_slot(rms_norm_rope_staged, rn, staged=True) if staged else _norm_slot(rms_norm_rope, rn),
               (x, w, pe))


def _fuse_silu_mul(nodes, out, j, uses, outputs, node_ptr) -> None:
    """mul(silu(a), b) (either operand order), a, b and both results F32, the silu read only by
    the mul (a SwiGLU feed-forward: Z-Image, the Qwen LLMs): elementwise.silu_mul in the mul's
    slot, which may write the F16/BF16 of the GEMM reading it."""
    si = nodes[j]
    km, b = _binary_reader(nodes, out, j, si, uses, outputs, "mul")
    a = si.src[0]
    if (km is None or a.dtype.name != "F32" or b.dtype.name != "F32"
            or not _chain_reads_safe(nodes, out, j, km, {id(si)}, (a, b), node_ptr, in_place=(a, b))):
        return
    out[j] = (_skip, ())
    out[km] = (_silu_mul_slot, (a, b))


def _silu_mul_slot(node, xs, out, rt) -> None:
    silu_mul(rt, *xs, out)


_silu_mul_slot.__name__ = "silu_mul"
_silu_mul_slot.writes = HALF


def _fuse_gated_residual(nodes, out, j, uses, outputs, node_ptr) -> None:
    """add(x, mul(y, g)) (either order of either op), every tensor F32, the mul the add's only
    operand it computes, x and y of the output's shape, g broadcasting (a DiT block's gate): one
    gated_add in the add's slot."""
    mul = nodes[j]
    ka, x = _binary_reader(nodes, out, j, mul, uses, outputs, "add")
    if ka is None:
        return
    ne = tuple(mul.ne4)
    a, b = mul.src
    y, g = (a, b) if tuple(a.ne4) == ne else (b, a)
    if (tuple(y.ne4) != ne or tuple(x.ne4) != ne or not _broadcasts_to(g, ne)
            or any(t.dtype.name != "F32" for t in (x, y, g))):
        return
    if not _chain_reads_safe(nodes, out, j, ka, {id(mul)}, (x, y, g), node_ptr, in_place=(x, y)):
        return
    out[j] = (_skip, ())
    out[ka] = (_gated, (x, y, g))


def _gated(node, xs, out, rt):
    gated_add(rt, *xs, out)


_gated.__name__ = "gated_add"


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
    lo, hi = node_ptr[id(c)], node_ptr[id(c)] + _extent(c, node_ptr)
    for s in att.src:
        o = s.owner
        if (o.op is not None and id(o) in node_ptr and node_ptr[id(o)] < hi
                and lo < node_ptr[id(o)] + _extent(o, node_ptr)):
            return True
    return False


def _writing_into(att):
    """The kernel function of the cont slot: `att` written straight as the cont's output."""
    def attention_into_cont_(node, xs, out, rt):
        attention_into_cont(att, xs, out, rt)
    attention_into_cont_.__name__ = "attention_into_cont"
    attention_into_cont_.attention = att
    return attention_into_cont_


ANY = "any"   # a reader that takes whichever half dtype the writer gives (the geglu, F32 itself)
_NORMS = ("layer_norm", "layer_norm_affine", "group_norm", "group_norm_affine")
_MOVERS = ("cont", "cast")
_CONVS = ("conv1d", "conv2d", "conv3d")
_UNARY = frozenset(ops_of_kind("unary"))
_BINARY = frozenset(ops_of_kind("binary"))


def _writable(node, fn, srcs) -> tuple[str, ...]:
    """The dtypes node's kernel (fn on srcs, fused or not) can write its F32 result as."""
    if fn is _skip:
        return ()
    if fn is mul_mat or fn is mul_mat_add_bias:      # cuBLAS writes the GEMM dtype of dense F16/BF16 weights
        return (srcs[0].dtype.name,) if srcs[0].dtype.name in HALF else ()
    if fn is mul_mat_add_bias_gelu:                  # or its fallback's gelu kernel, any
        return HALF
    if getattr(fn, "writes", None):                  # fused slots marked so (the norms' chains, silu_mul)
        return fn.writes
    if fn is conv2d or getattr(fn, "direct_conv", None) is not None:   # conv3x3_mma, wino_output write F16
        cv = getattr(fn, "direct_conv", node)
        ok = (takes_direct(cv) or takes_winograd(cv)) \
            and (len(cv.src) < 3 or bias_axis(cv.src[2], cv.ne[2]) is not None)
        return ("F16",) if ok else ()
    if node.op in ("rope", "rope_ext"):              # (positions are I32) for the attention: F16
        return ("F16",) if node.src[0].dtype.name == "F32" else ()
    if not all(s.dtype.name in FLOATS for s in node.src):
        return ()
    if getattr(fn, "attention", None) is not None:
        return HALF                                  # the flash kernels write F32, F16 or BF16
    if node.op == "concat" and fn is concat:
        return HALF
    if node.op in _NORMS or node.op in _MOVERS or node.op == "geglu":
        return HALF
    if (fn is unary and node.op in _UNARY) or (fn is binary and node.op in _BINARY):
        return HALF if node.src[0].dtype.name == "F32" else ()
    return ()


def _read_dtype(reader, i, store, gemm: bool) -> str | None:
    """The dtype `reader`, taking the node as its source i, rounds it to anyway (so storing it
    so loses nothing); ANY for a reader indifferent to which; None when it keeps F32. `gemm`:
    the node is a GEMM's product (the geglu takes that one in the GEMM's dtype, nothing else)."""
    op = reader.op
    if op == "mul_mat":
        d = gemm_input_dtype(*reader.src)
        return d if i == 1 and d in HALF else None
    if op in _CONVS:
        return "F16" if i == 0 and conv_gemm_dtype(reader.src[1]) == "F16" else None
    if op == "attention":
        return "F16" if i < 3 and not wants_f32(reader) else None
    if op == "geglu":
        return store.get(id(reader), ANY) if gemm else None
    if op in _MOVERS:
        return store.get(id(reader)) or (reader.dtype.name if reader.dtype.name in HALF else None)
    if op == "concat":
        return store.get(id(reader))
    return None


def _over_a_source(n, srcs, node_ptr) -> bool:
    """Whether node n's buffer overlaps that of a computed tensor its kernel reads (`srcs`, the
    fused kernel's where fused; the planner puts an element-wise result over its dying source):
    written as F16/BF16 there, element i's two bytes would land on an F32 element another thread
    has yet to read."""
    lo = node_ptr[id(n)]
    hi = lo + _extent(n, node_ptr)
    for t in srcs:
        o = t.owner
        p = node_ptr.get(id(o)) if o.op is not None else None
        if p is not None and o is not n and p < hi and lo < p + _extent(o, node_ptr):
            return True
    return False


def half_nodes(graph, plan, lists, node_ptr) -> dict[int, str]:
    """{id: "F16" or "BF16"} of the nodes whose F32 results are stored in half precision (see
    the module doc): every reader rounds the node to that one dtype anyway and the node's kernel
    can write it; `lists` are launch_lists' per-segment [(fn, srcs)] (a fused slot's node is
    judged by the fused kernel). Readers come after their sources, so a walk from the end knows
    each reader's choice."""
    readers: dict[int, list] = {}
    for n in graph.nodes:
        for i, s in enumerate(n.src):
            readers.setdefault(id(s.owner), []).append((n, i))
    launch = {id(n): entry for seg, lst in zip(plan.segments, lists) for n, entry in zip(seg.nodes, lst)}
    outputs = {id(n) for n in plan.outputs}
    store: dict[int, str] = {}
    for n in reversed(graph.nodes):
        entry = launch.get(id(n))
        if entry is None or id(n) in outputs or n.dtype.name != "F32":
            continue
        can = _writable(n, *entry)
        rs = readers.get(id(n), ())
        if (not can or not rs or any(node_ptr.get(id(r)) == node_ptr[id(n)] for r, _ in rs)
                or (_over_a_source(n, entry[1], node_ptr) and not getattr(entry[0], "staged", False))):
            continue
        gemm = entry[0] is mul_mat or entry[0] is mul_mat_add_bias
        want = {_read_dtype(r, i, store, gemm) for r, i in rs}
        if None in want:
            continue
        want.discard(ANY)
        if len(want) > 1:
            continue
        d = next(iter(want)) if want else (can[0] if len(can) == 1 else None)
        if d in can:
            store[id(n)] = d
    return store


LAYOUT_ROUNDS = 4


def layout(graph, plan, kernels, fusing: bool, store_half: bool, replan: bool = True):
    """(device plan, launch lists, half-stored {id: dtype}) of a graph planned as `plan` (F32
    sizes). Fusions and half storage are decided on the nodes' addresses, and a re-plan giving
    the half-stored nodes half their bytes moves nodes, which may change what is decided there:
    each round re-plans with the nodes the last one stored half, until the decisions on a plan
    store half exactly the nodes it sized so (a node sized half that its plan stores F32 keeps
    its F32 size from then on). Without that within LAYOUT_ROUNDS, the last plan if every node
    it sized half is stored half, else the F32 plan. Decided on stand-in addresses (the arena
    at 0, the cross buffer and each output far apart, as the real blocks are disjoint): the
    decisions only compare addresses within a buffer. `replan` False: the F32 plan's decisions
    on the F32 plan."""
    if not fusing:
        return plan, [[(fn, tuple(n.src)) for fn, n in zip(ks, seg.nodes)]
                      for ks, seg in zip(kernels, plan.segments)], {}

    def decide(p, sized):
        ptr = Addresses(node_addresses(p, 0, 1 << 48, [(1 << 50) + (i << 44) for i in range(len(p.outputs))]),
                        {i: by_id[i].nbytes // 2 for i in sized})
        lists = launch_lists(graph, p, kernels, ptr)
        return lists, (half_nodes(graph, p, lists, ptr) if store_half else {})

    by_id = {id(n): n for n in graph.nodes}
    lists, half = decide(plan, {})
    first = (plan, lists, half)
    p, sized, banned = plan, {}, set()
    for _ in range(LAYOUT_ROUNDS if replan else 0):
        misfits = {i for i in sized if i not in half}     # sized half, stored F32: F32-sized for good
        banned |= misfits
        want = {i: d for i, d in half.items() if i not in banned}
        if not misfits and want.keys() == sized.keys():
            return p, lists, half
        sized = want
        p = graph.plan({i: by_id[i].nbytes // 2 for i in sized})
        lists, half = decide(p, sized)
    return (p, lists, half) if all(i in half for i in sized) else first
