"""Build and drive msl_emu, the Metal-on-CPU emulator (tools/msl_emu).

``build(...)`` compiles the emulator runtime and one shared object per
``.metal`` file (through ``mslpp.py``) into a cache directory keyed by
the content of every input, so a build happens once per change.
``Emulator(build_dir)`` loads such a build with ctypes and dispatches kernels
on NumPy buffers, Metal style. Each build has its own runtime library, loaded
RTLD_LOCAL, so builds with different ``-D`` flags (planted bugs) can live in
one process without their kernels meeting in one registry.
"""

import concurrent.futures
import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
METAL_DIR = os.path.join(ROOT, "metal")
CXX = os.environ.get("CXX", "g++")
WARN = [
    "-Wall",
    "-Wno-attributes",
    "-Wno-unknown-pragmas",
    "-Wno-unused-variable",
    "-Wno-unused-but-set-variable",
    "-Wno-sign-compare",
    "-Wno-unused-function",
]
ASAN = ["-fsanitize=address", "-fno-omit-frame-pointer"]


def cache_root():
    return os.environ.get("MLXQ_EMU_CACHE", os.path.join(ROOT, "build", "msl_emu"))


def _inputs(sources, include_dirs):
    files = sorted(glob.glob(os.path.join(HERE, "include", "**", "*"), recursive=True))
    files += [
        os.path.join(HERE, "src", "msl_emu_runtime.cpp"),
        os.path.join(HERE, "mslpp.py"),
        os.path.abspath(__file__),
    ]
    for d in include_dirs:
        files += sorted(glob.glob(os.path.join(d, "*.h")))
    files += list(sources)
    return [f for f in files if os.path.isfile(f)]


def _compiler_id():
    return subprocess.run([CXX, "--version"], capture_output=True, text=True).stdout


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"command failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r


# Apple's compiler may contract a*b + c into one fused multiply-add; GCC in
# ISO C++ mode does not, and baseline x86-64 has no FMA instruction. The
# contracted build variant asks for both.
CONTRACT = ["-ffp-contract=fast", "-mfma"]


