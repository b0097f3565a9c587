"""Which instruction sets the CPU kernels may use: the features of the CPU Numba compiles for.

Numba compiles every kernel for one target CPU: the host's name and features, or NUMBA_CPU_NAME and
NUMBA_CPU_FEATURES where they are set (a build for other machines). The hand-written blocks
(llvm.py, vnni.py) and the choice between their paths read the same feature list, never the host's
alone: a kernel then never contains instructions its target lacks, and since Numba's cache keys every
build by that target (CPU name and features), code built with AVX-512 is never loaded on a machine
without it.

    avx512_vnni   AVX-512 F/BW with VNNI: the integer GEMM on 512-bit vectors and vpdpwssd (vnni.py)
    avx2          AVX2 + FMA: the integer GEMM on vpmaddwd, the q4 kernels, the AVX2 attention (llvm.py);
                  where the CPU also has AVX-VNNI (avx_vnni(): 256-bit vpdpbusd without AVX-512, as Intel's
                  cores from Alder Lake on), the 8-bit-activation tiles multiply with it
    portable      anything else: plain Numba loops, generic vector IR (the int8 and q4 GEMMs' AVX2 drivers,
                  q4's matrix-vector kernel), row-invariant dot products (rows.py)
"""

from __future__ import annotations

AVX512_VNNI, AVX2, PORTABLE = "avx512_vnni", "avx2", "portable"
_NEEDS = {AVX512_VNNI: {"avx2", "fma", "avx512f", "avx512bw", "avx512vnni"}, AVX2: {"avx2", "fma"}}


def parse_features(spec: str) -> set[str]:
    """The enabled features of an LLVM feature string ("+avx2,-avx512f,+fma" -> {"avx2", "fma"})."""
    return {f.strip()[1:] for f in spec.split(",") if f.strip().startswith("+")}


def target_features() -> set[str]:
    """The features Numba's code generator compiles for (numba.core.codegen's choice): NUMBA_CPU_FEATURES
    where set (a named CPU's implied features are not expanded: an explicit list without avx2 gets
    the portable paths), else the host's, less every AVX feature where NUMBA_ENABLE_AVX is off.
    Empty where neither can be read (not x86-64, no query): the portable paths."""
    try:
        from numba.core import codegen, config
        if config.CPU_FEATURES is not None:
            return parse_features(config.CPU_FEATURES)
        return parse_features(codegen.get_host_cpu_features())
    except Exception:  # noqa: BLE001 - no feature query on this platform: take the portable paths
        return set()


def select(features: set[str]) -> str:
    """The widest integer-GEMM path a CPU with `features` runs (the constants above)."""
    for isa in (AVX512_VNNI, AVX2):
        if _NEEDS[isa] <= features:
            return isa
    return PORTABLE


FEATURES = frozenset(target_features())
HOST = select(FEATURES)


def avx_vnni(features: frozenset[str] | set[str] = FEATURES) -> bool:
    """Whether the AVX2 path may use AVX-VNNI's 256-bit vpdpbusd (VEX-encoded; Intel CPUs from Alder Lake
    on and others without AVX-512 have it) in place of vpmaddubsw / vpmaddwd with vpadd."""
    return {"avx2", "fma", "avxvnni"} <= features


def describe() -> str:
    """The CPU kernels' path in words, for benchmark reports: "avx512_vnni", "avx2 + AVX-VNNI", "avx2", ..."""
    return HOST + (" + AVX-VNNI" if HOST == AVX2 and avx_vnni() else "")


def supports(isa: str, features: frozenset[str] | set[str] = FEATURES) -> bool:
    """Whether code written for `isa` runs on a CPU with `features` (default: Numba's target)."""
    return isa == PORTABLE or _NEEDS[isa] <= features
