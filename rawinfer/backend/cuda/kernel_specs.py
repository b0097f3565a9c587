"""Kernel signatures: one declarative entry per CUDA kernel, and the argument packing derived from it.

Each `KernelSpec` repeats the C++ signature of a `__global__` function in cuda/<op>.cu.  Three readers
use it, so the three ways a kernel is built can never drift apart silently:

- `rawinfer.backend.cuda.runtime` compiles the listed template instances with CuPy (NVRTC name
  expressions), and CUDABackend (`rawinfer.backend.cuda.launch`) packs every launch's arguments with
  `pack_args` (dtype and contiguity checked, scalars cast to the exact C types: CuPy would pass a
  Python int as a 64-bit integer);
- tests/cuda_shim/harness.py generates host launch stubs whose `static_assert` compares this
  signature with the kernel's real one, and packs arguments with the same `pack_args`;
- tools/check_cuda.sh compiles `explicit_instantiations()` with nvcc, which fails on a mismatch.

Element types: a template parameter T takes one of `ELEMENT_TYPES` (C++ name -> NumPy dtype).  bf16
arrays are `ml_dtypes.bfloat16` on the host and uint16 bit patterns on the device (CuPy has no
bfloat16), and both are accepted where a bf16 pointer is expected.

    python -m rawinfer.backend.cuda.kernel_specs instantiate embedding.cu   # what check_cuda.sh compiles
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import numpy as np

try:  # ml_dtypes is a dependency, but the packing below must work without it too
    from ml_dtypes import bfloat16 as _bfloat16
    from ml_dtypes import float8_e4m3fn as _float8_e4m3fn
except ImportError:  # pragma: no cover
    _bfloat16 = _float8_e4m3fn = None

# C++ element type name -> the NumPy dtypes an array of it may have.
ELEMENT_TYPES: dict[str, tuple[np.dtype, ...]] = {
    "float": (np.dtype(np.float32),),
    "f16": (np.dtype(np.float16),),
    "bf16": ((np.dtype(_bfloat16),) if _bfloat16 is not None else ()) + (np.dtype(np.uint16),),
}
FLOAT_TYPES = tuple(ELEMENT_TYPES)  # the instances of every kernel templated on its storage type

# The one-byte weight types of the weight-only formats (common.cuh's weight_value) and the dtypes their
# arrays may have: int8's signed char; fp8's e4m3 (uint8 bit patterns, or ml_dtypes' float8_e4m3fn).
WEIGHT_TYPES: dict[str, tuple[np.dtype, ...]] = {
    "signed char": (np.dtype(np.int8),),
    "e4m3": (np.dtype(np.uint8),) + ((np.dtype(_float8_e4m3fn),) if _float8_e4m3fn is not None else ()),
}

_POINTEE_DTYPES = {"int": np.dtype(np.int32), "float": np.dtype(np.float32),
                   "unsigned long long": np.dtype(np.uint64), "unsigned": np.dtype(np.uint32)}
_SCALAR_TYPES = {"int": np.int32, "float": np.float32, "unsigned long long": np.uint64}


class KernelArgumentError(ValueError):
    """A kernel was handed an argument of the wrong kind, dtype or layout."""


@dataclass(frozen=True)
class Arg:
    name: str
    ctype: str          # as written in the signature: "const T*", "int", ...

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def is_const(self) -> bool:
        return self.ctype.startswith("const ")

    @property
    def pointee(self) -> str:
        return self.ctype.removeprefix("const ").removesuffix("*").strip()


@dataclass(frozen=True)
class KernelSpec:
    name: str                           # the __global__ function
    source: str                         # its file in cuda/
    args: tuple[Arg, ...]
    template: tuple[str, ...] = ()      # template parameter names, e.g. ("T",)
    instances: tuple[tuple[str, ...], ...] = ()   # template arguments compiled, e.g. (("f16",), ...)

    def name_expression(self, targs: tuple[str, ...] = ()) -> str:
        """The C++ name of one instance: "rmsnorm_kernel<bf16>" (what NVRTC and CuPy look up)."""
        self._check_instance(targs)
        return f"{self.name}<{', '.join(targs)}>" if self.template else self.name

    def c_types(self, targs: tuple[str, ...] = ()) -> list[str]:
        """The parameter types of one instance with template parameters substituted."""
        self._check_instance(targs)
        subst = dict(zip(self.template, targs))
        return [re.sub(r"\b(\w+)\b", lambda m: subst.get(m.group(1), m.group(1)), a.ctype) for a in self.args]

    def _check_instance(self, targs: tuple[str, ...]) -> None:
        if self.template and tuple(targs) not in self.instances:
            known = ", ".join("<" + ", ".join(i) + ">" for i in self.instances)
            raise KernelArgumentError(f"{self.name} has no instance <{', '.join(targs)}>; compiled ones: {known}")
        if not self.template and targs:
            raise KernelArgumentError(f"{self.name} is not a template")


def signature(text: str) -> tuple[Arg, ...]:
    """'T* out, const int* ids, int n' -> Args (the C++ parameter list, copied from the .cu file)."""
    args = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(.+?)\s*(\w+)\s*", part)
        if not m:
            raise ValueError(f"cannot read kernel parameter {part!r}")
        ctype = re.sub(r"\s*\*", "*", m.group(1))
        args.append(Arg(m.group(2), ctype))
    return tuple(args)


def _each_float(name: str, source: str, params: str) -> KernelSpec:
    return KernelSpec(name, source, signature(params), ("T",), tuple((t,) for t in FLOAT_TYPES))


# (T, R): storage type and residual-stream type.  The engine keeps the residual in float32; a model
# whose activations all share T uses R = T.
RESIDUAL_PAIRS = (("float", "float"), ("f16", "f16"), ("bf16", "bf16"), ("f16", "float"), ("bf16", "float"))


# Head dimensions flash_attention_prefill_kernel is built for (template parameter D, a multiple of 16):
# the tiny test models' 16, SmolLM2's and Qwen2.5-0.5B's 64, Phi-3's 96, Llama's / Mistral's / Qwen's 128,
# Gemma 3's 256, and 32.  Other head dims, and float32, take paged_attention_prefill_kernel.
FLASH_HEAD_DIMS = (16, 32, 64, 96, 128, 256)
FLASH_TYPES = ("f16", "bf16")   # the tensor cores' input types

# Query heads paged_attention_decode_kernel serves per read of a K / V row (template parameter GC): the
# backend's 8 (one read for every GQA ratio up to 8), and 4, the baseline the decode bench times against.
DECODE_HEADS_PER_PASS = ("8", "4")


def _with_residual(name: str, source: str, params: str) -> KernelSpec:
    return KernelSpec(name, source, signature(params), ("T", "R"), RESIDUAL_PAIRS)


SPECS: dict[str, KernelSpec] = {s.name: s for s in (
    _with_residual("embedding_kernel", "embedding.cu", "R* out, const int* ids, const T* table, int hidden, float scale"),
    _with_residual("rmsnorm_kernel", "rmsnorm.cu", "T* out, const R* x, const T* weight, int hidden, float eps"),
    _with_residual("add_rmsnorm_kernel", "rmsnorm.cu",
                   "T* out, R* residual, const T* x, const T* weight, int hidden, float eps"),
    _with_residual("norm_add_rmsnorm_kernel", "rmsnorm.cu",
                   "T* out, R* residual, const T* x, const T* x_weight, const T* weight, int hidden, float eps"),
    _each_float("rope_kernel", "rope.cu",
                "T* qkv, const int* positions, const float* cos_sin, int num_heads, int num_kv_heads, "
                "int head_dim"),
    _each_float("head_rmsnorm_kernel", "head_rmsnorm.cu",
                "T* qkv, const T* q_weight, const T* k_weight, int num_heads, int num_kv_heads, int head_dim, "
                "float eps"),
    _each_float("silu_mul_kernel", "silu_mul.cu", "T* out, const T* gate_up, int ffn"),
    _each_float("gelu_tanh_mul_kernel", "silu_mul.cu", "T* out, const T* gate_up, int ffn"),
    _each_float("kv_write_kernel", "kv_write.cu",
                "T* k_cache, T* v_cache, const T* qkv, const int* slot_mapping, int num_heads, "
                "int num_kv_heads, int head_dim, int block_size"),
    _each_float("fused_rope_kv_write_kernel", "fused_rope_kv_write.cu",
                "T* qkv, T* k_cache, T* v_cache, const int* positions, const float* cos_sin, "
                "const int* slot_mapping, int num_heads, int num_kv_heads, int head_dim, int block_size"),
    _each_float("fused_norm_rope_kv_write_kernel", "fused_rope_kv_write.cu",
                "T* qkv, T* k_cache, T* v_cache, const T* q_weight, const T* k_weight, const int* positions, "
                "const float* cos_sin, const int* slot_mapping, int num_heads, int num_kv_heads, int head_dim, "
                "int block_size, float eps"),
    KernelSpec("paged_attention_decode_kernel", "paged_attention_decode.cu", signature(
                "float* part_out, float* part_max, float* part_sum, const T* qkv, const T* k_cache, "
                "const T* v_cache, const int* block_tables, const int* context_lens, "
                "const int* query_start_loc, float scale, int num_heads, int num_kv_heads, int head_dim, "
                "int block_size, int max_blocks_per_seq, int min_partition, int max_partition, "
                "int target_splits, int num_splits, int window"),
               ("T", "GC"), tuple((t, gc) for t in FLOAT_TYPES for gc in DECODE_HEADS_PER_PASS)),
    _each_float("paged_attention_merge_kernel", "paged_attention_decode.cu",
                "T* out, const float* part_out, const float* part_max, const float* part_sum, "
                "const int* context_lens, const int* query_start_loc, int num_heads, int head_dim, "
                "int block_size, int min_partition, int max_partition, int target_splits, int num_splits, "
                "int window"),
    _each_float("paged_attention_prefill_kernel", "paged_attention_prefill.cu",
                "T* out, const T* qkv, const T* k_cache, const T* v_cache, const int* block_tables, "
                "const int* context_lens, const int* query_start_loc, float scale, int num_heads, "
                "int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int kv_tile, int window"),
    KernelSpec("flash_attention_prefill_kernel", "flash_attention_prefill.cu",
               signature("T* out, const T* qkv, const T* k_cache, const T* v_cache, const int* block_tables, "
                         "const int* context_lens, const int* query_start_loc, float scale, int num_heads, "
                         "int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int kv_tile, "
                         "int window"),
               ("T", "D"), tuple((t, str(d)) for t in FLASH_TYPES for d in FLASH_HEAD_DIMS)),
    _each_float("argmax_kernel", "sampling.cu", "int* out_ids, const T* logits, int vocab"),
    _each_float("sample_kernel", "sampling.cu",
                "int* out_ids, const T* logits, const float* temperature, const int* top_k, "
                "const float* top_p, const float* min_p, const float* uniform, int vocab"),
    _each_float("grammar_mask_kernel", "grammar_mask.cu",
                "T* logits, const int* bitmask, const int* rows, int vocab, int words"),
    KernelSpec("copy_blocks_kernel", "copy_blocks.cu",
               signature("const unsigned long long* k_ptrs, const unsigned long long* v_ptrs, const int* pairs, "
                    "int words_per_block")),
    _each_float("take_rows_kernel", "take_rows.cu", "T* out, const T* x, const int* indices, int cols"),
    # weight-only products (int8 and fp8 weights): W the weight type, (T, O) = (activation type, output type)
    # as RESIDUAL_PAIRS pairs them
    KernelSpec("wo_gemv_kernel", "weight_only_linear.cu", signature(
                "O* out, const T* x, const W* q, const float* scale, const O* bias, int rows, int n_out, int k, "
                "int has_bias"), ("W", "T", "O"), tuple((w, *pair) for w in WEIGHT_TYPES for pair in RESIDUAL_PAIRS)),
    KernelSpec("wo_dequant_kernel", "weight_only_linear.cu", signature(
                "T* out, const W* q, const float* scale, int k"), ("W", "T"),
               tuple((w, t) for w in WEIGHT_TYPES for t in FLOAT_TYPES)),
    KernelSpec("wo_embedding_kernel", "weight_only_embedding.cu", signature(
                "R* out, const int* ids, const W* q, const float* row_scale, int hidden, float scale"),
               ("W", "R"), tuple((w, t) for w in WEIGHT_TYPES for t in FLOAT_TYPES)),
)}


def sources() -> list[str]:
    """The .cu files that hold kernels, in a stable order."""
    return sorted({s.source for s in SPECS.values()})


def _type_name(types: dict[str, tuple[np.dtype, ...]], dtype) -> str | None:
    """The C++ type of `types` (ELEMENT_TYPES or WEIGHT_TYPES) whose arrays may have dtype, or None."""
    dtype = np.dtype(dtype)
    return next((name for name, dtypes in types.items() if dtype in dtypes), None)


def element_type(dtype) -> str:
    """The C++ element type name for a NumPy/CuPy dtype ('float', 'f16' or 'bf16')."""
    name = _type_name(ELEMENT_TYPES, dtype)
    if name is None:
        raise KernelArgumentError(f"no CUDA kernel takes elements of dtype {np.dtype(dtype)}; use float32, float16 "
                                  "or bfloat16")
    return name


def weight_type(dtype) -> str:
    """The C++ weight type W of a weight-only matrix's q of this dtype ('signed char' or 'e4m3')."""
    name = _type_name(WEIGHT_TYPES, dtype)
    if name is None:
        raise KernelArgumentError(f"a weight-only matrix holds int8 or float8 e4m3fn (uint8) values, got "
                                  f"{np.dtype(dtype)}")
    return name


