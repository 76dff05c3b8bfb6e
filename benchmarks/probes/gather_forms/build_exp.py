import json, shutil, sys, traceback
from pathlib import Path
sys.path.insert(0, 'benchmarks/probes/gather_forms')
import gen3, ovr
from concurrent.futures import ProcessPoolExecutor
B = Path('benchmarks/build'); OUT = B / 'exp'; OUT.mkdir(exist_ok=True)
main = {c['name']: c for c in json.load(open(B / 'cases.json'))['cases']}
V = {
 "mbv2_dw_dgrad": [("g", {}, {}), ("g-a", {}, {0: dict(workgroup=[8,144], thread=[1,4])}), ("g-b", {}, {0: dict(workgroup=[4,144], thread=[1,8])}),
                   ("g-c", {}, {0: dict(workgroup=[16,144], thread=[1,4])})],
 "rx50_g32_dgrad": [("g", {}, {}), ("g-a", {}, {0: dict(workgroup=[8,32,4], thread=[1,1,4])}), ("g-b", {}, {0: dict(workgroup=[16,32,4], thread=[1,2,4])})],
 "mbv2_dw_wgrad": [("g8", dict(HB=8), {}), ("g8-a", dict(HB=8), {0: dict(workgroup=[1,144,9,0], thread=[1,4,1,0]), 1: dict(reduction=[0,16])}),
                   ("g8-b", dict(HB=8), {0: dict(workgroup=[2,16,9,0], thread=[1,1,1,0]), 1: dict(reduction=[0,16])}),
                   ("g2-a", dict(HB=2), {0: dict(workgroup=[1,144,9,0], thread=[1,4,1,0]), 1: dict(reduction=[0,16])}),
                   ("g4-a", dict(HB=4), {0: dict(workgroup=[1,144,9,0], thread=[1,4,1,0]), 1: dict(reduction=[0,16])})],
 "rx50_g32_wgrad": [("g4", dict(HB=4), {}), ("g4-a", dict(HB=4), {0: dict(workgroup=[1,128,36,0], thread=[1,4,4,0]), 1: dict(reduction=[0,16])}),
                    ("g2-a", dict(HB=2), {0: dict(workgroup=[1,128,36,0], thread=[1,4,4,0]), 1: dict(reduction=[0,16])}),
                    ("g8-b", dict(HB=8), {0: dict(workgroup=[1,32,36,0], thread=[1,1,4,0]), 1: dict(reduction=[0,16])})],
 "convnext_dw7_wgrad": [("g1", dict(HB=1), {}), ("g1-a", dict(HB=1), {0: dict(workgroup=[1,192,7,0], thread=[1,4,1,0]), 1: dict(reduction=[0,16])}),
                        ("g2-a", dict(HB=2), {0: dict(workgroup=[1,192,7,0], thread=[1,4,1,0]), 1: dict(reduction=[0,16])}),
                        ("g4-b", dict(HB=4), {0: dict(workgroup=[1,64,7,0], thread=[1,1,1,0]), 1: dict(reduction=[0,16])})],
}
def build(job):
    name, var, extra, ov = job
    kind, a = gen3.CASES[name]
    src = gen3.dgrad(name, **a) if kind == "d" else gen3.wgrad(name, **extra, **a)
    p = OUT / f"{name}.x-{var}.mlir"; p.write_text(src)
    try:
        ovr.compile(str(p), str(OUT / f"{name}.x-{var}.vmfb"), ov)
        return name, var, None
    except Exception as e:
        return name, var, str(e)[:300]
if __name__ == "__main__":
    jobs = [(n, v, e, o) for n, vs in V.items() for v, e, o in vs]
    res = {}
    with ProcessPoolExecutor(4) as pool:
        for name, var, err in pool.map(build, jobs):
            print(name, var, err or "ok", flush=True)
            res.setdefault(name, {})[f"x-{var}"] = None if err else f"{name}.x-{var}.vmfb"
    cases = []
    for name in V:
        c = dict(main[name]); c["vmfbs"] = {"convdsl": c["vmfbs"]["convdsl"], **res[name]}
        shutil.copy(B / c["vmfbs"]["convdsl"], OUT / c["vmfbs"]["convdsl"])
        c["errors"] = {}
        cases.append(c)
    m = json.load(open(B / 'cases.json')); m["cases"] = cases
    (OUT / "cases.json").write_text(json.dumps(m, indent=1))
