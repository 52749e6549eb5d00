"""Build of torch_sm90_sdpa.

With a CUDA toolkit (nvcc) this builds the torch-free extension torch_sm90_sdpa._C
(pybind11 + statically linked CUDA runtime, SASS for sm_90a only); without one it is a
pure-Python install that still imports and runs on CPU. torch is never imported here, and
importing this file writes nothing: the build commands generate the instantiations
(csrc/generate_instantiations.py, the one table of dtypes, head dims and tiles) and
torch_sm90_sdpa/_build_config.py.

Environment:
  TORCH_SM90_SDPA_BUILD_CUDA   unset/auto: build _C when nvcc is found; 0: never; 1: must
                               (a missing nvcc is then an error)
  TORCH_SM90_SDPA_HEAD_DIMS    main-kernel head dims, default "64,96,128,192,256"; add
                               "192x128" for the backward of q/k head dim 192 with v head
                               dim 128 (a pair of TILES_DV, built on request only)
                               ("none": pre/post kernels only)
  TORCH_SM90_SDPA_DTYPES       main-kernel dtypes, default "fp16,bf16"
  TORCH_SM90_SDPA_NVCC_FLAGS   extra nvcc flags (e.g. "-Xptxas -v")
  MAX_JOBS                     parallel compiles (default: os.cpu_count())
  CUDA_HOME / CUDA_PATH        the toolkit (else from `which nvcc`, else /usr/local/cuda)
  CUTLASS_INCLUDE_DIR          CUTLASS headers (else from the nvidia-cutlass wheel)
  CXX                          host C++ compiler for the .cpp files and the link (default g++)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

try:
    from setuptools.errors import CompileError, LinkError
except ImportError:  # very old setuptools
    from distutils.errors import CompileError, LinkError  # type: ignore

ROOT = os.path.dirname(os.path.abspath(__file__))
PKG = "torch_sm90_sdpa"
CSRC = "csrc"
INST_DIR = os.path.join(CSRC, "instantiations")
ARCH = "sm_90a"
LOG_PREFIX = "[torch_sm90_sdpa]"


def log(msg: str) -> None:
    print(f"{LOG_PREFIX} {msg}", flush=True)


def _load_generator():
    path = os.path.join(ROOT, CSRC, "generate_instantiations.py")
    spec = importlib.util.spec_from_file_location("_tsdpa_generate_instantiations", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


# ---- toolkit discovery ------------------------------------------------------------------------

def _is_cuda_home(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h"))


def _nvcc_here(nvcc: str) -> str | None:
    """The toolkit behind an nvcc that may be a wrapper script: nvcc's dry run names it."""
    try:
        r = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ _HERE_=(.*)$", r.stdout + r.stderr, re.M)
    return os.path.dirname(m.group(1).strip()) if m else None


def find_cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if _is_cuda_home(home):
                return home
            log(f"warning: {var}={home} has no bin/nvcc + include/cuda_runtime.h; ignored")
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if _is_cuda_home(home):
            return home
        home = _nvcc_here(nvcc)
        if _is_cuda_home(home):
            return home
    if _is_cuda_home("/usr/local/cuda"):
        return "/usr/local/cuda"
    return None


def find_cudart_static(cuda_home: str) -> str | None:
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib")):
        d = os.path.join(cuda_home, sub)
        if os.path.isfile(os.path.join(d, "libcudart_static.a")):
            return d
    return None


def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def find_cutlass_includes() -> list[str]:
    env = os.environ.get("CUTLASS_INCLUDE_DIR")
    if env:
        dirs = [d for d in env.split(os.pathsep) if d]
        for d in dirs:
            if not os.path.isdir(d):
                raise RuntimeError(f"CUTLASS_INCLUDE_DIR entry {d} does not exist")
        return dirs
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "CUTLASS headers not found: install the nvidia-cutlass wheel "
            "(pip install nvidia-cutlass==4.2.0.0; pip does it for you with build isolation) "
            "or set CUTLASS_INCLUDE_DIR")
    base = os.path.join(list(spec.submodule_search_locations)[0], "source")
    inc = os.path.join(base, "include")
    util = os.path.join(base, "tools", "util", "include")
    if not os.path.isfile(os.path.join(inc, "cutlass", "cutlass.h")):
        raise RuntimeError(f"nvidia-cutlass wheel found but {inc}/cutlass/cutlass.h is missing")
    return [inc] + ([util] if os.path.isdir(util) else [])


