"""Experimental gather forms for grouped/depthwise 2D stride-1 gradients (text MLIR, experiments only)."""
PAR5 = ", ".join(['"parallel"']*5)
IT9 = ", ".join(['"parallel"']*7 + ['"reduction"']*2)
def ty(shape, dt): return "tensor<" + "x".join(map(str, shape)) + f"x{dt}>"

def _clamp(o, name, idx, off, hi):
    o += [f"      %{name}o = arith.constant {off} : index", f"      %{name}y = arith.addi {idx}, %{name}o : index",
          f"      %{name}a = arith.maxsi %{name}y, %c0 : index", f"      %{name}c = arith.minsi %{name}a, {hi} : index",
          f"      %{name}ok = arith.cmpi eq, %{name}y, %{name}c : index"]

def dgrad(fn, N, H, W, G, C, Kc, KY, KX, P, dt):
    T = KY*KX
    I = "affine_map<(n, h, w, g, c) -> (n, h, w, g, c)>"
    Wm = "affine_map<(n, h, w, g, c) -> (g, c)>"
    o = ["module {", f"  func.func @{fn}(%dy: {ty([N,H,W,G,Kc],dt)}, %w: {ty([G,Kc,KY,KX,C],dt)}) -> {ty([N,H,W,G,C],dt)} {{"]
    ws = []
    for ky in range(KY):
        for kx in range(KX):
            for k in range(Kc):
                nm = f"%ws_{ky}_{kx}_{k}"; ws.append(nm)
                o.append(f"    {nm} = tensor.extract_slice %w[0, {k}, {ky}, {kx}, 0] [{G}, 1, 1, 1, {C}] [1, 1, 1, 1, 1] : {ty([G,Kc,KY,KX,C],dt)} to {ty([G,C],dt)}")
    o.append(f"    %e = tensor.empty() : {ty([N,H,W,G,C],dt)}")
    o.append(f"    %r = linalg.generic {{indexing_maps = [{', '.join([Wm]*len(ws))}, {I}], iterator_types = [{PAR5}]}} ins({', '.join(ws)} : {', '.join([ty([G,C],dt)]*len(ws))}) outs(%e : {ty([N,H,W,G,C],dt)}) {{")
    o.append(f"    ^bb0({', '.join(f'%b{i}: {dt}' for i in range(len(ws)))}, %o: {dt}):")
    o += ["      %n = linalg.index 0 : index", "      %h = linalg.index 1 : index", "      %w_ = linalg.index 2 : index", "      %g = linalg.index 3 : index",
          "      %c0 = arith.constant 0 : index", f"      %zf = arith.constant 0.0 : {dt}", "      %acc = arith.constant 0.0 : f32",
          f"      %hm = arith.constant {H-1} : index", f"      %wm = arith.constant {W-1} : index"]
    for ky in range(KY): _clamp(o, f"y{ky}", "%h", P - ky, "%hm")
    for kx in range(KX): _clamp(o, f"x{kx}", "%w_", P - kx, "%wm")
    prev = "%acc"; i = 0
    for ky in range(KY):
        for kx in range(KX):
            o.append(f"      %ok_{ky}_{kx} = arith.andi %y{ky}ok, %x{kx}ok : i1")
            for k in range(Kc):
                o += [f"      %ck{i} = arith.constant {k} : index",
                      f"      %v{i} = tensor.extract %dy[%n, %y{ky}c, %x{kx}c, %g, %ck{i}] : {ty([N,H,W,G,Kc],dt)}",
                      f"      %vs{i} = arith.select %ok_{ky}_{kx}, %v{i}, %zf : {dt}",
                      f"      %xf{i} = arith.extf %vs{i} : {dt} to f32", f"      %yf{i} = arith.extf %b{i} : {dt} to f32",
                      f"      %m{i} = arith.mulf %xf{i}, %yf{i} : f32", f"      %a{i} = arith.addf {prev}, %m{i} : f32"]
                prev = f"%a{i}"; i += 1
    o += [f"      %res = arith.truncf {prev} : f32 to {dt}", f"      linalg.yield %res : {dt}", f"    }} -> {ty([N,H,W,G,C],dt)}",
          f"    return %r : {ty([N,H,W,G,C],dt)}", "  }", "}"]
    return "\n".join(o) + "\n"

