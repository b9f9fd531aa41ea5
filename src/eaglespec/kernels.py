"""The package's own CPU kernels (csrc/), built on first use and cached per user.

Owns: deciding whether a kernel can run here (CPU features, `EAGLESPEC_KERNELS=0`, a compiler),
building it with torch's JIT extension builder into ~/.cache/eaglespec/kernels/<hash> (the hash
covers the sources, the headers beside them, torch, Python and the flags), loading a built one
without the builder, and the weight layouts the kernels read (`pack_int4`, `pack_int8`). Two
families: the integer GEMMs (int4_gemm, int8_gemm: AVX512-VNNI, or AVX2 with the same bits;
int8_a16_gemm: AVX512-VNNI / AMX only) and the portable per-token ops
(ops: decode attention, RMSNorm, RoPE). Anything that fails gives None:
callers keep torch's kernels.

Concurrent builds: each process builds in its own temporary directory and renames it into place;
the rename is atomic, and a process that loses the race loads the winner's build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = {"int4": [CSRC / "int4_gemm.cpp"], "int8": [CSRC / "int8_gemm.cpp"],
           "int8a16": [CSRC / "int8_a16_gemm.cpp"]}  # each includes common.h
OPS_SOURCES = [CSRC / "ops.cpp", CSRC / "attention.cpp", CSRC / "attention_amx.cpp", CSRC / "norm_rope.cpp",
               CSRC / "pointwise.cpp", CSRC / "sampling.cpp", CSRC / "layer_stack.cpp",
               CSRC / "draft_runner.cpp"]
# Only the ISA the kernels need: not -march=native, so one build serves any CPU that has these.
# -ffp-contract=off: no fused multiply-adds, so the fp32 steps are the ones the tests reproduce.
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-ffp-contract=off"]
ISA = ("avx512_f", "avx512_bw", "avx512_vnni")
# The W8A16 kernel's tile path is compiled in only where the CPU has AMX-INT8 (and runs only once
# Linux has granted the tile state: `amx_tiles`); elsewhere the same source builds its VNNI path.
AMX_FLAGS = ["-mamx-tile", "-mamx-int8"]
# CPUs without AVX-512 (most desktops, many EPYCs): int4_gemm and int8_gemm build their AVX2 path,
# the same integer sums and float steps 8 lanes at a time (csrc/common.h), so the same bits.
AVX2_FLAGS = ["-O3", "-mavx2", "-mf16c", "-ffp-contract=off"]
AVX2_ISA = ("avx2", "f16c")
AVX2_KINDS = ("int4", "int8")
AMX_ISA = ("amx_tile", "amx_int8")

_loaded: dict[str, ModuleType | None] = {}


def cpu_features() -> set[str]:
    """The CPU's features under torch's names (avx512_f, avx512_vnni, ...)."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        return {k for k, v in caps().items() if v is True}
    try:  # older torch: Linux's flag names, mapped to torch's
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    names = {"avx512f": "avx512_f", "avx512bw": "avx512_bw", "avx512_vnni": "avx512_vnni"}
    return {names.get(f, f) for f in flags.split(":", 1)[1].split()}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eaglespec" / "kernels"


