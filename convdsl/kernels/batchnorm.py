"""BatchNorm and an activation around a convolution's output, as Triton kernels: the elementwise work that a
Conv -> BatchNorm -> activation sequence does in three kernels forward on PyTorch (statistics, normalise,
activation) and three backward (activation, BatchNorm's reductions, BatchNorm's input gradient), done in two
forward and two backward kernels (convdsl/torch/fused.py runs them): 8 reads and writes of the tensor against 13.

Tensors are viewed as y[n, c, s] (s the flattened spatial position) in one of two layouts, picked by CL:
  CL = True:  channels-last, offset (n * HW + s) * C + c = r * C + c with rows r = (n, s): a block is
              [BLOCK_R rows, BLOCK_C channels], the channels contiguous;
  CL = False: contiguous NC(D)HW, offset n * C * HW + c * HW + s: a block is [BLOCK_C channels, BLOCK_R
              positions] of one image (blocks never cross an image, so the positions stay contiguous).
Row blocks are numbered b = 0 .. BLOCKS - 1 (CL: BLOCKS = ceil(N * HW / BLOCK_R); else N * ceil(HW / BLOCK_R)).

  batch_stats:     program (p, cb) walks row blocks [p * PER, (p + 1) * PER) of channels cb and keeps, per channel,
                   the count, mean and M2 (sum of squared deviations from the mean) of what it read, merging each
                   block's own (two-pass, in registers) with Chan et al.'s rule:
                       n = na + nb, mean = ma + (mb - ma) * nb / n, M2 = M2a + M2b + (mb - ma)^2 * na * nb / n
                   (no E[x^2] - E[x]^2 cancellation); stores them at [p, c].  The last of the P programs of a
                   channel block to finish (an atomic ticket) merges the P partials in order p = 0 .. P - 1 (a
                   fixed order: the same bits every call): var = M2 / R (R = N * HW), invstd = 1 / sqrt(var +
                   eps); with UPDATE, torch.nn's running averages: running = (1 - f) * running + f * stat, the
                   variance's unbiased (R / (R - 1)).  One launch: no finalising launch of a few programs.
  apply_act:       out = act(z), z = (y - mean) * invstd * w + b, computed in f32 and rounded once.
  apply_running:   the same with the running statistics (eval mode, inference): invstd = 1 / sqrt(var + eps).
  grad_stats:      with xhat = (y - mean) * invstd, z = xhat * w + b and dz = dout * act'(z) (the activation's
                   derivative from the recomputed z: nothing but y is kept from the forward), per-program sums of
                   dz and dz * xhat per channel at [p, c]; the last program of a channel block sums them in order:
                   dbeta = sum of dz, dgamma = sum of dz * xhat.
  grad_apply:      dy = w * invstd * (dz - dbeta / R - xhat * dgamma / R): BatchNorm's input gradient in
                   training mode (the batch's mean and variance depend on y).

Activations (ACT): 0 none, 1 relu, 2 relu6, 3 silu, 4 hardswish, with torch's derivatives at the kinks
(relu: 0 at z <= 0; relu6: 1 on 0 < z < 6; hardswish: 0 below -3, z / 3 + 1/2 on [-3, 3], 1 above).
RESIDUAL (ResNet's block end, act(BatchNorm(y) + r); none, relu or relu6): the apply passes add r before the
activation; the backward passes take the activation's mask from the saved output (out > 0, as torch's threshold
backward does; z is not recomputed: r is not kept) and grad_apply also stores the residual's gradient, dz.
"""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _block(b, cb, C, HW, ROWS, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CL: tl.constexpr):
    """Offsets and mask of row block b, channel block cb, and the block's channels (see the module docstring)."""
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    if CL:
        r = b * BLOCK_R + tl.arange(0, BLOCK_R)
        offsets = r[:, None] * C + c[None, :]
        mask = (r < ROWS)[:, None] & (c < C)[None, :]
    else:
        per_image = tl.cdiv(HW, BLOCK_R)
        n = b // per_image
        s = (b % per_image) * BLOCK_R + tl.arange(0, BLOCK_R)
        offsets = n * C * HW + c[:, None] * HW + s[None, :]
        mask = (c < C)[:, None] & (s < HW)[None, :]
    return offsets, mask, c


@triton.jit
def _per_channel(v, CL: tl.constexpr):
    """A channel vector broadcast over a block."""
    if CL:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def _channel_sum(t, CL: tl.constexpr):
    if CL:
        return tl.sum(t, 0)
    else:
        return tl.sum(t, 1)


