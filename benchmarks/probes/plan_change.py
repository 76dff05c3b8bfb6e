"""Probe: a change of the planning rules, timed where it changes a plan.  Every 16-bit problem of a problems file
(`benchmarks/models.py record`) whose stream plan on sm_90 differs between an earlier checkout of convdsl (`--before`,
e.g. `git worktree add ../before HEAD~1`) and this one is compiled both ways; `run` times both against cuDNN with
cudnn.benchmark (as benchmarks/models.py trains), each checked against cuDNN on the same tensors.

    python3 benchmarks/probes/plan_change.py build P.convk --problems models.problems.json --before ../before
    python3 benchmarks/probes/plan_change.py run P.convk OUT.json          # on an H100/H200

Kernels are named <case>:before and <case>:after.  Both trees compile with the Triton installed here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# run in a tree's own interpreter: its plans of the problems (key -> what it runs), or its compiled kernels
_TREE_SCRIPT = r"""
import json, sys
from convdsl import stream
from convdsl.problem import problem_from_spec
from convdsl.stream import planned_stream_kernel
from convdsl.targets import Target
from convdsl.tuning.knobs import Knobs

mode, source, out = sys.argv[1:4]
target = Target("cuda", "sm_90")
specs = json.load(open(source))
if mode == "plans":
    plans = {}
    for spec in specs:
        try:
            k = planned_stream_kernel(problem_from_spec(spec), target, Knobs())
            plans[spec["name"]] = [k.describe(), [(sl.launch.kernel, list(sl.launch.grid), sl.launch.warps,
                                                  sl.launch.stages) for sl in k.launches]]
        except Exception as err:
            plans[spec["name"]] = ["none", str(err)[:200]]
    json.dump(plans, open(out, "w"))
else:
    kernels = [planned_stream_kernel(problem_from_spec({**spec, "name": spec["name"] + ":" + mode}), target, Knobs(),
                                     compile=True) for spec in specs]
    stream.save_bundle(kernels, out)
"""


def _in_tree(tree: Path, mode: str, specs: list[dict], out: Path) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(specs, f)
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    # cwd: the tree, which "-c" puts first on sys.path
    subprocess.run([sys.executable, "-c", _TREE_SCRIPT, mode, f.name, str(out.resolve())], env=env, cwd=tree,
                   check=True)
    os.unlink(f.name)


def build(out: Path, problems: Path, before: Path) -> None:
    from convdsl import stream

    specs, seen = [], set()
    for entry in json.loads(problems.read_text())["problems"]:
        key = json.dumps({k: v for k, v in entry["problem"].items() if k != "name"}, sort_keys=True)
        if entry["problem"]["dtype"] in ("f16", "bf16") and key not in seen:
            seen.add(key)
            specs.append({**entry["problem"], "name": f"{entry['problem']['op']}#{len(seen)}"})
    with tempfile.TemporaryDirectory() as tmp:
        plans = {}
        for side, tree in (("before", before), ("after", ROOT)):
            _in_tree(tree, "plans", specs, Path(tmp) / f"{side}.json")
            plans[side] = json.loads((Path(tmp) / f"{side}.json").read_text())
        changed = [s for s in specs if plans["before"][s["name"]] != plans["after"][s["name"]]
                   and "none" not in (plans["before"][s["name"]][0], plans["after"][s["name"]][0])]
        print(f"{len(changed)} of {len(specs)} problems change plan", flush=True)
        kernels = []
        for side, tree in (("before", before), ("after", ROOT)):
            _in_tree(tree, side, changed, Path(tmp) / f"{side}.convk")
            kernels += stream.load_bundle(Path(tmp) / f"{side}.convk")
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/plan_change.py run P.convk OUT.json",
                 timed_rows(bundle, cudnn_benchmark=True))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv,
                      extra=[("--problems", dict(type=Path)), ("--before", dict(type=Path))])


if __name__ == "__main__":
    sys.exit(main())