def cutlass_version(include_dirs: list[str]) -> str:
    for d in include_dirs:
        path = os.path.join(d, "cutlass", "version.h")
        if os.path.isfile(path):
            text = open(path, encoding="utf-8", errors="replace").read()
            parts = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", text) for k in
                     ("MAJOR", "MINOR", "PATCH")]
            if all(parts):
                return ".".join(p.group(1) for p in parts)
    return "unknown"


# ---- what to build ----------------------------------------------------------------------------

def _env_flag(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def decide_cuda() -> tuple[str | None, str | None]:
    """(cuda_home, None) to build _C, or (None, reason) for a pure-Python install."""
    flag = _env_flag("TORCH_SM90_SDPA_BUILD_CUDA")
    if flag in ("0", "false", "no", "off"):
        return None, "TORCH_SM90_SDPA_BUILD_CUDA=0 at build time"
    required = flag in ("1", "true", "yes", "on")
    home = find_cuda_home()
    reason = None
    if home is None:
        reason = "no CUDA toolkit (nvcc) found at build time"
    elif find_cudart_static(home) is None:
        reason = f"CUDA toolkit {home} has no libcudart_static.a"
        home = None
    if home is None and required:
        raise RuntimeError(f"TORCH_SM90_SDPA_BUILD_CUDA=1 but {reason} "
                           "(set CUDA_HOME or put nvcc on PATH)")
    return home, reason


def write_build_config(package_dir: str) -> None:
    """torch_sm90_sdpa/_build_config.py in package_dir: what this build makes (see
    csrc/generate_instantiations.py)."""
    text = gen.build_config_source(cuda=CUDA_HOME is not None, reason=NO_CUDA_REASON,
                                   main_kernel=MAIN_KERNEL, selected=SELECTED, arch=ARCH,
                                   dv_selected=DV_SELECTED)
    os.makedirs(package_dir, exist_ok=True)
    gen.write_if_changed(os.path.join(package_dir, "_build_config.py"), text)


def source_hash() -> str:
    """sha256 (16 hex digits) of the C++ / CUDA sources and the generator: part of
    build_info(), so that the compile pass's cache key changes with the kernels' contract."""
    h = hashlib.sha256()
    for top in (CSRC, "registration"):
        for dirpath, dirnames, filenames in sorted(os.walk(os.path.join(ROOT, top))):
            dirnames[:] = sorted(d for d in dirnames if d != "instantiations")
            for name in sorted(filenames):
                if name.endswith((".h", ".cu", ".cpp", ".py")):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, ROOT).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()[:16]


def _c_string(s: str) -> str:
    return json.dumps(s)  # a valid C string literal for ASCII text


def write_build_info_header(info: dict) -> None:
    lines = ["// Generated by setup.py at build time. Do not edit.", "#pragma once"]
    for key, val in info.items():
        lines.append(f"#define TORCH_SM90_SDPA_{key} {_c_string(val)}")
    gen.write_if_changed(os.path.join(ROOT, INST_DIR, "build_info.h"), "\n".join(lines) + "\n")