@triton.jit
def _activation(z, ACT: tl.constexpr):
    if ACT == 1:
        return tl.maximum(z, 0.0)
    elif ACT == 2:
        return tl.minimum(tl.maximum(z, 0.0), 6.0)
    elif ACT == 3:
        return z / (1.0 + tl.exp(-z))
    elif ACT == 4:
        return z * tl.minimum(tl.maximum(z + 3.0, 0.0), 6.0) / 6.0
    else:
        return z


@triton.jit
def _activation_grad(dout, z, ACT: tl.constexpr):
    if ACT == 1:
        return tl.where(z > 0.0, dout, 0.0)
    elif ACT == 2:
        return tl.where((z > 0.0) & (z < 6.0), dout, 0.0)
    elif ACT == 3:
        s = 1.0 / (1.0 + tl.exp(-z))
        return dout * s * (1.0 + z * (1.0 - s))
    elif ACT == 4:
        return tl.where(z < -3.0, 0.0, tl.where(z <= 3.0, dout * (z / 3.0 + 0.5), dout))
    else:
        return dout


@triton.jit
def _partials_chunk(p0, c, c_ok, C: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr):
    """Offsets and mask of partials rows [p0, p0 + BLOCK_P) of a [P, C] array, channels c."""
    rows = p0 + tl.arange(0, BLOCK_P)
    return rows[:, None] * C + c[None, :], (rows < P)[:, None] & c_ok[None, :]


@triton.jit
def _last_program(counter, cb, P: tl.constexpr):
    """True in the last of the P programs of channel block cb to get here (the others' partials are then
    visible: the atomic is acq_rel at GPU scope, after a barrier that orders this program's own stores); the
    counter is reset for the next call."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter + cb, 1)
    last = ticket == P - 1
    if last:
        tl.atomic_xchg(counter + cb, 0)
    return last


@triton.jit
def _output_grad(dout, out, ACT: tl.constexpr):
    """dout * act'(z) from the output out = act(z) (ReLU and ReLU6 only: their derivative is a mask of out, as
    torch's threshold backward reads it), where z itself is not recomputed (a residual was added into it)."""
    if ACT == 1:
        return tl.where(out > 0.0, dout, 0.0)
    elif ACT == 2:
        return tl.where((out > 0.0) & (out < 6.0), dout, 0.0)
    else:
        return dout


@triton.jit
def batch_stats(y, work, counter, running_mean, running_var, batches,
                C: tl.constexpr, HW: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr, PER: tl.constexpr,
                P: tl.constexpr, EPS: tl.constexpr, MOMENTUM: tl.constexpr, UPDATE: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, CL: tl.constexpr):
    # work: the result mean, invstd [2, C] (what the other kernels read as stats), then the partials count,
    # mean, M2 [3, P, C]; batches: BatchNorm's num_batches_tracked (read only with MOMENTUM < 0: momentum None,
    # the cumulative average f = 1 / batches)
    stats = work
    count = work + 2 * C
    mean = count + P * C
    m2 = count + 2 * P * C
    p = tl.program_id(0)
    cb = tl.program_id(1)
    n_acc = 0.0
    mean_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    m2_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for b in range(p * PER, tl.minimum((p + 1) * PER, BLOCKS)):
        offsets, mask, c = _block(b, cb, C, HW, ROWS, BLOCK_R, BLOCK_C, CL)
        x = tl.load(y + offsets, mask=mask, other=0.0).to(tl.float32)
        # the block's valid rows (the same for every channel)
        if CL:
            nb = tl.minimum(ROWS - b * BLOCK_R, BLOCK_R).to(tl.float32)
        else:
            per_image = tl.cdiv(HW, BLOCK_R)
            nb = tl.minimum(HW - (b % per_image) * BLOCK_R, BLOCK_R).to(tl.float32)
        mb = _channel_sum(x, CL) / nb
        d = tl.where(mask, x - _per_channel(mb, CL), 0.0)
        m2b = _channel_sum(d * d, CL)
        total = n_acc + nb
        delta = mb - mean_acc
        mean_acc = mean_acc + delta * (nb / total)
        m2_acc = m2_acc + m2b + delta * delta * (n_acc * nb / total)
        n_acc = total
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    tl.store(mean + p * C + c, mean_acc, mask=c_ok)
    tl.store(m2 + p * C + c, m2_acc, mask=c_ok)
    tl.store(count + p * C + c, tl.zeros((BLOCK_C,), dtype=tl.float32) + n_acc, mask=c_ok)
    if _last_program(counter, cb, P):
        # the P partials merged in order, BLOCK_P at a time: each chunk's count, mean and M2 about its mean
        # (M2 = sum of M2_p + n_p * (mean_p - mean)^2), then merged into the total as above
        n_all = tl.zeros((BLOCK_C,), dtype=tl.float32)
        mean_all = tl.zeros((BLOCK_C,), dtype=tl.float32)
        m2_all = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            at, ok = _partials_chunk(p0, c, c_ok, C, P, BLOCK_P)
            nb = tl.load(count + at, mask=ok, other=0.0)
            mb = tl.load(mean + at, mask=ok, other=0.0)
            n_chunk = tl.sum(nb, 0)
            mean_chunk = tl.sum(nb * mb, 0) / tl.maximum(n_chunk, 1.0)
            d = mb - mean_chunk[None, :]
            m2_chunk = tl.sum(tl.load(m2 + at, mask=ok, other=0.0) + nb * d * d, 0)
            total = n_all + n_chunk
            share = n_chunk / tl.maximum(total, 1.0)
            delta = mean_chunk - mean_all
            mean_all = mean_all + delta * share
            m2_all = m2_all + m2_chunk + delta * delta * n_all * share
            n_all = total
        var = m2_all / ROWS
        tl.store(stats + c, mean_all, mask=c_ok)
        tl.store(stats + C + c, 1.0 / tl.sqrt(var + EPS), mask=c_ok)
        if UPDATE:
            if MOMENTUM < 0:
                factor = 1.0 / tl.load(batches).to(tl.float32)
            else:
                factor = MOMENTUM
            rm = tl.load(running_mean + c, mask=c_ok, other=0.0).to(tl.float32)
            rv = tl.load(running_var + c, mask=c_ok, other=0.0).to(tl.float32)
            rm = (1.0 - factor) * rm + factor * mean_all
            rv = (1.0 - factor) * rv + factor * (m2_all / (ROWS - 1))
            tl.store(running_mean + c, rm.to(running_mean.dtype.element_ty), mask=c_ok)
            tl.store(running_var + c, rv.to(running_var.dtype.element_ty), mask=c_ok)


