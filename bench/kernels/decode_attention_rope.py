"""The engine's decode attention kernel (RoPE, norm and cache write fused: pallas/decode_attention_rope.py) by
split configuration, at the batches and contexts of a batched decode step.

    PYTHONPATH=. python3 bench/kernels/decode_attention_rope.py [--points 1:1024 8:1024 ...] [--budget 300]
                                                               [--splits 32 48 64] [--block-k 64 128]

bench/kernels/decode_attention.py sweeps the plain split kernel, which the engine no longer runs in a decode
step (batch 8's best plain config did not move the step). This sweeps the kernel the step
runs, merge included. Qwen3-4B's attention shape (H 32, KVH 8, hd 128, Qwen3's q/k norm and RoPE), bf16, page
size 16, pages in random order. Each config runs inside one jit as a chain of calls that thread the caches
(aliased, donated: the calls run one after another, as the layers do), over enough layers that the KV read is
not served from L2; best of 3 timed runs of ~0.1 s. Each config's first output is checked against the
reference twin (reference.decode_qkv_attention) before it counts. Prints per point the table's choice
(choose_config at the engine's span: 1.5x the context, as the benches' page tables) and the best configs,
with the share of the HBM read ceiling (the KV bytes the batch must read / time). JSON to $OUT.

--kv-cache-dtype int8: the caches as `--kv-cache-dtype int8` stores them (int8 values, a float32 scale a vector: the
bytes counted at 1 a value + 4 a vector), the reference twin on the same QuantizedCache; --int8-convert
(blocks.INT8_CONVERTS) the kernel's int8 conversion (default tables.DECODE_ATTENTION_INT8_CONVERT). The table's choice
is the 1-byte pages' one.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import hbm_read_ceiling
from bench.kernels.kernel_timing import log, rel_err, save_results
from jaxinfer.ops import reference
from jaxinfer.ops.quantized_cache import QuantizedCache, quantize
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas.blocks import INT8_CONVERTS
from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
H, K, HD, PS = 32, 8, 128, 16
L2_BYTES = 50e6
TOL = 2e-2
POINTS = ["1:1024", "4:1024", "8:1024", "8:2048", "16:1024", "32:1024"]
INT8 = False          # --kv-cache-dtype int8
INT8_CONVERT = None   # --int8-convert
VECTOR_BYTES = HD * 2   # a cached vector's bytes (int8: HD + 4)


@dataclasses.dataclass
class Problem:
    B: int
    ctx: int
    L: int
    qkv: jax.Array        # [L, B, (H + 2K) * hd]: one projection per layer
    cos: jax.Array
    sin: jax.Array
    qn: jax.Array
    kn: jax.Array
    k: jax.Array          # the caches (QuantizedCaches with int8): each config's timing donates a device copy of them
    v: jax.Array
    slots: jax.Array
    pt: jax.Array
    cl: jax.Array

    @property
    def kv_bytes(self) -> int:
        return self.B * self.ctx * K * 2 * VECTOR_BYTES


def make_problem(B: int, ctx: int, seed: int, interpret: bool) -> Problem:
    rng = np.random.default_rng(seed)
    P = -(-ctx // PS) + 1
    per_layer = B * ctx * K * 2 * VECTOR_BYTES
    L = 1 if interpret else int(min(16, max(2, math.ceil(4 * L2_BYTES / per_layer))))
    n_pages = B * P + 1
    shape = (L, K, n_pages * PS, HD)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    if INT8:
        k, v = QuantizedCache(*jax.jit(quantize)(k)), QuantizedCache(*jax.jit(quantize)(v))
    qkv = jnp.asarray(rng.standard_normal((L, B, (H + 2 * K) * HD), np.float32), jnp.bfloat16)
    pages = rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32)
    pos = np.full((B,), ctx - 1, np.int32)
    slots = pages[np.arange(B), pos // PS] * PS + pos % PS
    inv_freq = 1.0 / (1e6 ** (np.arange(0, HD, 2, dtype=np.float32) / HD))
    cos, sin = reference.rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq), jnp.bfloat16)
    qn = jnp.asarray(1 + 0.1 * rng.standard_normal((L, HD), np.float32), jnp.bfloat16)
    kn = jnp.asarray(1 + 0.1 * rng.standard_normal((L, HD), np.float32), jnp.bfloat16)
    return Problem(B, ctx, L, qkv, cos, sin, qn, kn, k, v, jnp.asarray(slots), jnp.asarray(pages),
                   jnp.asarray(pos + 1))


def reference_out(p: Problem) -> jax.Array:
    """Layer 0's output by the reference twin."""
    return reference.decode_qkv_attention(p.qkv[0], (p.cos, p.sin), p.qn[0], p.kn[0], 1e-6, p.k,
                                          p.v, jnp.int32(0), p.slots, p.pt, p.cl, PS, HD ** -0.5,
                                          H, K)[0]


