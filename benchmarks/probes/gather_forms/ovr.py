import re, sys, tempfile, subprocess, math
from pathlib import Path
IC = "iree-compile"
BASE = ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"]
def _set(text, key, values):
    return re.sub(rf"\b{key} = \[[0-9, ]*\]", f"{key} = [{', '.join(str(v) for v in values)}]", text, count=1)
def compile(src, out, overrides=None, flags=()):
    """overrides: {dispatch_index: dict(workgroup=[..], thread=[..], reduction=[..])}"""
    flags = BASE + list(flags)
    if not overrides:
        subprocess.run([IC, src, *flags, "-o", out], check=True); return
    with tempfile.TemporaryDirectory() as tmp:
        d, e = Path(tmp)/"d", Path(tmp)/"e"; e.mkdir()
        subprocess.run([IC, src, *flags, "--compile-to=executable-configurations", f"--iree-hal-dump-executable-configurations-to={d}", "-o", f"{tmp}/x.mlir"], check=True)
        for p in d.glob("*.mlir"):
            m = re.search(r"_dispatch_(\d+)", p.name)
            idx = int(m.group(1))
            if idx not in overrides: continue
            t = p.read_text()
            ov = overrides[idx]
            for k, v in ov.items():
                t = _set(t, k, v)
            wg, th = ov.get("workgroup"), ov.get("thread")
            if wg and th:
                n = math.prod(w // t_ for w, t_ in zip(wg, th) if t_ > 0)
                t = re.sub(r"workgroup_size = \[[0-9, ]*\]", f"workgroup_size = [{n}, 1, 1]", t, count=1)
            (e/p.name.removeprefix("configured_")).write_text(t)
        subprocess.run([IC, src, *flags, f"--iree-hal-substitute-executable-configurations-from={e}", "-o", out], check=True)