@triton.jit
def _scale_shift_store(y, res, out, offsets, mask, scale, shift, CL: tl.constexpr, ACT: tl.constexpr,
                       RESIDUAL: tl.constexpr):
    """out = act(y * scale + shift (+ res)) over one block, per-channel scale and shift, in f32."""
    x = tl.load(y + offsets, mask=mask, other=0.0).to(tl.float32)
    z = x * _per_channel(scale, CL) + _per_channel(shift, CL)
    if RESIDUAL:
        z += tl.load(res + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offsets, _activation(z, ACT).to(out.dtype.element_ty), mask=mask)


@triton.jit
def apply_act(y, stats, w, bias, res, out, C: tl.constexpr, HW: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CL: tl.constexpr, ACT: tl.constexpr,
              RESIDUAL: tl.constexpr):
    mean = stats
    invstd = stats + C
    offsets, mask, c = _block(tl.program_id(0), tl.program_id(1), C, HW, ROWS, BLOCK_R, BLOCK_C, CL)
    c_ok = c < C
    scale = tl.load(invstd + c, mask=c_ok, other=0.0) * tl.load(w + c, mask=c_ok, other=0.0).to(tl.float32)
    shift = tl.load(bias + c, mask=c_ok, other=0.0).to(tl.float32) - tl.load(mean + c, mask=c_ok, other=0.0) * scale
    _scale_shift_store(y, res, out, offsets, mask, scale, shift, CL, ACT, RESIDUAL)


@triton.jit
def apply_running(y, running_mean, running_var, w, bias, res, out, C: tl.constexpr, HW: tl.constexpr,
                  ROWS: tl.constexpr, EPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  CL: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr):
    offsets, mask, c = _block(tl.program_id(0), tl.program_id(1), C, HW, ROWS, BLOCK_R, BLOCK_C, CL)
    c_ok = c < C
    rv = tl.load(running_var + c, mask=c_ok, other=1.0).to(tl.float32)
    scale = tl.load(w + c, mask=c_ok, other=0.0).to(tl.float32) / tl.sqrt(rv + EPS)
    shift = (tl.load(bias + c, mask=c_ok, other=0.0).to(tl.float32)
             - tl.load(running_mean + c, mask=c_ok, other=0.0).to(tl.float32) * scale)
    _scale_shift_store(y, res, out, offsets, mask, scale, shift, CL, ACT, RESIDUAL)