# What to build is decided here from the environment and the toolkit (read-only); the files
# are generated by the build commands below, never at import.
CUDA_HOME, NO_CUDA_REASON = decide_cuda()
HEAD_DIMS = gen.parse_head_dims(os.environ.get("TORCH_SM90_SDPA_HEAD_DIMS"))
DTYPES = gen.parse_dtypes(os.environ.get("TORCH_SM90_SDPA_DTYPES"))
HAVE_TEMPLATE = gen.template_header_exists(os.path.join(ROOT, CSRC))
MAIN_KERNEL = HAVE_TEMPLATE and bool(HEAD_DIMS) and bool(DTYPES)
SELECTED = gen.variants(HEAD_DIMS, DTYPES) if MAIN_KERNEL else []
DV_SELECTED = gen.dv_variants(HEAD_DIMS, DTYPES) if MAIN_KERNEL else []  # (dtype, D, Dv), Dv != D
CSRC_SOURCES = sorted(os.path.join(CSRC, f) for f in os.listdir(os.path.join(ROOT, CSRC))
                      if f.endswith(".cu"))  # pre/post kernels, mask classification
REGISTRATION_SOURCES = sorted(os.path.join("registration", f)
                              for f in os.listdir(os.path.join(ROOT, "registration"))
                              if f.endswith(".cpp"))

ext_modules = []
if CUDA_HOME is not None:
    # sources are filled in by BuildExt once the instantiations are generated
    ext_modules.append(Extension(f"{PKG}._C", sources=[], language="c++"))


# ---- the build --------------------------------------------------------------------------------

NVCC_BASE_FLAGS = [
    f"-gencode=arch=compute_90a,code={ARCH}", "-O3", "-DNDEBUG", "-std=c++17",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda", "-lineinfo", "-Xcompiler", "-fPIC", "-Xcompiler",
    "-fvisibility=hidden",
]
CXX_BASE_FLAGS = ["-O2", "-DNDEBUG", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall",
                  "-Wno-unused-function"]


def _parse_depfile(path: str) -> list[str] | None:
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError:
        return None
    text = text.replace("\\\n", " ")
    deps = []
    for line in text.splitlines():
        if ":" not in line:
            continue
        _, rhs = line.split(":", 1)
        rhs = rhs.replace("\\ ", "\0")
        deps.extend(tok.replace("\0", " ") for tok in rhs.split())
    return deps


def _up_to_date(obj: str, dep: str, cmd_file: str, cmd: list[str]) -> bool:
    if not (os.path.isfile(obj) and os.path.isfile(cmd_file)):
        return False
    if open(cmd_file, encoding="utf-8").read() != json.dumps(cmd):
        return False
    deps = _parse_depfile(dep)
    if not deps:
        return False
    t = os.path.getmtime(obj)
    for d in deps:
        try:
            if os.path.getmtime(os.path.join(ROOT, d)) > t:
                return False
        except OSError:
            return False  # a dependency vanished
    return True


class BuildPy(build_py):
    """Also writes torch_sm90_sdpa/_build_config.py into the build (pure-Python installs too)."""

    def run(self):
        super().run()
        if not self.dry_run:
            write_build_config(os.path.join(self.build_lib, PKG))


