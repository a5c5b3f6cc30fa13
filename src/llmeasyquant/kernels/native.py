"""The fused C++ operators of the lean loop and the CPU kernels (native/), compiled on first use.

The sources, split by purpose, build one extension module: native/decoder_ops.cpp (the decoder's operators: RMS norm,
rotary embedding and cache write, attention, act(gate) x up, int8 rows of activations), native/matmul_kernels.cpp (the
W8A16 and W4A16 weight-only matmuls, the W4A8 and W8A8 integer matmuls), native/w4a8_amx.cpp (W4A8 for a prompt's
rows on AMX's int8 tiles where the CPU has them; native/w4a8_tiles.h is the weight layout the two share),
native/native_step.cpp (the engine's step over a model's blocks in one call, chaining the operators above and
the paged ones below; native/step_kinds.h: the ways a linear runs in it, shared with Python as STEP_KINDS),
native/paged_ops.cpp (the serving engine's paged KV pool, float and SimQuant coded: stores and attention;
runtime/paged_reference.py is their PyTorch oracle),
native/memory_probe.cpp (the streaming read that eval/bench.py's read bandwidth takes), native/exact_sum_ops.cpp
(the cut-and-add of the exact sums behind GPTQ's Hessians), native/gptq_ops.cpp (GPTQ's column loop),
native/bindings.cpp (the module's one registration block, every name Python calls), native/operators.h (every
exported operator's declaration and contract) and native/common.h (what the operator files share: ATen's vector
type, input checks, the thread-splitting helper).

PyTorch compiles the files with the machine's C++ compiler through `torch.utils.cpp_extension` (needs a compiler,
Python's headers and the `ninja` package) and caches the build, so only the first process on a machine waits for it
(some 20-40 seconds). Instruction-set flags follow the CPU capability PyTorch detected, and the capability is part of
the build's name, so a cache is never shared between machines that differ in it. So is a digest of the flags (VNNI
included where the CPU has it) and of every source and header under native/: a change to any of them, the header
included, builds afresh under a new name, and checkouts with different sources never share (or rebuild each other's)
build.

`ops()` returns the loaded module, or None where it cannot be built (the reason is logged once) or where
`LLMEASYQUANT_NATIVE=0` turns it off; callers then run the eager PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

NATIVE = Path(__file__).with_name("native")
# Compiled into the one extension: the decoder's operators, the matmul kernels (and W4A8's AMX path for prompts), the
# engine's step in one call, the paged KV pool's operators, the read-bandwidth probe, the exact sums'
# cut-and-add, GPTQ's column loop, the module's registration.
SOURCES = tuple(NATIVE / name for name in ("decoder_ops.cpp", "matmul_kernels.cpp", "w4a8_amx.cpp", "native_step.cpp",
                                           "paged_ops.cpp", "memory_probe.cpp", "exact_sum_ops.cpp", "gptq_ops.cpp",
                                           "bindings.cpp"))
# torch.backends.cpu.get_cpu_capability() -> instruction-set flags; CPU_CAPABILITY_* selects the width of ATen's
# Vectorized<float>, which the operators use (and its exp, which PyTorch's own kernels use too).
_FLAGS_BY_CAPABILITY = {
    # -mf16c: ATen's scalar Half conversions use the F16C instructions only where it is given (-mavx512f does not
    # imply it); without it every scalar fp16 read is some 15 integer operations. Every AVX2 CPU has F16C.
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}


def isa_flags(capability: str) -> list[str]:
    """Instruction-set flags for PyTorch's CPU capability, plus AVX-512 VNNI and BF16 where the CPU has them: the
    W4A8 kernel's int8 dot product is one instruction with VNNI (`_mm512_dpbusd_epi32`) and an AVX512-BW pair
    without; the W4A16 decode kernel multiplies 32 weights by one instruction with BF16 (`_mm512_dpbf16_ps`) and
    falls back to its table lookups without."""
    flags = list(_FLAGS_BY_CAPABILITY.get(capability, []))
    if capability == "AVX512" and torch.cpu._is_vnni_supported():
        flags.append("-mavx512vnni")
    if capability == "AVX512" and torch.cpu._is_avx512_bf16_supported():
        flags.append("-mavx512bf16")
    return flags


def source_digest(flags: list[str]) -> str:
    """The build's key: a digest of the compiler flags, of where native/ is, and of the name and content of every
    source and header under it. The place counts because PyTorch rebuilds a cached extension of the same name whose
    sources come from other paths: two checkouts (or an installed copy beside a clone) would otherwise take turns
    recompiling it, minutes each, in every process that alternates."""
    digest = hashlib.sha256(repr(flags).encode() + str(NATIVE.resolve()).encode())
    for path in sorted(p for p in NATIVE.iterdir() if p.suffix in {".cpp", ".h"}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def enabled() -> bool:
    return os.environ.get("LLMEASYQUANT_NATIVE", "1") != "0"


@functools.cache
def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    capability = torch.backends.cpu.get_cpu_capability()
    known = capability if capability in _FLAGS_BY_CAPABILITY else "DEFAULT"
    # -fopenmp: at::parallel_for is OpenMP in PyTorch's CPU build and is compiled into the caller; without it
    # every parallel loop here would run on one thread.
    flags = ["-O3", "-fopenmp", "-fno-math-errno", f"-DCPU_CAPABILITY={known}", *isa_flags(known)]
    log.info("loading the fused C++ operators for %s (compiled on first use, once per machine)", known)
    try:
        return cpp_extension.load(name=f"llmeasyquant_native_{known.lower()}_{source_digest(flags)}",
                                  sources=[str(source) for source in SOURCES], extra_cflags=flags,
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, no headers, no ninja: the eager path computes the same thing
        log.warning("the fused C++ operators could not be built (%s: %s); everything runs on PyTorch operators. "
                    "Install a C++ compiler and the ninja package to enable them", type(error).__name__, error)
        return None


def _put_ninja_on_path() -> None:
    """PyTorch runs `ninja` from PATH; the pip package's binary is not on it when the environment is not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def ops() -> ModuleType | None:
    """The compiled operators, or None (off, or not buildable here)."""
    return _build() if enabled() else None


def built() -> ModuleType:
    """The compiled operators whatever the switch says, for a kernel already chosen while they were on."""
    module = _build()
    if module is None:
        raise RuntimeError("the fused C++ operators are not built on this machine (see the log for why)")
    return module