@triton.jit
def grad_stats(dout, y, stats, w, bias, out, work, counter, grads, C: tl.constexpr, HW: tl.constexpr,
               ROWS: tl.constexpr, BLOCKS: tl.constexpr, PER: tl.constexpr, P: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, CL: tl.constexpr,
               ACT: tl.constexpr, RESIDUAL: tl.constexpr):
    # work: the partial sums of dz and dz * xhat [2, P, C]; grads: dbeta, dgamma [2, C]
    mean = stats
    invstd = stats + C
    sum_dz = work
    sum_dzx = work + P * C
    dbeta = grads
    dgamma = grads + C
    p = tl.program_id(0)
    cb = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    mu = _per_channel(tl.load(mean + c, mask=c_ok, other=0.0), CL)
    inv = _per_channel(tl.load(invstd + c, mask=c_ok, other=0.0), CL)
    gamma = _per_channel(tl.load(w + c, mask=c_ok, other=0.0).to(tl.float32), CL)
    beta = _per_channel(tl.load(bias + c, mask=c_ok, other=0.0).to(tl.float32), CL)
    acc_dz = tl.zeros((BLOCK_C,), dtype=tl.float32)
    acc_dzx = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for b in range(p * PER, tl.minimum((p + 1) * PER, BLOCKS)):
        offsets, mask, _c = _block(b, cb, C, HW, ROWS, BLOCK_R, BLOCK_C, CL)
        xhat = (tl.load(y + offsets, mask=mask, other=0.0).to(tl.float32) - mu) * inv
        g = tl.load(dout + offsets, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:
            dz = _output_grad(g, tl.load(out + offsets, mask=mask, other=0.0).to(tl.float32), ACT)
        else:
            dz = _activation_grad(g, xhat * gamma + beta, ACT)
        dz = tl.where(mask, dz, 0.0)
        acc_dz += _channel_sum(dz, CL)
        acc_dzx += _channel_sum(dz * xhat, CL)
    tl.store(sum_dz + p * C + c, acc_dz, mask=c_ok)
    tl.store(sum_dzx + p * C + c, acc_dzx, mask=c_ok)
    if _last_program(counter, cb, P):  # the partials summed in order, BLOCK_P at a time
        total_dz = tl.zeros((BLOCK_C,), dtype=tl.float32)
        total_dzx = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            at, ok = _partials_chunk(p0, c, c_ok, C, P, BLOCK_P)
            total_dz += tl.sum(tl.load(sum_dz + at, mask=ok, other=0.0), 0)
            total_dzx += tl.sum(tl.load(sum_dzx + at, mask=ok, other=0.0), 0)
        tl.store(dbeta + c, total_dz, mask=c_ok)
        tl.store(dgamma + c, total_dzx, mask=c_ok)


@triton.jit
def grad_apply(dout, y, stats, w, bias, out, grads, dy, dres, C: tl.constexpr, HW: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CL: tl.constexpr,
               ACT: tl.constexpr, RESIDUAL: tl.constexpr):
    mean = stats
    invstd = stats + C
    dbeta = grads
    dgamma = grads + C
    offsets, mask, c = _block(tl.program_id(0), tl.program_id(1), C, HW, ROWS, BLOCK_R, BLOCK_C, CL)
    c_ok = c < C
    mu = tl.load(mean + c, mask=c_ok, other=0.0)
    inv = tl.load(invstd + c, mask=c_ok, other=0.0)
    gamma = tl.load(w + c, mask=c_ok, other=0.0).to(tl.float32)
    beta = tl.load(bias + c, mask=c_ok, other=0.0).to(tl.float32)
    mean_dz = tl.load(dbeta + c, mask=c_ok, other=0.0) / ROWS
    mean_dzx = tl.load(dgamma + c, mask=c_ok, other=0.0) / ROWS
    xhat = (tl.load(y + offsets, mask=mask, other=0.0).to(tl.float32) - _per_channel(mu, CL)) * _per_channel(inv, CL)
    g = tl.load(dout + offsets, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:  # the residual's gradient is dz itself
        dz = _output_grad(g, tl.load(out + offsets, mask=mask, other=0.0).to(tl.float32), ACT)
        tl.store(dres + offsets, dz.to(dres.dtype.element_ty), mask=mask)
    else:
        dz = _activation_grad(g, xhat * _per_channel(gamma, CL) + _per_channel(beta, CL), ACT)
    grad = (dz - _per_channel(mean_dz, CL) - xhat * _per_channel(mean_dzx, CL)) * _per_channel(gamma * inv, CL)
    tl.store(dy + offsets, grad.to(dy.dtype.element_ty), mask=mask)
