#!/usr/bin/env python3
"""Registers, spills and shared memory of every CUDA kernel, per architecture.

Compiles every CI configuration of kernels/cuda/ to PTX with NVRTC (the
`dump_ptx` example of vellum-backend-cuda), assembles each with ptxas for
sm_80 and sm_90, and writes the table to docs/cuda_kernels.md between its
markers. Exits non-zero on any spill (zero spills is the target) or any
compile error.

    python3 kernels/cuda/ptxas_table.py [--check]   # --check: fail if the doc is stale

Needs NVRTC on LD_LIBRARY_PATH and ptxas (the nvidia-cuda-nvcc-cu12 wheel's
bin/ptxas, or PTXAS=path). No GPU.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "cuda_kernels.md"
BEGIN, END = "<!-- ptxas-table:begin -->", "<!-- ptxas-table:end -->"
ARCHS = [("compute_80", "sm_80"), ("compute_90", "sm_90")]


def find_ptxas():
    if os.environ.get("PTXAS"):
        return os.environ["PTXAS"]
    try:
        import nvidia.cuda_nvcc as m  # type: ignore

        p = Path(list(m.__path__)[0]) / "bin" / "ptxas"
        if p.exists():
            return str(p)
    except ImportError:
        pass
    sys.exit("ptxas not found: pip install nvidia-cuda-nvcc-cu12, or set PTXAS")


def main():
    check = "--check" in sys.argv
    ptxas = find_ptxas()
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    rows, spills = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for virt, real in ARCHS:
            out = Path(tmp) / virt
            subprocess.run(
                ["cargo", "run", "--quiet", "--release", "-p", "vellum-backend-cuda", "--example", "dump_ptx", "--", str(out), virt],
                cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
            )
            for ptx in sorted(out.glob("*.ptx")):
                r = subprocess.run([ptxas, f"-arch={real}", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"ptxas failed on {ptx.name} for {real}:\n{r.stderr}")
                entry = None
                for line in r.stderr.splitlines():
                    m = re.search(r"Function properties for (\S+)", line)
                    if m:
                        entry = {"name": m.group(1)}
                    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
                    if m and entry is not None:
                        entry["spill"] = int(m.group(1)) + int(m.group(2))
                    m = re.search(r"Used (\d+) registers.*?(?:, (\d+) bytes smem)?$", line)
                    if m and entry is not None:
                        smem = re.search(r"(\d+) bytes smem", line)
                        entry["regs"] = int(m.group(1))
                        entry["smem"] = int(smem.group(1)) if smem else 0
                        rows.append((ptx.stem, entry["name"], real, entry["regs"], entry.get("spill", 0), entry["smem"]))
                        spills += entry.get("spill", 0)
                        entry = None
    # One line per (configuration, kernel), the architectures side by side.
    merged = {}
    for c, k, a, g, s, m in rows:
        e = merged.setdefault((c, k), {"regs": {}, "spill": 0, "smem": m})
        e["regs"][a] = g
        e["spill"] += s
    table = [
        f"ptxas: `{version}`; NVRTC from the `nvidia-cuda-nvrtc-cu12` wheel. Regenerate: `python3 kernels/cuda/ptxas_table.py`.",
        "Spill bytes are stores plus loads, summed over both architectures; shared memory is the static part",
        "(v1 adds 4 bytes a context token, v2_reduce 4 bytes a partition, dynamically).",
        "",
        "| configuration | kernel | registers sm_80 | registers sm_90 | spill bytes | static smem |",
        "|---|---|---:|---:|---:|---:|",
    ]
    table += [
        f"| `{c}` | `{k}` | {e['regs'].get('sm_80', '-')} | {e['regs'].get('sm_90', '-')} | {e['spill']} | {e['smem']} |"
        for (c, k), e in sorted(merged.items())
    ]
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + BEGIN + "\n" + "\n".join(table) + "\n" + END + tail
    print("\n".join(table))
    print(f"{len(rows)} kernels, {spills} spill bytes", file=sys.stderr)
    if check and new != text:
        sys.exit("docs/cuda_kernels.md is stale: run python3 kernels/cuda/ptxas_table.py")
    if not check:
        DOC.write_text(new)
    if spills:
        sys.exit(f"{spills} bytes of spills: zero is the target")


if __name__ == "__main__":
    main()