def build(p: Problem, cfg: DA.SplitConfig, n: int, interpret: bool):
    """A jit of n calls over the layers in turn, threading the (donated) caches; returns (k, v, first output)."""

    def chain(k, v, qkv, cos, sin, qn, kn, slots, pt, cl):
        first = None
        for i in range(n):
            kw = dict(page_size=PS, scale=HD ** -0.5, num_heads=H, num_kv_heads=K, eps=1e-6, config=cfg,
                      interpret=interpret)
            if isinstance(k, QuantizedCache):
                out, kv, vv, ks, vs = decode_attention_rope_write(
                    qkv[i % p.L], cos, sin, qn, kn, k.values, v.values, jnp.int32(i % p.L), slots, pt, cl,
                    k_scale=k.scale, v_scale=v.scale, int8_convert=INT8_CONVERT, **kw)
                k, v = QuantizedCache(kv, ks), QuantizedCache(vv, vs)
            else:
                out, k, v = decode_attention_rope_write(qkv[i % p.L], cos, sin, qn, kn, k, v, jnp.int32(i % p.L),
                                                        slots, pt, cl, **kw)
            first = out if first is None else first
        return k, v, first

    caches = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), c) for c in (p.k, p.v)]
    args = (*caches, p.qkv, p.cos, p.sin, p.qn, p.kn, p.slots, p.pt, p.cl)
    return jax.jit(chain, donate_argnums=(0, 1)).lower(*args).compile()


