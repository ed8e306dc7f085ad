"""Does an INT8 V cache stored transposed within each page ([hd, page_size] a page) cut the int8 decode attention's
instructions, and its time?

The int8 split kernel (pallas/decode_attention.py) is bound by its instructions (Nsight Compute 2026-12-05: 4.05
cycles an issue against bf16's 14.4). Read offline, much of its loop is the V tile of p @ v: the MMA's B operand
wants consecutive positions of one head-dim column in a register, which in a [positions, hd] int8 page are bytes
hd apart (one LDS.U8 a byte, then byte packing). Stored [hd, positions] in each page they are adjacent.

This file holds only the variant kernel (the split kernel on an int8 cache, no window, V pages transposed) beside
the product's. It is not the product: the cache layout would change for every kernel that reads or writes V.

    PYTHONPATH=. python3 experiments/int8_v_transposed.py check          # interpret mode, against the product
    PYTHONPATH=. python3 experiments/int8_v_transposed.py sass           # offline: the loops' SASS (needs triton)
    PYTHONPATH=. python3 experiments/int8_v_transposed.py time [--ctx 32768 ...]   # GPU: both kernels' times
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.ops.quantized_cache import quantize
from jaxinfer.pallas import decode_attention as da
from jaxinfer.pallas.blocks import dot_precision, page_slots, pow2_at_least, resolve_int8_convert, split_range
from jaxinfer.pallas.tables import SplitConfig

f32 = jnp.float32


def transpose_pages(v: jax.Array, page_size: int) -> jax.Array:
    """[L, KVH, slots, hd] -> [L, KVH, pages, hd, page_size]."""
    L, K, S, hd = v.shape
    return v.reshape(L, K, S // page_size, page_size, hd).swapaxes(-1, -2)


def _kernel(layer_ref, pt_ref, cl_ref, q_ref, k_ref, vt_ref, ks_ref, vs_ref, o_ref, lse_ref, *, group, G, hd,
            page_size, n_pages, block_k, num_splits, qk_scale, int8_convert):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = plgpu.load(layer_ref.at[jnp.int32(0)])
    ctx = jnp.minimum(plgpu.load(cl_ref.at[b]), n_pages * page_size)
    rows = jnp.arange(G, dtype=jnp.int32)
    cols = jnp.arange(hd, dtype=jnp.int32)
    row_mask = rows < group
    q = plgpu.load(q_ref.at[b, h * group + rows[:, None], cols[None, :]], mask=row_mask[:, None], other=0)
    start, stop = split_range(pl.cdiv(ctx, block_k), s, num_splits)
    offs = jnp.arange(block_k, dtype=jnp.int32)
    cdt = jnp.float16
    q = q.astype(cdt)
    prec = dot_precision(cdt)

    def slots_of(i):
        return page_slots(pt_ref, b, i * block_k + offs, ctx, page_size, n_pages)

    def body(i, carry):
        acc, m, l, slot = carry
        valid = i * block_k + offs < ctx
        nxt = slots_of(i + 1)
        k = plgpu.load(k_ref.at[layer, h, slot[:, None], cols[None, :]], mask=valid[:, None], other=0)
        # the page of each position straight from the table (constant over page_size positions) and its offset
        # (contiguous over them), so that Triton can see page_size adjacent bytes a row
        npg = block_k // page_size
        pidx = i * npg + jnp.arange(npg, dtype=jnp.int32)
        page = plgpu.load(pt_ref.at[b, jnp.minimum(pidx, n_pages - 1)], mask=pidx * page_size < ctx, other=0)
        in_page = jnp.arange(page_size, dtype=jnp.int32)
        # unmasked: pages past the context read the scratch page 0 (finite int8), and every position past it has
        # p = 0 and a value scale of 0 below, so what they hold never counts
        vt = plgpu.load(vt_ref.at[layer, h, page[None, :, None], cols[:, None, None], in_page[None, None, :]]
                        ).reshape(hd, block_k)                                      # [hd, block_k]
        k, vt = da.int8_to(k, cdt, int8_convert), da.int8_to(vt, cdt, int8_convert)
        sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=f32)
        k_scale = plgpu.load(ks_ref.at[layer, h, slot], mask=valid, other=0.0)
        v_scale = plgpu.load(vs_ref.at[layer, h, slot], mask=valid, other=0.0)
        sc = jnp.where(valid[None, :], sc * (k_scale * qk_scale)[None, :], da.NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(sc - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v_max = jnp.max(v_scale)
        ratio = v_scale * (1.0 / jnp.where(v_max > 0, v_max, 1.0))
        pv = jax.lax.dot_general((p * ratio[None, :]).astype(cdt), vt, (((1,), (1,)), ((), ())), precision=prec,
                                 preferred_element_type=f32)
        return acc * alpha[:, None] + pv * v_max, m_new, l, nxt

    init = (jnp.zeros((G, hd), f32), jnp.full((G,), da.NEG, f32), jnp.zeros((G,), f32), slots_of(start))
    acc, m, l, _ = jax.lax.fori_loop(start, stop, body, init)
    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[:, None]
    plgpu.store(o_ref.at[b, h * group + rows[:, None], s, cols[None, :]], out, mask=row_mask[:, None])
    lse = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), da.NEG)
    plgpu.store(lse_ref.at[b, h * group + rows, s], lse, mask=row_mask)


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "config", "int8_convert", "interpret"))
def attention_vt(q, k_cache, vt_cache, layer, page_table, context_lens, k_scale, v_scale, *, page_size: int,
                 scale: float, config: SplitConfig, int8_convert: str = "prmt", interpret: bool = False):
    """paged_decode_attention on an int8 cache whose V pages are transposed (transpose_pages); at least 2 splits."""
    B, H, hd = q.shape
    KVH = k_cache.shape[1]
    group = H // KVH
    G = pow2_at_least(group, 16)
    S = config.num_splits
    kernel = functools.partial(_kernel, group=group, G=G, hd=hd, page_size=page_size, n_pages=page_table.shape[1],
                               block_k=config.block_k, num_splits=S, qk_scale=float(scale) * da.LOG2E,
                               int8_convert=resolve_int8_convert(int8_convert, interpret))
    o, lse = pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((B, H, S, hd), f32), jax.ShapeDtypeStruct((B, H, S), f32)),
        grid=(B, KVH, S), interpret=interpret, name="decode_attention_split_vt",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32), context_lens.astype(jnp.int32), q,
      k_cache, vt_cache, k_scale, v_scale)
    return da.merge_splits(o, lse, q.dtype, hd, config.merge, interpret, context_lens=context_lens,
                           block_k=config.block_k, max_ctx=page_table.shape[1] * page_size)


def product(q, k, v, layer, pt, cl, ks, vs, *, page_size, scale, config, int8_convert="prmt", interpret=False):
    return da.paged_decode_attention_split(q, k, v, layer, pt, cl, page_size, scale, num_splits=config.num_splits,
                                           block_k=config.block_k, num_warps=config.num_warps,
                                           num_stages=config.num_stages, k_scale=ks, v_scale=vs,
                                           int8_convert=int8_convert, interpret=interpret)


def operands(B, H, KVH, hd, ctx, page_size=16, L=2, seed=0):
    """Random q and an int8 cache holding ctx positions of each of B sequences, pages shuffled."""
    rng = np.random.default_rng(seed)
    P = -(-ctx // page_size)
    n_pages = B * P + 1
    kf = rng.standard_normal((L, KVH, n_pages * page_size, hd)).astype(np.float32)
    vf = rng.standard_normal((L, KVH, n_pages * page_size, hd)).astype(np.float32)
    k, ks = quantize(jnp.asarray(kf))
    v, vs = quantize(jnp.asarray(vf))
    pt = jnp.asarray(1 + rng.permutation(B * P).reshape(B, P), jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, H, hd)), jnp.bfloat16)
    cl = jnp.full((B,), ctx, jnp.int32)
    return q, k, v, jnp.int32(L - 1), pt, cl, ks, vs


def check() -> None:
    for B, H, KVH, hd, ctx, cfg in [(1, 8, 2, 64, 200, SplitConfig(4, 32)), (2, 32, 8, 128, 700, SplitConfig(8, 64)),
                                    (1, 16, 4, 128, 1000, SplitConfig(2, 128))]:
        q, k, v, layer, pt, cl, ks, vs = operands(B, H, KVH, hd, ctx)
        kw = dict(page_size=16, scale=hd ** -0.5, config=cfg, interpret=True)
        want = product(q, k, v, layer, pt, cl, ks, vs, **kw)
        got = attention_vt(q, k, transpose_pages(v, 16), layer, pt, cl, ks, vs, **kw)
        err = float(jnp.max(jnp.abs(got.astype(f32) - want.astype(f32))))
        print(f"B{B} H{H}/{KVH} hd{hd} ctx{ctx} {cfg.num_splits}x{cfg.block_k}: max |vt - product| {err:.2e}")
        assert err <= 1e-2, err


def sass(ctx: int, configs: list[SplitConfig]) -> None:
    sys.path.insert(0, "bench")
    from kernel_registers import assemble, triton_modules
    q, k, v, layer, pt, cl, ks, vs = operands(1, 32, 8, 128, ctx, L=1)
    for cfg in configs:
        for name, fn, args in [
                ("product", functools.partial(product, page_size=16, scale=0.088, config=cfg),
                 (q, k, v, layer, pt, cl, ks, vs)),
                ("v transposed", functools.partial(attention_vt, page_size=16, scale=0.088, config=cfg),
                 (q, k, transpose_pages(v, 16), layer, pt, cl, ks, vs))]:
            attrs, module = triton_modules(fn, args)[0]
            r = assemble(module, attrs["num_warps"], attrs["num_stages"], sass=True)
            loop = r["loop"]
            per_pos = loop["length"] * cfg.num_warps / cfg.block_k
            top = ", ".join(f"{op} {n}" for op, n in list(loop["ops"].items())[:8])
            print(f"{cfg.num_splits}x{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages} {name:13s}: regs {r['regs']}, "
                  f"smem {r['smem'] // 1024} KB, loop {loop['length']} ({per_pos:.1f} warp-instr a position); {top}")


def timed(fn, *args, iters=200) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e6


def time_on_gpu(ctxs: list[int], configs: list[SplitConfig]) -> None:
    """Each kernel (the merge included) chained 8 times in one jit so that dispatch does not hide it (as
    bench/kernels/fused_gemv.py chains its layers), us a call; the HBM share from the cache bytes read."""
    print("| ctx | config | product us | V transposed us | ratio | max abs diff |")
    print("|---|---|---|---|---|---|")
    for ctx in ctxs:
        q, k, v, layer, pt, cl, ks, vs = operands(1, 32, 8, 128, ctx, L=8)
        vt = transpose_pages(v, 16)
        for cfg in configs:
            kw = dict(page_size=16, scale=0.088, config=cfg)

            def chain(attn, vv):
                @jax.jit
                def run(q):
                    out = q
                    for i in range(8):
                        out = attn(out, k, vv, jnp.int32(i), pt, cl, ks, vs, **kw)
                    return out
                return run
            a, b = chain(product, v), chain(attention_vt, vt)
            want, got = a(q), b(q)
            diff = float(jnp.max(jnp.abs(want.astype(f32) - got.astype(f32))))
            ta, tb = timed(a, q) / 8, timed(b, q) / 8
            print(f"| {ctx} | {cfg.num_splits}x{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages} | {ta:.2f} | "
                  f"{tb:.2f} | {ta / tb:.3f}x | {diff:.1e} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("check", "sass", "time"))
    p.add_argument("--ctx", type=int, nargs="+", default=[32768])
    args = p.parse_args()
    configs = [SplitConfig(32, 128, num_stages=3), SplitConfig(32, 128, num_stages=2),
               SplitConfig(64, 64, num_stages=3), SplitConfig(32, 64, num_warps=2, num_stages=3)]
    if args.what == "check":
        check()
    elif args.what == "sass":
        sass(args.ctx[0], configs)
    else:
        time_on_gpu(args.ctx, configs)


if __name__ == "__main__":
    main()