def _build(name: str, sources: list[Path], flags: list[str]) -> ModuleType:
    """Build (or find built) `sources` (with the headers beside them) as extension module `name`
    in the cache; import it."""
    from torch.utils import cpp_extension

    texts = [p.read_bytes() for p in sorted({*sources, *CSRC.glob("*.h")})]
    key = hashlib.sha256(b"\0".join([*texts, torch.__version__.encode(), sys.version.encode(),
                                     " ".join(flags).encode()])).hexdigest()[:16]
    modname = f"{name}_{key}"
    final = cache_root() / modname
    so = final / f"{modname}{'.pyd' if sys.platform == 'win32' else '.so'}"  # the builder's name for it
    if not so.exists():
        try:  # the pip-installed ninja may not be on PATH when the venv is not activated
            import ninja
            if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        print(f"eaglespec: building {name} (once per machine, about a minute)", file=sys.stderr, flush=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{modname}.", dir=final.parent))
        try:
            module = cpp_extension.load(modname, [str(p) for p in sources], extra_cflags=flags,
                                        build_directory=str(tmp),
                                        verbose=False)
            try:
                os.rename(tmp, final)  # atomic; fails if another process got there first
            except OSError:
                if not so.exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return module  # the builder imported it (its file now lives in `final`; mapped files survive a rename)
    spec = importlib.util.spec_from_file_location(modname, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[modname] = module
    return module


def _why(e: Exception) -> str:
    """The line of a build failure worth showing."""
    lines = str(e).strip().splitlines()
    return next((s for s in lines if "error" in s), lines[-1] if lines else type(e).__name__).strip()


def _kernel(kind: str, sources: list[Path], flags: Callable[[], list[str]] | None, fallback: str,
            retry: Callable[[], list[str]] | None = None) -> ModuleType | None:
    """Extension `kind` built once per process (or found built), or None: `EAGLESPEC_KERNELS=0`,
    `flags` None (this CPU cannot run it; silently) or a failed build (one warning naming
    `fallback`, what the callers use instead). `retry`: flags to try when the first build fails
    (a compiler without an optional ISA's support)."""
    if os.environ.get("EAGLESPEC_KERNELS", "1") == "0":
        return None
    if kind not in _loaded:
        module = None
        if flags is not None:
            try:
                module = _build(f"eaglespec_{kind}", sources, flags())
            except Exception as e:  # no compiler, no headers, ...
                if retry is not None and retry() != flags():
                    log.info("eaglespec: building the %s kernel with %s failed (%s); retrying without",
                             kind, " ".join(flags()), _why(e))
                    return _kernel(kind, sources, retry, fallback)
                log.warning("eaglespec: could not build the %s kernel (%s); using %s", kind, _why(e), fallback)
        _loaded[kind] = module
    return _loaded[kind]


def gemm_flags(kind: str, features: set[str]) -> list[str] | None:
    """The build flags of integer GEMM `kind` on a CPU with `features`, or None where it cannot run."""
    if set(ISA) <= features:
        return FLAGS
    if kind in AVX2_KINDS and set(AVX2_ISA) <= features:
        return AVX2_FLAGS
    return None


def _vnni(kind: str) -> ModuleType | None:
    flags = FLAGS if kind in _loaded else gemm_flags(kind, cpu_features())  # CPU features read only until loaded
    return _kernel(kind, SOURCES[kind], (lambda: flags) if flags is not None else None, f"torch's {kind} kernel")


def int8_a16_kernel() -> ModuleType | None:
    """The W8A16 kernel module (`int8_a16_gemm(x, codes, wscale, amx)`, `amx_ready()`), or None
    as `int4_kernel`. Built with AMX where the CPU has it; if that build fails, without."""
    kind = "int8a16"
    if kind not in _loaded and set(ISA) | set(AMX_ISA) <= cpu_features():
        # An old compiler without AMX intrinsics: the retry builds the VNNI path.
        return _kernel(kind, SOURCES[kind], lambda: FLAGS + AMX_FLAGS, f"torch's {kind} kernel", retry=lambda: FLAGS)
    return _vnni(kind)


def amx_tiles() -> bool:
    """Whether the W8A16 kernel runs on AMX tiles here (`EAGLESPEC_AMX=0` turns them off: the
    VNNI path gives the same bits, more slowly from a few rows on)."""
    if os.environ.get("EAGLESPEC_AMX", "1") == "0":
        return False
    mod = int8_a16_kernel()
    return bool(mod is not None and mod.amx_ready())  # asks Linux once per process (the kernel caches it)


def int4_kernel() -> ModuleType | None:
    """The W4A8 kernel module (`int4_gemm(x, codes, params)`), or None where it cannot run:
    `EAGLESPEC_KERNELS=0`, a CPU with neither AVX512-VNNI nor AVX2 (silently) or a failed build
    (one warning)."""
    return _vnni("int4")


def int8_kernel() -> ModuleType | None:
    """The W8A8 kernel module (`int8_gemm(x, codes, wscale)`), or None, as `int4_kernel`."""
    return _vnni("int8")


def ops_flags(features: set[str]) -> list[str]:
    """The ops are portable C++ vector code: the ISA flags only widen their vectors (the numerics
    are the same IEEE operations lane by lane, never contracted into FMAs; attention's fused
    multiply-adds are explicit). Where the CPU has AMX-BF16, attention's tile path is compiled in
    too (csrc/attention_amx.cpp; `attention_amx`)."""
    isa = ["-mavx512f"] if "avx512_f" in features else ["-mavx2"] if "avx2" in features else []
    if "avx512_f" in features and {"amx_tile", "amx_bf16", "avx512_bf16"} <= features:
        isa += ["-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
    return ["-O3", "-ffp-contract=off", *isa]


_UNPINNED = object()
_pinned_ops: ContextVar = ContextVar("eaglespec_pinned_ops", default=_UNPINNED)


def ops_kernel() -> ModuleType | None:
    """The per-token bf16 CPU ops (`decode_attention`, `rms_norm`, `rope`; csrc/ops.h), or None:
    `EAGLESPEC_KERNELS=0` or a failed build (one warning); callers keep their torch ops. Inside
    `pinned_ops()` the answer given on entry (a forward asks about 160 times)."""
    pinned = _pinned_ops.get()
    if pinned is not _UNPINNED:
        return pinned
    # A compiler that cannot target AMX still builds the vector paths.
    return _kernel("ops", OPS_SOURCES, lambda: ops_flags(cpu_features()), "torch ops",
                   retry=lambda: ops_flags(cpu_features() - {"amx_tile", "amx_bf16"}))


def attention_amx() -> bool:
    """Whether decode attention runs on AMX tiles (csrc/attention_amx.cpp: built where the CPU has
    AMX-BF16, used once Linux grants the tile state); `EAGLESPEC_AMX=0` keeps the vector path.
    The two give different (each row-invariant) bits, so a process uses one for every call.
    Inside `pinned_ops()` the answer given on entry."""
    pinned = _pinned_amx.get()
    if pinned is not None:
        return pinned
    if os.environ.get("EAGLESPEC_AMX", "1") == "0":
        return False
    mod = ops_kernel()
    return bool(mod is not None and mod.attention_amx_ready())  # asks Linux once per process (the kernel caches it)


_pinned_amx: ContextVar = ContextVar("eaglespec_pinned_amx", default=None)


@contextmanager
def pinned_ops() -> Iterator[None]:
    """Within: ops_kernel() and attention_amx() answer as they did on entry, without reading the
    environment again (reading `EAGLESPEC_KERNELS` per op cost about 4% of a decode step)."""
    token = _pinned_ops.set(ops_kernel())
    token_amx = _pinned_amx.set(attention_amx())
    try:
        yield
    finally:
        _pinned_amx.reset(token_amx)
        _pinned_ops.reset(token)


GROUP, TILE = 32, 16  # inputs per scale; outputs per kernel tile


def kernel_fits(out_features: int, in_features: int, a16: bool = False) -> bool:
    """Shapes the VNNI kernels take: whole tiles of 16 outputs, whole groups of 32 inputs (the
    W8A16 kernel, `a16`: whole blocks of 64 inputs, an AMX tile's row)."""
    return out_features % TILE == 0 and in_features % (2 * GROUP if a16 else GROUP) == 0


def int4_kernel_params(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero8) [N, K/32] as the int4 kernel applies them, as fp32 tensors: fp16 values, with
    zero8 = zero - 8 * scale (w = q * scale + zero8). Exact for GGUF Q4_0 / Q4_1 weights, whose d
    and m are fp16 (scale = d, zero8 = m); weights quantised here from floats lose 2^-11 relative."""
    zero8 = zero.float() - 8 * scale.float()
    return scale.float().half().float(), zero8.half().float()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Weights' (q int32 [N, K] in 0..15, scale and zero fp32 [N, K/32]) -> the kernel's
    (codes u8 [N/16, K/32, 256], params f16 [N/16, K/32, 2, 16]); layout in csrc/int4_gemm.cpp,
    params from `int4_kernel_params`."""
    n, k = q.shape
    t, g = n // TILE, k // GROUP
    steps = q.to(torch.uint8).view(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, step, 16 outputs, 4 inputs]
    codes = (steps[:, :, :4] | (steps[:, :, 4:] << 4)).reshape(t, g, 256).contiguous()
    params = torch.stack(int4_kernel_params(scale, zero), 0).half().view(2, t, TILE, g).permute(1, 3, 0, 2).contiguous()
    return codes, params


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 (q int8 [N, K] in -127..127, scales [N]) -> the W8A8 kernel's (codes u8
    [N/16, K/32, 512] holding q + 128, wscale f32 [N]); layout in csrc/int8_gemm.cpp."""
    n, k = q.shape
    steps = q.view(torch.uint8).view(n // TILE, TILE, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, step, 16, 4]
    codes = steps.contiguous().view(n // TILE, k // GROUP, 512)
    codes.bitwise_xor_(0x80)  # two's complement q, xor the sign bit: q + 128 (one copy of the 28 MB head)
    return codes, scales.float().contiguous()
