"""Digests of the MLIR convdsl hands to iree-compile, per suite case and target: a restructuring must leave them
unchanged.  The CUDA MLIR embeds the Triton kernels' binaries, so its digest covers the kernel code too.

    python3 benchmarks/ir_digest.py --out before.json            # on one commit
    python3 benchmarks/ir_digest.py --out after.json --compare before.json

Embedded PTX (sm_80) is hashed without its debug lines (.loc, .file, the debug sections), so an edit that only
moves lines of the kernels' source does not count as a change; cubins (sm_90) are hashed as they are.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import load_suite  # noqa: E402
from convdsl.compiler import lower_with_tuned_knobs  # noqa: E402
from convdsl.targets import Target  # noqa: E402

TARGETS = ("cuda:sm_90", "cuda:sm_80", "cpu:host", "rocm:gfx942")


_BLOB = re.compile(r'dense<"0x([0-9A-F]+)">( : vector<\d+xi8>)?')
_DEBUG = re.compile(r"^\s*(\.loc|\.file)\b.*$|^\s*\.section\s+\.debug.*?^\s*}", re.M | re.S)


def _without_debug_lines(match: re.Match) -> str:
    data = bytes.fromhex(match.group(1))
    if not data.startswith(b"//"):  # a cubin
        return match.group(0)
    # the PTX without its debug lines (their line numbers follow the kernels' source), and so without its size
    return "ptx:" + hashlib.sha256(_DEBUG.sub("", data.decode()).encode()).hexdigest()


def digest(args: tuple[str, str]) -> tuple[str, str, str]:
    name, target = args
    problem = next(c.problem for c in load_suite(names=[name]))
    backend, arch = target.split(":")
    try:
        text = _BLOB.sub(_without_debug_lines, lower_with_tuned_knobs([problem], Target(backend, arch)))
    except Exception as err:  # noqa: BLE001 - a failure is part of the record
        text = f"error: {type(err).__name__}: {err}"
    return name, target, hashlib.sha256(text.encode()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file of {target: {case: sha256}}")
    ap.add_argument("--compare", type=Path, help="an earlier --out file: list the cases whose MLIR changed")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    jobs = [(c.name, t) for t in TARGETS for c in load_suite()]
    result: dict[str, dict[str, str]] = {t: {} for t in TARGETS}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name, target, h in pool.map(digest, jobs):
            result[target][name] = h
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        changed = [(t, n) for t in result for n in result[t] if before.get(t, {}).get(n) != result[t][n]]
        for t, n in changed:
            print(f"changed: {t} {n}")
        print(f"{len(jobs) - len(changed)} of {len(jobs)} unchanged")
        return 1 if changed else 0
    print(f"{len(jobs)} digests written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
