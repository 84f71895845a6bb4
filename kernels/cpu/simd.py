"""Eight float32 lanes as one Numba value: the vector type that kernels/cpu/conv_gemm.py blocks in.

LLVM's loop vectoriser turns a Numba loop into SIMD code only one innermost loop at a time, and
keeps nothing in registers across the loop around it, so a register-blocked GEMM (12 vector
accumulators live through a whole k loop) cannot be written in plain Numba: it spills to the
stack or stays scalar. ``F32x8`` is an LLVM ``<8 x float>`` SSA value; the functions below are
Numba intrinsics that load, store, broadcast and fuse-multiply-add it, so such a kernel keeps its
accumulators in ymm registers (AVX2; LLVM splits the type on narrower hardware, still correct);
``vtranspose8`` moves an 8 x 8 block between a pixel-major and a channel-major matrix in
registers (24 shuffles; 2-4x faster than the scalar loop).

Memory accesses are unaligned and unchecked: no bounds check and no negative-index wraparound
(whose extra instructions per load would also spill the block). The caller keeps
``0 <= j`` and ``j + 8 <= a.shape[1]`` (``j < a.shape[1]`` for vbroadcast), ``0 <= i < a.shape[0]``
(``i + 8 <= a.shape[0]`` for vtranspose8).
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

_VEC = ir.VectorType(ir.FloatType(), 8)


class F32x8(types.Type):
    def __init__(self):
        super().__init__(name="f32x8")


f32x8 = F32x8()


@register_model(F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def _float32_matrix(a):
    return isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32


def _item_pointer(context, builder, sig, args, at=0, row=0):
    """Pointer to a[i + row, j] for the intrinsic arguments (..., a, i, j, ...) from ``at``."""
    i, j = (context.cast(builder, v, t, types.intp) for v, t in zip(args[at + 1:at + 3],
                                                                   sig.args[at + 1:at + 3]))
    i = builder.add(i, ir.Constant(i.type, row))
    view = context.make_array(sig.args[at])(context, builder, args[at])
    return cgutils.get_item_pointer(context, builder, sig.args[at], view, [i, j],
                                    wraparound=False)


@intrinsic
def vzero(typingctx):
    """Eight zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, [0.0] * 8)
    return f32x8(), codegen


@intrinsic
def vload(typingctx, a, i, j):
    """a[i, j:j + 8] of a 2-D float32 array whose rows are contiguous."""
    if not _float32_matrix(a):
        return None                                     # a typing error, not a wrong load
    def codegen(context, builder, sig, args):
        load = builder.load(builder.bitcast(_item_pointer(context, builder, sig, args),
                                            _VEC.as_pointer()))
        load.align = 4
        return load
    return f32x8(a, i, j), codegen


@intrinsic
def vstore(typingctx, a, i, j, v):
    """a[i, j:j + 8] = v."""
    if not (_float32_matrix(a) and v == f32x8):
        return None
    def codegen(context, builder, sig, args):
        store = builder.store(args[3], builder.bitcast(_item_pointer(context, builder, sig, args),
                                                       _VEC.as_pointer()))
        store.align = 4
        return context.get_dummy_value()
    return types.none(a, i, j, v), codegen


@intrinsic
def vbroadcast(typingctx, a, i, j):
    """Eight copies of a[i, j] (one vbroadcastss from memory)."""
    if not _float32_matrix(a):
        return None
    def codegen(context, builder, sig, args):
        x = builder.load(_item_pointer(context, builder, sig, args))
        lane0 = builder.insert_element(ir.Constant(_VEC, ir.Undefined), x,
                                       ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(lane0, ir.Constant(_VEC, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))
    return f32x8(a, i, j), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c, lane by lane, rounded once (llvm.fma)."""
    if not a == b == c == f32x8:
        return None
    def codegen(context, builder, sig, args):
        fma = cgutils.get_or_insert_function(builder.module,
                                             ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v8f32")
        return builder.call(fma, args)
    return f32x8(a, b, c), codegen


def _shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), lanes))


@intrinsic
def vtranspose8(typingctx, a, i, j, b, k, m):
    """b[k + r, m + c] = a[i + c, j + r] for r, c < 8: an 8 x 8 block, transposed."""
    if not (_float32_matrix(a) and _float32_matrix(b)):
        return None
    def codegen(context, builder, sig, args):
        rows = []
        for r in range(8):
            load = builder.load(builder.bitcast(_item_pointer(context, builder, sig, args, 0, r),
                                                _VEC.as_pointer()))
            load.align = 4
            rows.append(load)
        # pairs of rows interleaved, then pairs of pairs, then the 128-bit halves swapped:
        # row r of the result is column r of the block (unpcklps / shufps / vperm2f128)
        t = []
        for r in range(0, 8, 2):
            t += [_shuffle(builder, rows[r], rows[r + 1], [0, 8, 1, 9, 4, 12, 5, 13]),
                  _shuffle(builder, rows[r], rows[r + 1], [2, 10, 3, 11, 6, 14, 7, 15])]
        low, high = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
        s = [_shuffle(builder, t[0], t[2], low), _shuffle(builder, t[0], t[2], high),
             _shuffle(builder, t[1], t[3], low), _shuffle(builder, t[1], t[3], high),
             _shuffle(builder, t[4], t[6], low), _shuffle(builder, t[4], t[6], high),
             _shuffle(builder, t[5], t[7], low), _shuffle(builder, t[5], t[7], high)]
        for r in range(8):
            half = [0, 1, 2, 3, 8, 9, 10, 11] if r < 4 else [4, 5, 6, 7, 12, 13, 14, 15]
            column = _shuffle(builder, s[r % 4], s[r % 4 + 4], half)
            store = builder.store(column, builder.bitcast(
                _item_pointer(context, builder, sig, args, 3, r), _VEC.as_pointer()))
            store.align = 4
        return context.get_dummy_value()
    return types.none(a, i, j, b, k, m), codegen