def wgrad(fn, N, H, W, G, C, Kc, KY, KX, P, HB, dt):
    R = H // HB
    assert R * HB == H
    # iterators: n hb g k ky kx c | hi w
    dims = "(n, hb, g, k, ky, kx, c, hi, w)"
    dyM = f"affine_map<{dims} -> (n, hb, hi, w, g, k)>"
    outM = f"affine_map<{dims} -> (n, hb, g, k, ky, kx, c)>"
    o = ["module {", f"  func.func @{fn}(%x: {ty([N,H,W,G,C],dt)}, %dy: {ty([N,H,W,G,Kc],dt)}) -> {ty([G,Kc,KY,KX,C],dt)} {{",
         f"    %dye = tensor.expand_shape %dy [[0], [1, 2], [3], [4], [5]] output_shape [{N}, {HB}, {R}, {W}, {G}, {Kc}] : {ty([N,H,W,G,Kc],dt)} into {ty([N,HB,R,W,G,Kc],dt)}",
         "    %cst = arith.constant 0.0 : f32",
         f"    %e = tensor.empty() : {ty([N,HB,G,Kc,KY,KX,C],'f32')}",
         f"    %f = linalg.fill ins(%cst : f32) outs(%e : {ty([N,HB,G,Kc,KY,KX,C],'f32')}) -> {ty([N,HB,G,Kc,KY,KX,C],'f32')}",
         f"    %pp = linalg.generic {{indexing_maps = [{dyM}, {outM}], iterator_types = [{IT9}]}} ins(%dye : {ty([N,HB,R,W,G,Kc],dt)}) outs(%f : {ty([N,HB,G,Kc,KY,KX,C],'f32')}) {{",
         f"    ^bb0(%d: {dt}, %o: f32):",
         "      %n = linalg.index 0 : index", "      %hb = linalg.index 1 : index", "      %g = linalg.index 2 : index",
         "      %ky = linalg.index 4 : index", "      %kx = linalg.index 5 : index", "      %c = linalg.index 6 : index",
         "      %hi = linalg.index 7 : index", "      %w_ = linalg.index 8 : index",
         "      %c0 = arith.constant 0 : index", f"      %cR = arith.constant {R} : index", f"      %cP = arith.constant {P} : index",
         f"      %hm = arith.constant {H-1} : index", f"      %wm = arith.constant {W-1} : index", f"      %zf = arith.constant 0.0 : {dt}",
         "      %h0 = arith.muli %hb, %cR : index", "      %h1 = arith.addi %h0, %hi : index", "      %h2 = arith.addi %h1, %ky : index",
         "      %hy = arith.subi %h2, %cP : index", "      %w1 = arith.addi %w_, %kx : index", "      %wy = arith.subi %w1, %cP : index",
         "      %ha = arith.maxsi %hy, %c0 : index", "      %hc = arith.minsi %ha, %hm : index", "      %hok = arith.cmpi eq, %hy, %hc : index",
         "      %wa = arith.maxsi %wy, %c0 : index", "      %wc = arith.minsi %wa, %wm : index", "      %wok = arith.cmpi eq, %wy, %wc : index",
         "      %ok = arith.andi %hok, %wok : i1",
         f"      %xv = tensor.extract %x[%n, %hc, %wc, %g, %c] : {ty([N,H,W,G,C],dt)}",
         f"      %xs = arith.select %ok, %xv, %zf : {dt}",
         "      %xf = arith.extf %xs : " + f"{dt} to f32", f"      %df = arith.extf %d : {dt} to f32",
         "      %m = arith.mulf %xf, %df : f32", "      %s = arith.addf %o, %m : f32", "      linalg.yield %s : f32",
         f"    }} -> {ty([N,HB,G,Kc,KY,KX,C],'f32')}"]
    M = G*Kc*KY*KX*C
    o += [f"    %pc = tensor.collapse_shape %pp [[0, 1], [2, 3, 4, 5, 6]] : {ty([N,HB,G,Kc,KY,KX,C],'f32')} into {ty([N*HB, M],'f32')}",
          f"    %e2 = tensor.empty() : {ty([M],'f32')}",
          f"    %f2 = linalg.fill ins(%cst : f32) outs(%e2 : {ty([M],'f32')}) -> {ty([M],'f32')}",
          f"    %red = linalg.generic {{indexing_maps = [affine_map<(m, r) -> (r, m)>, affine_map<(m, r) -> (m)>], iterator_types = [\"parallel\", \"reduction\"]}} ins(%pc : {ty([N*HB, M],'f32')}) outs(%f2 : {ty([M],'f32')}) {{",
          "    ^bb0(%a: f32, %b: f32):", "      %s = arith.addf %b, %a : f32", "      linalg.yield %s : f32", f"    }} -> {ty([M],'f32')}",
          f"    %e3 = tensor.empty() : {ty([M],dt)}",
          f"    %t = linalg.generic {{indexing_maps = [affine_map<(m) -> (m)>, affine_map<(m) -> (m)>], iterator_types = [\"parallel\"]}} ins(%red : {ty([M],'f32')}) outs(%e3 : {ty([M],dt)}) {{",
          f"    ^bb0(%a: f32, %b: {dt}):", f"      %s = arith.truncf %a : f32 to {dt}", f"      linalg.yield %s : {dt}", f"    }} -> {ty([M],dt)}",
          f"    %r = tensor.expand_shape %t [[0, 1, 2, 3, 4]] output_shape [{G}, {Kc}, {KY}, {KX}, {C}] : {ty([M],dt)} into {ty([G,Kc,KY,KX,C],dt)}",
          f"    return %r : {ty([G,Kc,KY,KX,C],dt)}", "  }", "}"]
    return "\n".join(o) + "\n"

CASES = {
    "mbv2_dw_dgrad": ("d", dict(N=64, H=56, W=56, G=144, C=1, Kc=1, KY=3, KX=3, P=1, dt="f16")),
    "rx50_g32_dgrad": ("d", dict(N=64, H=56, W=56, G=32, C=4, Kc=4, KY=3, KX=3, P=1, dt="f16")),
    "mbv2_dw_wgrad": ("w", dict(N=64, H=56, W=56, G=144, C=1, Kc=1, KY=3, KX=3, P=1, dt="f16")),
    "rx50_g32_wgrad": ("w", dict(N=64, H=56, W=56, G=32, C=4, Kc=4, KY=3, KX=3, P=1, dt="f16")),
    "convnext_dw7_wgrad": ("w", dict(N=64, H=28, W=28, G=192, C=1, Kc=1, KY=7, KX=7, P=3, dt="bf16")),
}
