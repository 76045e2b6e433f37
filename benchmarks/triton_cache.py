"""Compiled Triton kernels carried from one device machine to the next.

    python3 benchmarks/triton_cache.py unpack TARBALL CACHE_DIR   # before a run
    python3 benchmarks/triton_cache.py pack CACHE_DIR TARBALL     # after it (xz)

Triton keys a compiled kernel by its own install, the kernel's source, the target (sm_90
for the H100 and the H200 alike) and the build's options, not by the machine, so a cache
written on one device machine of the image serves the next one: a fresh machine then
compiles only the kernels whose source changed since. One thing in the cache names the
machine: each kernel's group file lists its files by absolute path, and a path that does
not exist is a miss; unpacking rewrites them to the cache directory they land in.
"""
import argparse
import json
import os
import subprocess


def unpack(tarball: str, cache_dir: str) -> int:
    os.makedirs(cache_dir, exist_ok=True)
    subprocess.run(["tar", "-xJf", tarball, "-C", cache_dir], check=True)
    n = 0
    for key in os.listdir(cache_dir):
        folder = os.path.join(cache_dir, key)
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if not name.startswith("__grp__"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                group = json.load(f)
            children = group.get("child_paths")
            if not isinstance(children, dict):
                continue
            group["child_paths"] = {c: os.path.join(folder, os.path.basename(p)) for c, p in children.items()}
            with open(path, "w") as f:
                json.dump(group, f)
            n += 1
    return n


def pack(cache_dir: str, tarball: str) -> int:
    # (the entries at the top of the cache directory, so that unpack can put them anywhere)
    entries = sorted(os.listdir(cache_dir))
    env = dict(os.environ, XZ_OPT="-T0 -6")
    # (without the LLVM and first Triton IRs, which a cache hit does not read: the fast Gluon
    # backward's entry, 4.3 MB with 3.2 of LLVM IR, packs into 90 KB without them, 157 with)
    skip = ["--exclude=*.llir", "--exclude=*.ttir"]
    subprocess.run(["tar", "-cJf", tarball, *skip, "-C", cache_dir, *entries], check=True, env=env)
    return os.path.getsize(tarball)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Carry compiled Triton kernels between device machines.")
    ap.add_argument("verb", choices=["unpack", "pack"])
    ap.add_argument("src", help="unpack: the tarball; pack: the cache directory")
    ap.add_argument("dst", help="unpack: the cache directory; pack: the tarball")
    a = ap.parse_args()
    if a.verb == "unpack":
        print(f"triton cache: {unpack(a.src, a.dst)} kernels from {a.src}")
    else:
        print(f"triton cache: {len(os.listdir(a.src))} entries, {pack(a.src, a.dst)} bytes in {a.dst}")