class BuildExt(build_ext):
    """Generates the instantiations, then compiles with nvcc / g++ in parallel (per-file
    timing, dependency tracking) and links with g++."""

    def run(self):
        super().run()
        if self.inplace and not self.dry_run:  # `setup.py build_ext --inplace`: no build_py
            write_build_config(os.path.join(ROOT, PKG))

    def build_extensions(self):
        if CUDA_HOME is None:
            return
        if not HAVE_TEMPLATE:
            log(f"note: {CSRC}/{gen.TEMPLATE_HEADER} does not exist: building the pre/post "
                "kernels only (no main-kernel variants)")
        inst_sources = gen.generate(os.path.join(ROOT, INST_DIR), HEAD_DIMS, DTYPES, MAIN_KERNEL)
        sources = [os.path.relpath(p, ROOT) for p in inst_sources]
        sources += CSRC_SOURCES + REGISTRATION_SOURCES
        log(f"CUDA toolkit {CUDA_HOME}: building {PKG}._C for {ARCH}; main-kernel variants: "
            + (", ".join([f"{dt}/hdim{d}" for dt, d in SELECTED]
                         + [f"{dt}/hdim{d}x{dv}" for dt, d, dv in DV_SELECTED]) or "none"))
        # setuptools would compile in series with its own compiler; we do it ourselves
        for ext in self.extensions:
            ext.sources = sources
            self.build_extension(ext)

    def build_extension(self, ext):
        t_start = time.time()
        cuda_home = CUDA_HOME
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
        cxx = os.environ.get("CXX", "g++")
        lib_dir = find_cudart_static(cuda_home)
        cutlass_inc = find_cutlass_includes()
        try:
            import pybind11
        except ImportError:
            raise CompileError("pybind11 is needed to build torch_sm90_sdpa._C "
                               "(pip install 'pybind11>=2.12')") from None
        py_inc = [sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]]
        py_inc = list(dict.fromkeys(py_inc))
        extra_nvcc = shlex.split(os.environ.get("TORCH_SM90_SDPA_NVCC_FLAGS", ""))

        nvcc_flags = NVCC_BASE_FLAGS + extra_nvcc + [f"-I{CSRC}"] + [f"-I{d}" for d in cutlass_inc]
        cxx_flags = (CXX_BASE_FLAGS + [f"-I{CSRC}", "-Iregistration",
                                       f"-I{os.path.join(cuda_home, 'include')}",
                                       f"-I{pybind11.get_include()}"] + [f"-I{d}" for d in py_inc])
        write_build_info_header({
            "SOURCE_HASH": source_hash(),
            "NVCC_VERSION": nvcc_version(nvcc),
            "CUTLASS_VERSION": cutlass_version(cutlass_inc),
            "NVCC_FLAGS": " ".join(NVCC_BASE_FLAGS + extra_nvcc),
            "CXX_FLAGS": " ".join(CXX_BASE_FLAGS),
            "ARCH": ARCH,
        })

        jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
        jobs = max(1, jobs)
        tmp = os.path.abspath(os.path.join(self.build_temp, "torch_sm90_sdpa"))
        os.makedirs(tmp, exist_ok=True)

        tasks = []
        for src in ext.sources:
            obj = os.path.join(tmp, src.replace(os.sep, "__") + ".o")
            dep = obj[:-2] + ".d"
            if src.endswith(".cu"):
                cmd = [nvcc] + nvcc_flags + ["-MD", "-MF", dep, "-c", src, "-o", obj]
            else:
                cmd = [cxx] + cxx_flags + ["-MMD", "-MF", dep, "-c", src, "-o", obj]
            tasks.append((src, obj, dep, cmd))
        # longest first: main-kernel instantiations, then prepost.cu, then the .cpp files
        order = {"instantiations": 0}
        tasks.sort(key=lambda t: (order.get(os.path.basename(os.path.dirname(t[0])), 1),
                                  not t[0].endswith(".cu"), t[0]))

        # A kernel file takes about 45 s with 2 parallel jobs and 85-115 s with 16 (nvcc 13.0,
        # sm_90a; the parallel compiles slow each other), the others a few seconds: the
        # estimate printed before the first file; after each one, what is left at the mean
        # time per file so far, shared by the jobs.
        n_main = sum(order.get(os.path.basename(os.path.dirname(t[0])), 1) == 0 for t in tasks)
        per_file_s = 45 if jobs <= 4 else 100
        log(f"compiling {len(tasks)} files ({n_main} kernel variants) with up to {jobs} "
            f"parallel jobs (nvcc {nvcc_version(nvcc)}, {cxx}); expect about "
            f"{max(1, round(-(-n_main // jobs) * per_file_s / 60))} min on {jobs} cores")
        print_lock = threading.Lock()
        failed = []
        times = {}
        compiled = 0
        done = [0]
        durations = []
        t_first = time.time()

        def run(task):
            src, obj, dep, cmd = task
            cmd_file = obj + ".cmd"
            if not self.force and _up_to_date(obj, dep, cmd_file, cmd):
                with print_lock:
                    done[0] += 1
                    log(f"[{done[0]}/{len(tasks)}] up to date: {src}")
                return src, None, True
            if failed:  # another file failed: do not start new work
                return src, None, False
            t0 = time.time()
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            dt = time.time() - t0
            out = (r.stdout + r.stderr).strip()
            with print_lock:
                done[0] += 1
                if r.returncode != 0:
                    failed.append(src)
                    log(f"FAILED: {src} after {dt:.1f} s (exit {r.returncode})")
                    log("command: " + shlex.join(cmd))
                else:
                    durations.append(dt)
                    elapsed = time.time() - t_first
                    left = sum(durations) / len(durations) * (len(tasks) - done[0]) / jobs
                    log(f"[{done[0]}/{len(tasks)}] compiled {src} in {dt:.1f} s "
                        f"({elapsed / 60:.1f} min so far, about {left / 60:.0f} min left)")
                if out:
                    print(out, flush=True)
            if r.returncode == 0:
                with open(cmd_file, "w", encoding="utf-8") as f:
                    f.write(json.dumps(cmd))
            return src, dt, r.returncode == 0

        t_compile = time.time()
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for src, dt, ok in pool.map(run, tasks):
                if dt is not None:
                    times[src] = dt
                    compiled += ok
        t_compile = time.time() - t_compile
        if failed:
            raise CompileError(f"{LOG_PREFIX} compilation failed: {', '.join(failed)}")

        out_path = os.path.abspath(self.get_ext_fullpath(ext.name))
        os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
        objs = [t[1] for t in tasks]
        link_cmd = ([cxx, "-shared", "-o", out_path] + objs +
                    [f"-L{lib_dir}", "-lcudart_static", "-ldl", "-lrt", "-lpthread",
                     "-Wl,--exclude-libs,ALL", "-Wl,-O1"])
        link_stamp = os.path.join(tmp, "link.cmd")
        need_link = (self.force or compiled > 0 or not os.path.isfile(out_path)
                     or not os.path.isfile(link_stamp)
                     or open(link_stamp, encoding="utf-8").read() != json.dumps(link_cmd)
                     or any(os.path.getmtime(o) > os.path.getmtime(out_path) for o in objs))
        t_link = 0.0
        if need_link:
            t0 = time.time()
            r = subprocess.run(link_cmd, cwd=ROOT, capture_output=True, text=True)
            t_link = time.time() - t0
            out = (r.stdout + r.stderr).strip()
            if out:
                print(out, flush=True)
            if r.returncode != 0:
                log("command: " + shlex.join(link_cmd))
                raise LinkError(f"{LOG_PREFIX} linking {out_path} failed")
            with open(link_stamp, "w", encoding="utf-8") as f:
                f.write(json.dumps(link_cmd))
            log(f"linked {os.path.relpath(out_path, ROOT)} in {t_link:.1f} s")
        else:
            log(f"up to date: {os.path.relpath(out_path, ROOT)}")

        total = time.time() - t_start
        if times:
            log("compile times (s): " + ", ".join(
                f"{os.path.basename(s)}={t:.1f}" for s, t in
                sorted(times.items(), key=lambda kv: -kv[1])))
        log(f"build of {ext.name}: {compiled} compiled, {len(tasks) - len(times)} up to date, "
            f"{jobs} jobs; compile {t_compile:.1f} s, link {t_link:.1f} s, total {total:.1f} s")
        with open(os.path.join(tmp, "build_times.json"), "w", encoding="utf-8") as f:
            json.dump({"compile_s": times, "compile_wall_s": t_compile, "link_s": t_link,
                       "total_s": total, "jobs": jobs}, f, indent=1)


if CUDA_HOME is None:
    log(f"pure-Python install ({NO_CUDA_REASON}); {PKG}._C is not built")

setup(
    ext_modules=ext_modules,
    cmdclass={"build_py": BuildPy, "build_ext": BuildExt},
)