def pack_args(spec: KernelSpec, targs: tuple[str, ...], values) -> list:
    """Check launch arguments against the signature and return them as the kernel expects them.

    Arrays (NumPy or CuPy) must be C-contiguous with the pointee's dtype; they are passed through.
    Scalars become np.int32 / np.float32 / np.uint64 after a range check."""
    values = list(values)
    if len(values) != len(spec.args):
        raise KernelArgumentError(f"{spec.name} takes {len(spec.args)} arguments "
                                  f"({', '.join(a.name for a in spec.args)}), got {len(values)}")
    subst = dict(zip(spec.template, targs))
    spec._check_instance(tuple(targs))
    packed = []
    for arg, value in zip(spec.args, values):
        where = f"{spec.name} argument {arg.name!r} ({arg.ctype})"
        if arg.is_pointer:
            pointee = subst.get(arg.pointee, arg.pointee)
            allowed = ELEMENT_TYPES.get(pointee) or WEIGHT_TYPES.get(pointee) or (_POINTEE_DTYPES[pointee],)
            dtype = getattr(value, "dtype", None)
            if dtype is None or not hasattr(value, "flags"):
                raise KernelArgumentError(f"{where} must be an array, got {type(value).__name__}")
            if np.dtype(dtype) not in allowed:
                raise KernelArgumentError(f"{where} must have dtype {allowed[0]}, got {dtype}")
            if not value.flags.c_contiguous:
                raise KernelArgumentError(f"{where} must be C-contiguous; pass a contiguous buffer")
            if not arg.is_const and not getattr(value.flags, "writeable", True):
                raise KernelArgumentError(f"{where} is written by the kernel but the array is read-only")
            packed.append(value)
        else:
            kind = _SCALAR_TYPES[arg.ctype]
            if kind is np.float32:
                packed.append(np.float32(value))
                continue
            info = np.iinfo(kind)
            if isinstance(value, (bool, np.bool_)) or int(value) != value or not info.min <= int(value) <= info.max:
                raise KernelArgumentError(f"{where} must be an integer in [{info.min}, {info.max}], got {value!r}")
            packed.append(kind(int(value)))
    return packed


def explicit_instantiations(source: str) -> str:
    """C++ explicit instantiations of every template instance in one .cu file (for nvcc in CI)."""
    lines = []
    for spec in SPECS.values():
        if spec.source != source or not spec.template:
            continue
        for targs in spec.instances:
            params = ", ".join(spec.c_types(targs))
            lines.append(f"template __global__ void {spec.name}<{', '.join(targs)}>({params});")
    return "\n".join(lines) + "\n"


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "instantiate":
        sys.stdout.write(explicit_instantiations(argv[1]))
        return 0
    if argv == ["sources"]:
        print("\n".join(sources()))
        return 0
    print("usage: python -m rawinfer.backend.cuda.kernel_specs instantiate FILE.cu | sources", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
