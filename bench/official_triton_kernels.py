"""Official Triton kernels for bench/jax_triton_probe.py (imported only where triton is installed: the H200).

add_kernel: a vector add (does jax_triton run at all). stream_gemv: one GEMV as a persistent kernel (phase with no
epilogue), P programs each an equal contiguous share of R-row tiles, the tile loop pipelined S deep. chain_kernel: kernels_persistent_gemv's
chain (a layer's four products, L layers) in one launch, phases separated by grid_barrier (release add, volatile
polls, acquire add; it gives up after MAXP polls and says so).
"""

import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, o_ptr, n: tl.constexpr, block: tl.constexpr):
    offs = tl.program_id(0) * block + tl.arange(0, block)
    m = offs < n
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def grid_barrier(ctr_ptr, target, MAXP: tl.constexpr):
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
    seen = tl.load(ctr_ptr, volatile=True)
    polls = 0
    while (seen < target) & (polls < MAXP):
        seen = tl.load(ctr_ptr, volatile=True)
        polls += 1
    tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    return (seen < target).to(tl.int32)


@triton.jit
def phase(w_ptr, x_ptr, y_ptr, res_ptr, pid, N_OUT: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
          BK: tl.constexpr, P: tl.constexpr, S: tl.constexpr, EP: tl.constexpr):
    # EP 0: none, 1: + residual, 2: SwiGLU (rows n of gate, n + N_OUT of up)
    tiles = N_OUT // R
    start = pid * tiles // P
    stop = (pid + 1) * tiles // P
    r = tl.arange(0, R)
    ks = tl.arange(0, BK)
    for t in tl.range(start, stop, num_stages=S):
        rows = t * R + r
        acc = tl.zeros([R, BK], dtype=tl.float32)
        acc2 = tl.zeros([R, BK], dtype=tl.float32)
        for c in tl.static_range(K // BK):
            xc = tl.load(x_ptr + c * BK + ks).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * K + c * BK + ks[None, :], eviction_policy="evict_first")
            acc += w.to(tl.float32) * xc[None, :]
            if EP == 2:
                u = tl.load(w_ptr + (rows + N_OUT)[:, None] * K + c * BK + ks[None, :],
                            eviction_policy="evict_first")
                acc2 += u.to(tl.float32) * xc[None, :]
        y = tl.sum(acc, axis=1).to(tl.bfloat16)
        if EP == 1:
            y = (y.to(tl.float32) + tl.load(res_ptr + rows).to(tl.float32)).to(tl.bfloat16)
        if EP == 2:
            up = tl.sum(acc2, axis=1).to(tl.bfloat16)
            g = y.to(tl.float32)
            y = ((g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32) * up.to(tl.float32)).to(tl.bfloat16)
        tl.store(y_ptr + rows, y)


@triton.jit
def chain_kernel(x_ptr, w0, w1, w2, w3, s_ptr, q_ptr, a_ptr, h_ptr, ctr_ptr, err_ptr, L: tl.constexpr,
                 D: tl.constexpr, Q: tl.constexpr, I: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr,
                 R2: tl.constexpr, R3: tl.constexpr, BK: tl.constexpr, P: tl.constexpr, S: tl.constexpr,
                 BARRIERS: tl.constexpr, MAXP: tl.constexpr):
    pid = tl.program_id(0)
    err = pid * 0
    for l in range(L):
        if l == 0:
            inp = x_ptr
        else:
            inp = s_ptr + (l - 1) * D
        if BARRIERS:
            err |= grid_barrier(ctr_ptr, (4 * l + 1) * P, MAXP)
        phase(w0 + l * Q * D, inp, q_ptr + l * Q, inp, pid, Q, D, R0, BK, P, S, 0)
        if BARRIERS:
            err |= grid_barrier(ctr_ptr, (4 * l + 2) * P, MAXP)
        phase(w1 + l * D * Q, q_ptr + l * Q, a_ptr + l * D, inp, pid, D, Q, R1, BK, P, S, 1)
        if BARRIERS:
            err |= grid_barrier(ctr_ptr, (4 * l + 3) * P, MAXP)
        phase(w2 + l * 2 * I * D, a_ptr + l * D, h_ptr + l * I, inp, pid, I, D, R2, BK, P, S, 2)
        if BARRIERS:
            err |= grid_barrier(ctr_ptr, (4 * l + 4) * P, MAXP)
        phase(w3 + l * D * I, h_ptr + l * I, s_ptr + l * D, a_ptr + l * D, pid, D, I, R3, BK, P, S, 1)
    tl.store(err_ptr + pid, err)


@triton.jit
def stream_gemv(w_ptr, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
                P: tl.constexpr, S: tl.constexpr):
    """One GEMV as a persistent kernel: the chain's phase without an epilogue."""
    phase(w_ptr, x_ptr, y_ptr, x_ptr, tl.program_id(0), N, K, R, BK, P, S, 0)
