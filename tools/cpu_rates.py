"""How many vector multiplies per second one core of this CPU retires: the integer GEMM's hard limit.

    python tools/cpu_rates.py

Each kernel is a register-only loop of 12 independent dependency chains (no memory traffic),
JIT-compiled from LLVM IR with llvmlite for this CPU and timed on one thread (best of 5):

    fma       12 x vfmadd231ps ymm (8 float32 lanes)   at 2 per cycle: the core's clock = rate / 2
    madd      12 x vpmaddwd ymm (16 int16 pairs)       the integer multiply pipes
    ubsw      12 x vpmaddubsw ymm (32 byte pairs)      the 8-bit tiles' multiply (a8q4tile.py, a8tile.py)
    ubsw+add  12 x (vpmaddubsw, then vpaddw into the chain): the AVX2 q4 tile's inner pair, whose adds
              share the vector pipes with the multiplies (rate = pairs per second)

On the 2-core Zen 3 of docs/CHANGELOG.md both measure 6.3-6.4 G/s: 2 per cycle at ~3.2 GHz. The
integer GEMM tile (rawinfer/backend/cpu/llvm.py: int_gemm_tiles) adds a vpaddd per vpmaddwd plus sign extensions and
broadcasts, which share the same vector pipes: `bench roofline` measures what it reaches.
"""

from __future__ import annotations

import ctypes
import time

CHAINS = 12


def kernel_ir(kind: str) -> str:
    """A function k(n, p) running n iterations of CHAINS independent operations; p -> 8 int32 operands."""
    if kind == "fma":
        ty, el = "<8 x float>", "float"
        decl = "declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)"
        setup = "  %m = bitcast <8 x i32> %mi to <8 x float>"
        body = [f"  %b{j} = call <8 x float> @llvm.fma.v8f32(<8 x float> %a{j}, <8 x float> %m, <8 x float> %m)"
                for j in range(CHAINS)]
    elif kind == "madd":
        ty, el = "<8 x i32>", "i32"
        decl = "declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)"
        setup = "  %m = bitcast <8 x i32> %mi to <16 x i16>"
        body = []
        for j in range(CHAINS):
            body += [f"  %c{j} = bitcast <8 x i32> %a{j} to <16 x i16>",
                     f"  %b{j} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %c{j}, <16 x i16> %m)"]
    else:                                             # ubsw, ubsw+add: the product depends on the chain
        ty, el = "<16 x i16>", "i16"
        decl = "declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)"
        setup = "  %m = bitcast <8 x i32> %mi to <32 x i8>"
        body = []
        for j in range(CHAINS):
            out = f"%p{j}" if kind == "ubsw+add" else f"%b{j}"
            body += [f"  %c{j} = bitcast <16 x i16> %a{j} to <32 x i8>",
                     f"  {out} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> %c{j}, <32 x i8> %m)"]
            if kind == "ubsw+add":
                body.append(f"  %b{j} = add <16 x i16> %p{j}, %a{j}")
    phis = [f"  %a{j} = phi {ty} [ zeroinitializer, %entry ], [ %b{j}, %loop ]" for j in range(CHAINS)]
    lanes = [f"  %r{j} = extractelement {ty} %b{j}, i32 0" for j in range(CHAINS)]
    add = "fadd" if kind == "fma" else "add"
    sums, prev = [], "%r0"
    for j in range(1, CHAINS):
        sums.append(f"  %s{j} = {add} {el} {prev}, %r{j}")
        prev = f"%s{j}"
    lines = [decl, f"define {el} @k(i64 %n, <8 x i32>* %p) {{", "entry:",
             "  %mi = load <8 x i32>, <8 x i32>* %p, align 4", setup, "  br label %loop", "loop:",
             "  %i = phi i64 [ 0, %entry ], [ %i1, %loop ]", *phis, *body, "  %i1 = add i64 %i, 1",
             "  %c = icmp slt i64 %i1, %n", "  br i1 %c, label %loop, label %done", "done:", *lanes, *sums,
             f"  ret {el} {prev}", "}"]
    return "\n".join(lines)


def main() -> None:
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features()
    if not (features.get("avx2") and features.get("fma")):
        raise SystemExit("cpu_rates: this CPU has no AVX2 + FMA; nothing to measure")
    keep = []                                         # engines must outlive the calls into their code
    operand = (ctypes.c_int32 * 8)(*([1] * 8))
    iters = 20_000_000
    kinds = (("fma", "vfmadd ymm"), ("madd", "vpmaddwd ymm"), ("ubsw", "vpmaddubsw ymm"),
             ("ubsw+add", "vpmaddubsw + vpaddw ymm pairs"))
    for kind, what in kinds:
        mod = llvm.parse_assembly(kernel_ir(kind))
        mod.verify()
        tm = llvm.Target.from_default_triple().create_target_machine(      # one per engine: it owns it
            cpu=llvm.get_host_cpu_name(), features=features.flatten(), opt=3)
        ee = llvm.create_mcjit_compiler(mod, tm)
        ee.finalize_object()
        keep.append(ee)
        ret = {"fma": ctypes.c_float, "madd": ctypes.c_int32}.get(kind, ctypes.c_int16)
        fn = ctypes.CFUNCTYPE(ret, ctypes.c_int64, ctypes.c_void_p)(ee.get_function_address("k"))
        fn(1000, ctypes.addressof(operand))
        best = min(_timed(fn, iters, operand) for _ in range(5))
        print(f"{kind:9s} {iters * CHAINS / best / 1e9:5.2f} G {what} per second (one core)")


def _timed(fn, iters: int, operand) -> float:
    t = time.perf_counter()
    fn(iters, ctypes.addressof(operand))
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
