"""Builds and loads the skinny-linear C++ kernel once per process, or reports why it cannot.

The source compiles with the machine's g++ through `torch.utils.cpp_extension.load` into a
cache directory (`SPLITPHASE_KERNEL_DIR`, default `~/.cache/splitphase/kernels`), tuned to the
building CPU (`-march=native`). `SPLITPHASE_KERNELS=0` turns it off. A failed build is not an
error: callers fall back to torch and `status()` says why. `python -m splitphase.kernels.build`
builds ahead of time (`make kernels`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
SOURCES = [HERE / n for n in (
    "skinny_linear.cpp", "decode_attention.cpp", "norm_rope.cpp", "silu_mul.cpp",
    "decode_stack.cpp", "prefill_attention.cpp",
)]
# Every header: one left out of the digest would not rebuild the library when it changes.
HEADERS = sorted(HERE.glob("*.h"))
_NAME = "splitphase_kernels"


def source_digest() -> str:
    """Hash of every source and header, and of where they live.

    Torch's loader only notices changed sources, and its ninja file names them by absolute
    path, so two checkouts sharing one directory would rebuild over each other.
    """
    h = hashlib.sha256(str(HERE.resolve()).encode())
    for path in SOURCES + HEADERS:
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


@dataclass
class KernelStatus:
    """Whether the native kernel is loaded, and if not, why."""

    loaded: bool = False
    reason: str = "not built yet"


class _Loader:
    """Holds the one load attempt of this process (the library registers global ops once)."""

    def __init__(self) -> None:
        self.status: KernelStatus | None = None

    def load(self) -> KernelStatus:
        if self.status is None:
            self.status = _try_load()
        return self.status


_LOADER = _Loader()


def build_dir() -> Path:
    """Where the compiled library is cached (one subdirectory per torch version)."""
    root = os.environ.get("SPLITPHASE_KERNEL_DIR") or Path.home() / ".cache/splitphase/kernels"
    return Path(root) / f"torch-{torch.__version__.replace('+', '_')}"


def enabled() -> bool:
    """False when the user switched native kernels off with SPLITPHASE_KERNELS=0."""
    return os.environ.get("SPLITPHASE_KERNELS", "1") not in ("0", "false", "off")


def _try_load() -> KernelStatus:
    if not enabled():
        return KernelStatus(False, "disabled by SPLITPHASE_KERNELS=0")
    if hasattr(torch.ops.splitphase, "silu_mul"):
        _on_load()
        return KernelStatus(True, "already registered")
    try:
        from torch.utils import cpp_extension

        path = build_dir() / source_digest()
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "splitphase.lock", "w") as held:
            # The OS drops a flock when its holder dies; torch's own `lock` file stays behind
            # when a build is killed, and every later load then waits on it forever. Holding
            # the flock, any such file is stale.
            fcntl.flock(held, fcntl.LOCK_EX)
            (path / "lock").unlink(missing_ok=True)
            _compile_and_load(cpp_extension, path)
    except Exception as exc:  # no compiler, no headers, a failed link: torch fallback
        return KernelStatus(False, f"build failed: {type(exc).__name__}: {str(exc)[:300]}")
    _on_load()
    return KernelStatus(True, f"built in {build_dir() / source_digest()}")


def _on_load() -> None:
    """What needs the ops registered: FLOP formulas for torch's counter, fakes for dynamo."""
    # These modules import this one.
    from splitphase.kernels import fake, prefill_attention, skinny

    prefill_attention.register_flops()
    skinny.register_flops()
    fake.register()


def _compile_and_load(cpp_extension: Any, path: Path) -> None:
    cpp_extension.load(
        name=_NAME,
        sources=[str(p) for p in SOURCES],
        extra_include_paths=[str(HERE)],
        # fp-contract off: the portable path must not fuse a*b+c differently per call site.
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(path),
        is_python_module=False,
        verbose=False,
    )


def status() -> KernelStatus:
    """Load (building if needed) and return the kernel's status."""
    return _LOADER.load()


def available() -> bool:
    """True when the native decode kernels can be called."""
    return status().loaded


def main() -> int:
    """Build ahead of time; exit status 0 even when the build fails (torch fallback)."""
    st = status()
    print(f"splitphase kernels: {'loaded' if st.loaded else 'not available'} ({st.reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
