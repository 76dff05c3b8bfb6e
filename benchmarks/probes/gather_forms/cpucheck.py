import sys, numpy as np
sys.path.insert(0, 'benchmarks/probes/gather_forms'); sys.path.insert(0, '.')
import gen3
import iree.compiler as ic, iree.runtime as rt
from convdsl.problem import ConvProblem
from convdsl import reference
def run(src, fn, args):
    vm = ic.compile_str(src, target_backends=["llvm-cpu"], extra_args=["--iree-llvmcpu-target-cpu=host"])
    cfg = rt.Config("local-task"); ctx = rt.SystemContext(config=cfg)
    ctx.add_vm_module(rt.VmModule.copy_buffer(cfg.vm_instance, vm))
    return np.asarray(ctx.modules.module[fn](*args).to_host()).astype(np.float64)
rng = np.random.default_rng(0)
for name, (kind, a) in gen3.CASES.items():
    a = dict(a); a["N"] = 2; a["dt"] = "f16"
    N,H,W,G,C,Kc,KY,KX,P = (a[k] for k in "N H W G C Kc KY KX P".split())
    x = rng.standard_normal((N,H,W,G,C)).astype(np.float16); dy = rng.standard_normal((N,H,W,G,Kc)).astype(np.float16)
    w = rng.standard_normal((G,Kc,KY,KX,C)).astype(np.float16)
    # f64 reference directly
    xp = np.pad(x.astype(np.float64), ((0,0),(P,P),(P,P),(0,0),(0,0)))
    if kind == "d":
        got = run(gen3.dgrad(name, **a), name, [dy, w])
        dxp = np.zeros_like(xp)
        for ky in range(KY):
            for kx in range(KX):
                dxp[:, ky:ky+H, kx:kx+W] += np.einsum("nhwgk,gkc->nhwgc", dy.astype(np.float64), w.astype(np.float64)[:, :, ky, kx, :])
        ref = dxp[:, P:P+H, P:P+W]
    else:
        HB = 2 if H % 2 == 0 else 1
        got = run(gen3.wgrad(name, HB=HB, **a), name, [x, dy])
        ref = np.zeros((G,Kc,KY,KX,C))
        for ky in range(KY):
            for kx in range(KX):
                ref[:, :, ky, kx, :] = np.einsum("nhwgc,nhwgk->gkc", xp[:, ky:ky+H, kx:kx+W], dy.astype(np.float64))
    print(name, np.linalg.norm(got - ref) / np.linalg.norm(ref))
