"""The package's own CPU kernels (csrc/), built on first use and cached per user.

Owns: deciding whether a kernel can run here (CPU features, `EAGLESPEC_KERNELS=0`, a compiler),
building it with torch's JIT extension builder into ~/.cache/eaglespec/kernels/<hash> (the hash
covers the source, torch, Python and the flags), loading a built one without the builder, and the
weight layout the int4 kernel reads (`pack_int4`). Anything that fails gives None: callers keep
torch's kernels.

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
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
INT4_SOURCE = CSRC / "int4_gemm.cpp"
# Only the ISA the kernel needs: not -march=native, so one build serves any CPU that has these.
INT4_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-ffp-contract=off"]
INT4_ISA = ("avx512_f", "avx512_bw", "avx512_vnni")

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
    """Build (or find built) `sources` (and the headers beside them) as extension module `name` in
    the cache; import it."""
    from torch.utils import cpp_extension

    texts = [p.read_bytes() for p in sorted({*sources, *sources[0].parent.glob("*.h")})]
    key = hashlib.sha256(b"\0".join([*texts, torch.__version__.encode(), sys.version.encode(),
                                     " ".join(flags).encode()])).hexdigest()[:16]
    modname = f"{name}_{key}"
    final = cache_root() / modname
    so = final / f"{modname}{'.pyd' if sys.platform == 'win32' else '.so'}"  # the builder's name for it
    if not so.exists():
        try:  # the pip-installed ninja may not be on PATH when the venv is not activated
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{modname}.", dir=final.parent))
        try:
            module = cpp_extension.load(modname, [str(p) for p in sources], extra_cflags=flags, build_directory=str(tmp),
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


def int4_kernel() -> ModuleType | None:
    """The W4A8 VNNI kernel module (`int4_gemm(x, codes, params)`), or None where it cannot run:
    `EAGLESPEC_KERNELS=0`, a CPU without AVX512-VNNI (silently) or a failed build (one warning)."""
    if os.environ.get("EAGLESPEC_KERNELS", "1") == "0":
        return None
    if "int4" not in _loaded:
        module = None
        if set(INT4_ISA) <= cpu_features():
            try:
                module = _build("eaglespec_int4", [INT4_SOURCE], INT4_FLAGS)
            except Exception as e:  # no compiler, no headers, ...: torch's kernel it is
                log.warning("eaglespec: could not build the int4 VNNI kernel (%s); using torch's int4 kernel",
                            _why(e))
        _loaded["int4"] = module
    return _loaded["int4"]


OPS_SOURCES = [CSRC / "ops.cpp", CSRC / "attention.cpp", CSRC / "norm_rope.cpp"]


def ops_flags(features: set[str]) -> list[str]:
    """The ops are portable C++ vector code: the ISA flags only widen its vectors (the numerics are
    the same IEEE operations lane by lane, never contracted into FMAs)."""
    isa = ["-mavx512f"] if "avx512_f" in features else ["-mavx2"] if "avx2" in features else []
    return ["-O3", "-ffp-contract=off", *isa]


def ops_kernel() -> ModuleType | None:
    """The per-token bf16 CPU ops (`decode_attention`, `rms_norm`, `rope`; csrc/ops.h), or None:
    `EAGLESPEC_KERNELS=0` or a failed build (one warning); callers keep their torch ops."""
    if os.environ.get("EAGLESPEC_KERNELS", "1") == "0":
        return None
    if "ops" not in _loaded:
        module = None
        try:
            module = _build("eaglespec_ops", OPS_SOURCES, ops_flags(cpu_features()))
        except Exception as e:  # no compiler, no headers, ...: the torch ops it is
            log.warning("eaglespec: could not build the CPU kernels (%s); using torch ops", _why(e))
        _loaded["ops"] = module
    return _loaded["ops"]


GROUP, TILE = 32, 16  # inputs per scale; outputs per kernel tile


def int4_kernel_fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % GROUP == 0


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Weights' (q int32 [N, K] in 0..15, scale and zero fp32 [N, K/32]) -> the kernel's
    (codes u8 [N/16, K/32, 256], params f32 [N/16, K/32, 2, 16]); layout in csrc/int4_gemm.cpp.
    w = (q - 8) * scale + zero = q * scale + zero8 with zero8 = zero - 8 * scale."""
    n, k = q.shape
    t, g = n // TILE, k // GROUP
    steps = q.to(torch.uint8).view(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, step, 16 outputs, 4 inputs]
    codes = (steps[:, :, :4] | (steps[:, :, 4:] << 4)).reshape(t, g, 256).contiguous()
    zero8 = zero.float() - 8 * scale.float()
    params = torch.stack([scale.float(), zero8], 0).view(2, t, TILE, g).permute(1, 3, 0, 2).contiguous()
    return codes, params
