"""Device probe: 1x1 grad_weight variants (correctness), IREE per-call overhead, kernel vs host time."""
import sys, time, statistics, json, os
import numpy as np, torch
import iree.runtime as rt
mode = sys.argv[1]
if len(sys.argv) > 2:
    rt.flags.parse_flags(*sys.argv[2:])
cfg = rt.Config("cuda"); dev = cfg.device
def load(p, fn="f"):
    ctx = rt.SystemContext(config=cfg); ctx.add_vm_module(rt.VmModule.copy_buffer(cfg.vm_instance, open(p, "rb").read()))
    return ctx, ctx.modules.module[fn]
def up(a):
    return rt.DeviceArray(dev, dev.allocator.allocate_buffer_copy(memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, device=dev, buffer=np.ascontiguousarray(a), element_type={np.float16: rt.HalElementType.FLOAT_16, np.float32: rt.HalElementType.FLOAT_32}[a.dtype.type]), implicit_host_transfer=False)
def tm(f, n=50):
    for _ in range(5): f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
D = os.path.dirname(__file__)
if mode == "w1":
    N,H,W,C,K = 2,56,56,256,128
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(N,H,W,1,C, generator=g) * 2 - 1).half(); dy = (torch.rand(N,H,W,1,K, generator=g) * 2 - 1).half()
    ref = torch.einsum("pk,pc->kc", dy.reshape(-1,K).double(), x.reshape(-1,C).double()).reshape(1,K,1,1,C)
    xa, dya = up(x.numpy()), up(dy.numpy())
    for v in ["cur", "mm_x_f32", "mm_x_f16", "mm_dy_f32", "tr_f32", "neg_f32", "neg_f16"]:
        try:
            ctx, f = load(f"{D}/{v}.vmfb")
            out = torch.from_numpy(np.asarray(f(xa, dya).to_host()).astype(np.float64))
            err = float((out - ref).norm() / ref.norm())
            print(f"w1 {v}: rel.err {err:.2e} {'OK' if err < 1e-2 else 'WRONG'}  {tm(lambda: f(xa, dya), 20):.3f} ms", flush=True)
        except Exception as e:
            print(f"w1 {v}: failed {e}", flush=True)
elif mode == "overhead":
    ctx, f = load(f"{D}/triv.vmfb")
    a, b = up(np.ones(16, np.float32)), up(np.ones(16, np.float32))
    assert np.allclose(np.asarray(f(a, b).to_host()), 2)
    print(f"overhead {sys.argv[2:]}: trivial call {tm(lambda: f(a, b), 200):.4f} ms", flush=True)
    torch.cuda.synchronize()
    x = torch.ones(16, device="cuda")
    def tcall():
        y = x + x; torch.cuda.synchronize()
    print(f"overhead torch trivial add+sync {tm(tcall, 200):.4f} ms", flush=True)
elif mode == "kern":
    # run a few exp vmfbs several times (for ncu)
    B = f"{D}/../exp"
    cases = {c["name"]: c for c in json.load(open(f"{B}/cases.json"))["cases"]}
    for name, var in [("mbv2_dw_dgrad", "x-g-a"), ("mbv2_dw_dgrad", "convdsl"), ("mbv2_dw_wgrad", "x-g8-a")]:
        c = cases[name]
        ctx, f = load(f"{B}/{c['vmfbs'][var]}", c["function"])
        args = [up((np.random.rand(*a["shape"]) - 0.5).astype(np.float16)) for a in c["args"]]
        for _ in range(3): f(*args)
        print(f"kern {name} {var}: host {tm(lambda: f(*args), 20):.3f} ms", flush=True)