def time_config(compiled, p: Problem, n: int, target_s: float) -> tuple[float, jax.Array]:
    """(best seconds per call, the first call's output)."""
    k, v = jax.tree.map(jnp.copy, p.k), jax.tree.map(jnp.copy, p.v)   # donated below
    rest = (p.qkv, p.cos, p.sin, p.qn, p.kn, p.slots, p.pt, p.cl)
    k, v, first = compiled(k, v, *rest)
    jax.block_until_ready(first)
    t0 = time.perf_counter()
    k, v, _ = compiled(k, v, *rest)
    jax.block_until_ready(k)
    reps = max(2, int(target_s / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            k, v, out = compiled(k, v, *rest)
        jax.block_until_ready((k, v, out))
        best = min(best, (time.perf_counter() - t0) / (reps * n))
    return best, first


SPLITS = (1, 2, 4, 8, 16, 32, 64)   # --splits
BLOCK_KS = (32, 64, 128)          # --block-k


def candidates(p: Problem) -> list[DA.SplitConfig]:
    cfgs = []
    for bk in BLOCK_KS:
        blocks = -(-p.ctx // bk)
        for s in SPLITS:
            if s <= blocks:
                cfgs.append(DA.SplitConfig(num_splits=s, block_k=bk))
    return cfgs


def variants(top: list[DA.SplitConfig]) -> list[DA.SplitConfig]:
    """Warps and pipeline stages around the first pass's best splits: the best's in full, the next two's deeper
    pipelines (a 1-byte cache stage holds half a bf16 one's bytes, so more stages may pay; 2026-12-03 at 32k: the
    int8 best 32x128 took 35.3 us at 2 stages and 30.5 at 3)."""
    cfgs = [dataclasses.replace(top[0], num_warps=w, num_stages=st)
            for w, st in ((2, 2), (8, 2), (4, 1), (4, 3), (4, 4), (8, 3), (4, 2))]
    cfgs += [dataclasses.replace(c, num_warps=4, num_stages=st) for c in top[1:3] for st in (3, 4)]
    return list(dict.fromkeys(cfgs))


def cfg_str(c: DA.SplitConfig) -> str:
    return f"{c.num_splits}x{c.block_k}/w{c.num_warps}/s{c.num_stages}"


def run(p: Problem, cfgs, ref, n: int, pool, interpret: bool, target_s: float) -> list[dict]:
    futs = {pool.submit(build, p, c, n, interpret): c for c in cfgs}
    cf.wait(futs)   # compile all before timing any (lowering holds the GIL)
    rows = []
    for fut, c in futs.items():
        row = {"cfg": dataclasses.asdict(c)}
        try:
            t, first = time_config(fut.result(), p, n, target_s)
            err = rel_err(first, ref)
            row.update(us=t * 1e6, err=err, ok=err < TOL)
        except Exception as e:  # noqa: BLE001 - a config that fails is a result too
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
    return rows


def main() -> None:
    global INT8, INT8_CONVERT, VECTOR_BYTES, SPLITS, BLOCK_KS
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="*", default=POINTS, help="B:ctx (ctx counts the new token)")
    ap.add_argument("--budget", type=float, default=400, help="seconds; points past it are skipped")
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (tiny: one point, few configs)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--int8-convert", default=None, choices=INT8_CONVERTS)
    ap.add_argument("--splits", type=int, nargs="+", default=SPLITS,
                    help="split counts to sweep (powers of two: the merge's tile)")
    ap.add_argument("--block-k", type=int, nargs="+", default=BLOCK_KS, help="positions a block to sweep")
    args = ap.parse_args()
    if any(n < 1 or n & (n - 1) for n in [*args.splits, *args.block_k]):
        ap.error(f"--splits {args.splits} and --block-k {args.block_k} must be powers of two")
    INT8, INT8_CONVERT = args.kv_cache_dtype == "int8", args.int8_convert
    SPLITS, BLOCK_KS = tuple(args.splits), tuple(args.block_k)
    VECTOR_BYTES = HD + 4 if INT8 else HD * 2
    t_start = time.time()
    ip = args.interpret
    ceiling = None if ip else hbm_read_ceiling()
    if ceiling:
        log(f"# HBM read ceiling {ceiling / 1e12:.2f} TB/s")
    results = {"ceiling": ceiling, "points": []}
    table = []
    with cf.ThreadPoolExecutor(8) as pool:
        for i, point in enumerate(args.points):
            if time.time() - t_start > args.budget:
                log(f"# out of budget before {point}")
                break
            B, ctx = map(int, point.split(":"))
            p = make_problem(B, ctx, seed=i, interpret=ip)
            ref = reference_out(p)
            n = 2 if ip else int(min(32, max(8, round(400e-6 / max(p.kv_bytes / 3.5e12, 4e-6)))))
            engine = DA.choose_config(B, K, int(1.5 * ctx) // PS * PS, 1 if INT8 else 2, INT8)
            cfgs = candidates(p)[:3] if ip else candidates(p)
            cfgs = list(dict.fromkeys([engine] + cfgs))
            target = 0.0 if ip else 0.1
            rows = run(p, cfgs, ref, n, pool, ip, target)
            good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
            if good and not ip:
                more = [c for c in variants([DA.SplitConfig(**r["cfg"]) for r in good[:3]]) if c not in cfgs]
                rows += run(p, more, ref, n, pool, ip, target)
                good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
            for r in rows:
                if not r["ok"]:
                    log(f"   FAILED {cfg_str(DA.SplitConfig(**r['cfg']))}: {r.get('error') or 'err %.2e' % r['err']}")
            eng = next((r for r in rows if DA.SplitConfig(**r["cfg"]) == engine and r["ok"]), None)
            results["points"].append({"B": B, "ctx": ctx, "L": p.L, "calls": n, "kv_bytes": p.kv_bytes,
                                      "engine": dataclasses.asdict(engine), "rows": rows})
            log(f"[{time.time() - t_start:6.1f}s] B={B} ctx={ctx}: engine {cfg_str(engine)} "
                f"{eng['us'] if eng else float('nan'):.2f} us; best "
                + "; ".join(f"{cfg_str(DA.SplitConfig(**r['cfg']))} {r['us']:.2f}" for r in good[:5]))

            def share(us, kv_bytes=p.kv_bytes):
                return f"{kv_bytes / (us * 1e-6) / ceiling:.1%}" if ceiling and us else "-"

            if good:
                table.append(f"| {B} | {ctx:,} | {cfg_str(engine)} | {eng['us'] if eng else float('nan'):.2f} | "
                             f"{share(eng['us'] if eng else None)} | {cfg_str(DA.SplitConfig(**good[0]['cfg']))} | "
                             f"{good[0]['us']:.2f} | {share(good[0]['us'])} | {good[0]['err']:.1e} |")
    save_results(results, "decode_attention_rope.json")
    kv = f"int8 cache ({INT8_CONVERT or DA.tables.DECODE_ATTENTION_INT8_CONVERT})" if INT8 else "bf16 cache"
    print(f"\nQwen3-4B attention (H 32, KVH 8, hd 128), bf16, {kv}, RoPE + q/k norm + cache write fused, merge included"
          + (f"; HBM read ceiling {ceiling / 1e12:.2f} TB/s" if ceiling else ""))
    print("| batch | context | engine's config | us | share | best config | us | share | rel. err |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()
