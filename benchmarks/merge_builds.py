"""One build folder for an A/B run: a base build's convdsl modules next to other builds' modules as variants.

    python benchmarks/merge_builds.py OUT BASE LABEL=DIR[:IMPL] ...

OUT gets the cases that any DIR has, each with BASE's convdsl module as "convdsl" and, per LABEL=DIR[:IMPL],
the module DIR's cases.json lists under IMPL (default "convdsl") as the variant LABEL, so that
`gpu_bench.py --build OUT` times them in one process on the same inputs.  This is how a code change is
measured against the build of the commit before it: compile that commit's build into BASE (or keep
benchmarks/build), the change into DIR with `compile_suite.py --out DIR`, then merge.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def _cases(build: Path) -> list[dict]:
    return json.loads((build / "cases.json").read_text())["cases"]


def merge(out: Path, base: Path, variants: list[tuple[str, Path, str]]) -> list[dict]:
    """Write OUT/cases.json and copy the modules; returns the merged cases."""
    out.mkdir(parents=True, exist_ok=True)
    by_variant = {label: ({c["name"]: c for c in _cases(build)}, build, impl) for label, build, impl in variants}
    wanted = set().union(*(cases.keys() for cases, _, _ in by_variant.values()))
    manifest = json.loads((base / "cases.json").read_text())
    merged = []
    for case in manifest["cases"]:
        if case["name"] not in wanted or not case["vmfbs"].get("convdsl"):
            continue
        vmfbs = {"convdsl": case["vmfbs"]["convdsl"]}
        shutil.copy(base / vmfbs["convdsl"], out / vmfbs["convdsl"])
        for label, (cases, build, impl) in by_variant.items():
            module = cases.get(case["name"], {}).get("vmfbs", {}).get(impl)
            if module:
                vmfbs[label] = f"{case['name']}.{label.replace('@', '-at-')}.vmfb"
                shutil.copy(build / module, out / vmfbs[label])
        merged.append({**case, "vmfbs": vmfbs})
    manifest["cases"] = merged
    (out / "cases.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return merged


def _variant(arg: str) -> tuple[str, Path, str]:
    label, sep, rest = arg.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL=DIR[:IMPL], got {arg!r}")
    build, _, impl = rest.partition(":")
    if not (Path(build) / "cases.json").exists():
        raise argparse.ArgumentTypeError(f"{arg}: {build}/cases.json does not exist")
    return label, Path(build), impl or "convdsl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("base", type=Path, help="the build whose convdsl modules are the baseline")
    ap.add_argument("variants", nargs="+", type=_variant, help="LABEL=DIR[:IMPL]")
    args = ap.parse_args(argv)
    for case in merge(args.out, args.base, args.variants):
        print(f"{case['name']:<24} {', '.join(case['vmfbs'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