def build(
    sources=None,
    *,
    defines=(),
    sanitize=False,
    contract=False,
    opt="-O2",
    include_dirs=None,
    name="mlxq",
):
    """Compiles the runtime and each source; returns the build directory.

    sources: .metal files (default: every metal/*.metal of the project).
    defines: extra -D flags for the kernels (planted bugs, subsets).
    sanitize: AddressSanitizer build (run it with libasan preloaded).
    contract: floating-point contraction into FMA, as a GPU compiler may do.
    """
    sources = sorted(
        sources if sources is not None else glob.glob(os.path.join(METAL_DIR, "*.metal"))
    )
    include_dirs = list(include_dirs if include_dirs is not None else [METAL_DIR])
    flags = ["-std=c++17", opt, "-g", "-fPIC", "-I" + os.path.join(HERE, "include")] + WARN
    if sanitize:
        flags += ASAN
    if contract:
        flags += CONTRACT
    h = hashlib.sha256()
    h.update(repr((flags, sorted(defines), include_dirs, _compiler_id(), sys.platform)).encode())
    for f in _inputs(sources, include_dirs):
        h.update(f.encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    out = os.path.join(cache_root(), f"{name}-{h.hexdigest()[:16]}")
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # The runtime gets a name of its own per build: the dynamic linker matches
    # a DT_NEEDED name against every library already loaded, so two builds'
    # kernels would otherwise share the first runtime (and its registry).
    runtime = f"libmsl_emu_{h.hexdigest()[:16]}.so"
    _run(
        [CXX]
        + flags
        + [
            "-shared",
            os.path.join(HERE, "src", "msl_emu_runtime.cpp"),
            "-Wl,-soname," + runtime,
            "-o",
            os.path.join(tmp, runtime),
            "-lpthread",
        ]
    )

    def one(src):
        base = os.path.splitext(os.path.basename(src))[0]
        cpp = os.path.join(tmp, base + ".metal.cpp")
        _run(
            [sys.executable, os.path.join(HERE, "mslpp.py"), src, "-o", cpp, "--cxx", CXX]
            + [f"-I{d}" for d in include_dirs]
            + [f"-D{d}" for d in defines]
        )
        _run(
            [CXX]
            + flags
            + [
                "-shared",
                cpp,
                "-o",
                os.path.join(tmp, f"lib{base}.so"),
                "-L" + tmp,
                "-l:" + runtime,
                "-Wl,-rpath,$ORIGIN",
            ]
        )

    workers = max(1, min(len(sources), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        list(ex.map(one, sources))
    open(os.path.join(tmp, ".complete"), "w").close()
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class Buffer:
    """A device buffer: `array`'s memory from byte `offset` on (a view's base)."""

    def __init__(self, array, offset=0):
        assert array.flags.c_contiguous
        self.array, self.offset = array, int(offset)

    @staticmethod
    def of_view(view):
        """The Buffer of a NumPy view plus its strides in elements."""
        base = view
        while isinstance(base.base, np.ndarray):
            base = base.base
        base = np.ascontiguousarray(base) if not base.flags.c_contiguous else base
        off = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        assert 0 <= off < max(base.nbytes, 1), "view outside its base"
        strides = tuple(s // view.itemsize for s in view.strides)
        assert all(s * view.itemsize == t for s, t in zip(strides, view.strides))
        return Buffer(base, off), strides, off // view.itemsize


class Emulator:
    SCHEDULES = {"default": 0, "reverse": 1, "random": 2}

    def __init__(self, build_dir):
        mode = getattr(os, "RTLD_LOCAL", 0) | getattr(os, "RTLD_NOW", 0)
        self.build_dir = build_dir
        (runtime,) = glob.glob(os.path.join(build_dir, "libmsl_emu_*.so"))
        self.lib = ctypes.CDLL(runtime, mode=mode)
        self.kernel_libs = [
            ctypes.CDLL(p, mode=mode)
            for p in sorted(glob.glob(os.path.join(build_dir, "lib*.so")))
            if p != runtime
        ]
        L = self.lib
        L.msl_emu_dispatch.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.c_int,
        ]
        L.msl_emu_diagnostics.restype = ctypes.c_char_p
        L.msl_emu_last_seconds.restype = ctypes.c_double
        L.msl_emu_last_switches.restype = ctypes.c_ulonglong
        L.msl_emu_last_divergent.restype = ctypes.c_ulonglong
        L.msl_emu_set_option.argtypes = [ctypes.c_char_p, ctypes.c_longlong]
        L.msl_emu_set_function_constant.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        L.msl_emu_kernel_name.restype = ctypes.c_char_p

    def kernels(self):
        return [
            self.lib.msl_emu_kernel_name(i).decode() for i in range(self.lib.msl_emu_kernel_count())
        ]

    def set_option(self, key, value):
        self.lib.msl_emu_set_option(key.encode(), int(value))

    def set_schedule(self, name, seed=12345):
        self.set_option("schedule", self.SCHEDULES[name])
        self.set_option("seed", seed)

    def set_function_constant(self, index, value):
        a = np.ascontiguousarray(np.array(value))
        self.lib.msl_emu_set_function_constant(index, a.ctypes.data, a.nbytes)

    def clear_function_constants(self):
        self.lib.msl_emu_clear_function_constants()

    def dispatch(self, name, buffers, grid, threadgroup, *, threads=False, tg_mem=()):
        """buffers: list indexed by [[buffer(i)]]: NumPy arrays, Buffer views,
        bytes (a setBytes argument block) or None (unbound).
        grid: threadgroups per grid, or threads per grid with threads=True
        (dispatchThreads: non-uniform edge threadgroups).
        Returns (ok, diagnostics)."""
        keep = []
        ptrs = (ctypes.c_void_p * max(1, len(buffers)))()
        for i, b in enumerate(buffers):
            if b is None:
                ptrs[i] = None
                continue
            if isinstance(b, (bytes, bytearray)):
                a = np.frombuffer(bytes(b), np.uint8).copy()
                keep.append(a)
                ptrs[i] = a.ctypes.data
                continue
            if isinstance(b, Buffer):
                keep.append(b.array)
                ptrs[i] = b.array.ctypes.data + b.offset
                continue
            a = b if isinstance(b, np.ndarray) else np.array(b)
            assert a.flags.c_contiguous
            keep.append(a)
            ptrs[i] = a.ctypes.data
        g = (ctypes.c_uint32 * 3)(*(tuple(int(x) for x in grid) + (1, 1, 1))[:3])
        t = (ctypes.c_uint32 * 3)(*(tuple(int(x) for x in threadgroup) + (1, 1, 1))[:3])
        tm = (ctypes.c_uint64 * max(1, len(tg_mem)))(*tg_mem)
        rc = self.lib.msl_emu_dispatch(
            name.encode(), ptrs, len(buffers), g, t, int(threads), tm, len(tg_mem)
        )
        return rc == 0, self.lib.msl_emu_diagnostics().decode()

    @property
    def last_seconds(self):
        return self.lib.msl_emu_last_seconds()

    @property
    def last_switches(self):
        return self.lib.msl_emu_last_switches()

    @property
    def last_divergent(self):
        return self.lib.msl_emu_last_divergent()


def asan_preload():
    """LD_PRELOAD value for a Python child that loads ASan builds: the
    compiler's libasan, and libstdc++ (ASan must see the real __cxa_throw
    before MLX throws its first exception), or None without ASan."""
    libs = []
    for name in ("libasan.so", "libstdc++.so"):
        p = subprocess.run(
            [CXX, f"-print-file-name={name}"], capture_output=True, text=True
        ).stdout.strip()
        if not (os.path.isabs(p) and os.path.exists(p)):
            return None
        libs.append(os.path.realpath(p))
    return " ".join(libs)
