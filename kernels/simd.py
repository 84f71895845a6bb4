"""Eight float32 lanes as one Numba value: the vector type that kernels/cpu_gemm.py blocks in.

LLVM's loop vectoriser turns a Numba loop into SIMD code only one innermost loop at a time, and
keeps nothing in registers across the loop around it, so a register-blocked GEMM (12 vector
accumulators live through a whole k loop) cannot be written in plain Numba: it spills to the
stack or stays scalar. ``F32x8`` is an LLVM ``<8 x float>`` SSA value; the functions below are
Numba intrinsics that load, store, broadcast and fuse-multiply-add it, so such a kernel keeps its
accumulators in ymm registers (AVX2; LLVM splits the type on narrower hardware, still correct).

Loads and stores are unaligned and unchecked: the caller keeps ``j + 8 <= a.shape[1]``.
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


def _lanes_pointer(context, builder, array_type, array, indices, index_types):
    """Pointer to array[i, j], as a pointer to 8 floats."""
    indices = [context.cast(builder, v, t, types.intp) for v, t in zip(indices, index_types)]
    view = context.make_array(array_type)(context, builder, array)
    item = cgutils.get_item_pointer(context, builder, array_type, view, indices,
                                    wraparound=False)
    return builder.bitcast(item, _VEC.as_pointer())


@intrinsic
def vzero(typingctx):
    """Eight zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, [0.0] * 8)
    return f32x8(), codegen


def _float32_matrix(a):
    return isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32


@intrinsic
def vload(typingctx, a, i, j):
    """a[i, j:j + 8] of a 2-D float32 array whose rows are contiguous."""
    if not _float32_matrix(a):
        return None                                     # a typing error, not a wrong load
    def codegen(context, builder, sig, args):
        load = builder.load(_lanes_pointer(context, builder, sig.args[0], args[0], args[1:],
                                           sig.args[1:]))
        load.align = 4
        return load
    return f32x8(a, i, j), codegen


@intrinsic
def vstore(typingctx, a, i, j, v):
    """a[i, j:j + 8] = v."""
    if not (_float32_matrix(a) and v == f32x8):
        return None
    def codegen(context, builder, sig, args):
        store = builder.store(args[3], _lanes_pointer(context, builder, sig.args[0], args[0],
                                                      args[1:3], sig.args[1:3]))
        store.align = 4
        return context.get_dummy_value()
    return types.none(a, i, j, v), codegen


@intrinsic
def vbroadcast(typingctx, x):
    """Eight copies of the scalar x (as float32)."""
    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.float32)
        lane0 = builder.insert_element(ir.Constant(_VEC, ir.Undefined), x,
                                       ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(lane0, ir.Constant(_VEC, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))
    return f32x8(x), codegen


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


@intrinsic
def vsum(typingctx, v):
    """The sum of the eight lanes, as the tree ((0+4) + (2+6)) + ((1+5) + (3+7)): a fixed order
    (deterministic), three additions deep."""
    if v != f32x8:
        return None
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        v = args[0]
        for width in (4, 2, 1):
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width),
                                                          list(range(width))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width),
                                                          list(range(width, 2 * width))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(i32, 0))
    return types.float32(v), codegen
