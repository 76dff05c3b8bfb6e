N,H,W,C,K = 2,56,56,256,128
P = N*H*W
hdr = f"func.func @f(%x5: tensor<{N}x{H}x{W}x1x{C}xf16>, %dy5: tensor<{N}x{H}x{W}x1x{K}xf16>) -> tensor<1x{K}x1x1x{C}x{{OT}}> {{\n"
col = f"""  %x = tensor.collapse_shape %x5 [[0,1,2,3],[4]] : tensor<{N}x{H}x{W}x1x{C}xf16> into tensor<{P}x{C}xf16>
  %dy = tensor.collapse_shape %dy5 [[0,1,2,3],[4]] : tensor<{N}x{H}x{W}x1x{K}xf16> into tensor<{P}x{K}xf16>
  %z = arith.constant 0.0 : f32
"""
body = """  ^bb0(%a: f16, %b: f16, %o: f32):
    %ae = arith.extf %a : f16 to f32
    %be = arith.extf %b : f16 to f32
    %m = arith.mulf %ae, %be : f32
    %s = arith.addf %o, %m : f32
    linalg.yield %s : f32
"""
def fin(v, OT):
    if OT == "f32":
        return f"  %r = tensor.expand_shape {v} [[0,1],[2,3,4]] output_shape [1, {K}, 1, 1, {C}] : tensor<{K}x{C}xf32> into tensor<1x{K}x1x1x{C}xf32>\n  return %r : tensor<1x{K}x1x1x{C}xf32>\n}}\n"
    return f"""  %e2 = tensor.empty() : tensor<{K}x{C}xf16>
  %t = linalg.generic {{indexing_maps = [affine_map<(i,j)->(i,j)>, affine_map<(i,j)->(i,j)>], iterator_types = ["parallel","parallel"]}} ins({v} : tensor<{K}x{C}xf32>) outs(%e2 : tensor<{K}x{C}xf16>) {{
  ^bb0(%a: f32, %o: f16):
    %c = arith.truncf %a : f32 to f16
    linalg.yield %c : f16
  }} -> tensor<{K}x{C}xf16>
  %r = tensor.expand_shape %t [[0,1],[2,3,4]] output_shape [1, {K}, 1, 1, {C}] : tensor<{K}x{C}xf16> into tensor<1x{K}x1x1x{C}xf16>
  return %r : tensor<1x{K}x1x1x{C}xf16>
}}
"""
def mm(name, OT, first="x"):
    s = hdr.replace("{OT}", OT) + col
    s += f"  %e = tensor.empty() : tensor<{K}x{C}xf32>\n  %f = linalg.fill ins(%z : f32) outs(%e : tensor<{K}x{C}xf32>) -> tensor<{K}x{C}xf32>\n"
    if first == "x":
        s += f'  %mm = linalg.generic {{indexing_maps = [affine_map<(k,c,p)->(p,c)>, affine_map<(k,c,p)->(p,k)>, affine_map<(k,c,p)->(k,c)>], iterator_types = ["parallel","parallel","reduction"]}} ins(%x, %dy : tensor<{P}x{C}xf16>, tensor<{P}x{K}xf16>) outs(%f : tensor<{K}x{C}xf32>) {{\n'
    else:
        s += f'  %mm = linalg.generic {{indexing_maps = [affine_map<(k,c,p)->(p,k)>, affine_map<(k,c,p)->(p,c)>, affine_map<(k,c,p)->(k,c)>], iterator_types = ["parallel","parallel","reduction"]}} ins(%dy, %x : tensor<{P}x{K}xf16>, tensor<{P}x{C}xf16>) outs(%f : tensor<{K}x{C}xf32>) {{\n'
    s += body + f"  }} -> tensor<{K}x{C}xf32>\n" + fin("%mm", OT)
    return s
def tr(name, OT):
    # compute [C, K] then transpose
    s = hdr.replace("{OT}", OT) + col
    s += f"  %e = tensor.empty() : tensor<{C}x{K}xf32>\n  %f = linalg.fill ins(%z : f32) outs(%e : tensor<{C}x{K}xf32>) -> tensor<{C}x{K}xf32>\n"
    s += f'  %mm = linalg.generic {{indexing_maps = [affine_map<(c,k,p)->(p,c)>, affine_map<(c,k,p)->(p,k)>, affine_map<(c,k,p)->(c,k)>], iterator_types = ["parallel","parallel","reduction"]}} ins(%x, %dy : tensor<{P}x{C}xf16>, tensor<{P}x{K}xf16>) outs(%f : tensor<{C}x{K}xf32>) {{\n'
    s += body + f"  }} -> tensor<{C}x{K}xf32>\n"
    s += f"""  %e3 = tensor.empty() : tensor<{K}x{C}xf32>
  %tt = linalg.transpose ins(%mm : tensor<{C}x{K}xf32>) outs(%e3 : tensor<{K}x{C}xf32>) permutation = [1, 0]
"""
    return s + fin("%tt", OT)
def neg(name, OT):
    # materialize K-inner copies of both operands with a negation (not foldable into the consumer), negate back in the body
    s = hdr.replace("{OT}", OT) + col
    for v, D in (("x", C), ("dy", K)):
        s += f"""  %{v}e = tensor.empty() : tensor<{D}x{P}xf16>
  %{v}t = linalg.generic {{indexing_maps = [affine_map<(i,j)->(j,i)>, affine_map<(i,j)->(i,j)>], iterator_types = ["parallel","parallel"]}} ins(%{v} : tensor<{P}x{D}xf16>) outs(%{v}e : tensor<{D}x{P}xf16>) {{
  ^bb0(%a: f16, %o: f16):
    %n = arith.negf %a : f16
    linalg.yield %n : f16
  }} -> tensor<{D}x{P}xf16>
"""
    s += f"  %e = tensor.empty() : tensor<{K}x{C}xf32>\n  %f = linalg.fill ins(%z : f32) outs(%e : tensor<{K}x{C}xf32>) -> tensor<{K}x{C}xf32>\n"
    s += f'  %mm = linalg.generic {{indexing_maps = [affine_map<(k,c,p)->(k,p)>, affine_map<(k,c,p)->(c,p)>, affine_map<(k,c,p)->(k,c)>], iterator_types = ["parallel","parallel","reduction"]}} ins(%dyt, %xt : tensor<{K}x{P}xf16>, tensor<{C}x{P}xf16>) outs(%f : tensor<{K}x{C}xf32>) {{\n'
    s += body + f"  }} -> tensor<{K}x{C}xf32>\n" + fin("%mm", OT)
    return s
V = {"mm_x_f32": mm("", "f32", "x"), "mm_x_f16": mm("", "f16", "x"), "mm_dy_f32": mm("", "f32", "dy"),
     "tr_f32": tr("", "f32"), "neg_f32": neg("", "f32"), "neg_f16": neg("", "f16")}
for k, v in V.items():
    open(f"{k}.mlir", "w").write(v)
