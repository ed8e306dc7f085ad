"""Paged prefill attention on the GPU: the flash-attention Pallas kernel against the XLA reference op.

    PYTHONPATH=. python3 bench/kernels/prefill_attention.py [--sweep] [--budget 240] [--interpret]

Default mode: for the Qwen3-4B shape (H 32, KVH 8, hd 128; Llama-3-8B has the same attention shape)
and Qwen3-0.6B (16/8/128), bf16, page size 16, pages in random order, cases:
  prompt 128, 1,024, 8,192 (one sequence from position 0);
  the last 2,048-token chunk of an 8,192 and of a 32,768 prompt (prefix 6,144 / 30,720 in pages);
  4 prompts of 1,024 in one call; a mixed call (chunks after prefixes, fresh prompts, ragged);
it times the configuration the table picks (prefill_attention.choose_config) and
reference.paged_attention, each inside one jit that chains n calls (the output is the next call's
query, the layer index walking over the cache's layers), many calls of that jit, best of 3. The first
call's output of each is checked against the reference's (relative Frobenius error < 2e-2) before it
counts. The per-call schedule (prefill_schedule, a few tiny XLA ops) is timed on its own too: inside
the chain XLA computes it once, in the model it runs once per layer unless hoisted or passed in.
FLOPs = 4 x sum over query rows of (visible keys = position + 1) x hd x H (q k^T and p v, causal, no
credit for masked work); TFLOP/s and the share of the dense bf16 GEMM rate (XLA, 8192^3) measured in
the same run, at the start and the end.

--sweep: first, at the Qwen3-4B shape, a sweep of PrefillConfigs at prompt 128, 1,024, 8,192, the 2,048
chunk after 6,144 and 4 x 1,024 (phase A: tile rows x heads per program x block_k; phase B: the best
three with other num_warps / num_stages and the natural schedule order), printing the best per case:
what fills tables.PREFILL_ATTENTION and its short/long crossover. Every config is checked against the
reference (a wrong block shape can compile, run and be silently wrong: ../shared/GPU_FACTS.md).
--fused: also the engine's op for a step that is one fresh prompt (reference.fresh_prompt_attention: its
K/V gathered back from the slots it wrote, then jax.nn.dot_product_attention(is_causal=True)) with
implementation "cudnn" (cuDNN's flash attention; GQA by head groups) and "xla", at the one-prompt cases
(prompt 128 / 1,024 / 8,192), checked against the paged reference: what fresh_prompt_attention would
replace the paged kernel with (issue 4: at 1k the kernel ran 2.2 of the 16.2 ms step at ~140 TFLOP/s);
and at the one-chunk cases (2,048 after 6,144 / 30,720) the op for a chunk after a cached prefix
(reference.prefixed_chunk_attention, what prefixed_chunk_attention would run).
JSON of everything to $OUT/prefill_attention.json when OUT is set.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import time
import warnings

import jax
import jax.numpy as jnp

from bench.ceilings import dense_gemm_rate
from bench.kernels.kernel_timing import (add_sweep_args, build_chain, log, rel_err, save_results, sweep_and_table_between_ceilings, time_chain)
import numpy as np

from jaxinfer.ops import reference
from jaxinfer.pallas import prefill_attention as PA

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
PS = 16
SHAPES = [("Qwen3-4B/Llama-3-8B", 32, 8, 128), ("Qwen3-0.6B", 16, 8, 128)]
CASES = [
    ("prompt 128", [(0, 128)]),
    ("prompt 256", [(0, 256)]),
    ("prompt 512", [(0, 512)]),
    ("prompt 1024", [(0, 1024)]),
    ("prompt 8192", [(0, 8192)]),
    ("chunk 1024 @ 1024", [(1024, 1024)]),
    ("chunk 1024 @ 2048", [(2048, 1024)]),
    ("chunk 2048 @ 2048", [(2048, 2048)]),
    ("chunk 2048 @ 6144", [(6144, 2048)]),
    ("chunk 2048 @ 30720", [(30720, 2048)]),
    ("4 x prompt 1024", [(0, 1024)] * 4),
    ("mixed", [(0, 1000), (5000, 512), (300, 77), (0, 129), (12000, 256), (7, 1)]),
]
SWEEP_CASES = ["prompt 128", "prompt 1024", "prompt 8192", "chunk 2048 @ 6144", "4 x prompt 1024"]
TOL = 2e-2
INTERPRET = False


@dataclasses.dataclass
class Problem:
    case: str
    H: int
    KVH: int
    hd: int
    seqs: list
    L: int
    flops: float
    args: tuple  # q, k, v, page_table, query_start, token_seq, positions

    @property
    def T(self):
        return self.args[0].shape[0]


def make_problem(case, seqs, H, KVH, hd, seed=0):
    B = len(seqs)
    P = max(-(-(a + n) // PS) for a, n in seqs)
    n_pages = B * P + 1
    per_layer = n_pages * PS * KVH * hd * 2 * 2
    L = 1 if INTERPRET else int(min(4, max(1, 2e9 // per_layer)))
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (L, KVH, n_pages * PS, hd)
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    pt = jax.random.permutation(kp, jnp.arange(1, n_pages, dtype=jnp.int32))[: B * P].reshape(B, P)
    T = sum(n for _, n in seqs)
    q = jax.random.normal(kq, (T, H, hd), jnp.bfloat16)
    pos = np.concatenate([np.arange(a, a + n) for a, n in seqs]).astype(np.int32)
    ts = np.concatenate([np.full(n, b) for b, (_, n) in enumerate(seqs)]).astype(np.int32)
    qs = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    flops = 4.0 * float(np.sum(pos.astype(np.float64) + 1)) * hd * H
    args = (q, k, v, pt, jnp.asarray(qs), jnp.asarray(ts), jnp.asarray(pos))
    jax.block_until_ready(args)
    return Problem(case, H, KVH, hd, seqs, L, flops, args)


def n_chain(est_s):
    return int(min(16, max(2, round(20e-3 / max(est_s, 1e-6)))))


def est_time(p: Problem, rate=300e12):
    return max(10e-6, p.flops / rate)


def kernel_op(cfg):
    def op(q, k, v, layer, pt, qs, ts, pos, scale):
        return PA.paged_prefill_attention(q, k, v, layer, pt, qs, pos, PS, scale, config=cfg, interpret=INTERPRET)
    return op


def reference_op(q, k, v, layer, pt, qs, ts, pos, scale):
    return reference.paged_attention(q, k, v, layer, pt, ts, pos, PS, scale)


def build(op, p: Problem, n):
    scale = p.hd ** -0.5
    return build_chain(lambda q, k, v, pt, qs, ts, pos, layer: op(q, k, v, layer, pt, qs, ts, pos, scale), p.args, n,
                       p.L)


def time_compiled(compiled, p: Problem, n, target_s=0.05):
    return time_chain(compiled, p.args, n, target_s, max_calls=20)


def time_schedule(p: Problem, cfg: PA.PrefillConfig, calls=200):
    q, _, _, _, qs, _, pos = p.args
    f = jax.jit(lambda qs, pos: PA.prefill_schedule(qs, pos, q.shape[0], cfg.block_q, cfg.order))
    f(qs, pos).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = f(qs, pos)
        r.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def cfg_str(c: PA.PrefillConfig):
    return (f"q{c.block_q}/k{c.block_k}/h{c.heads}/w{c.num_warps}/s{c.num_stages}"
            + ("/nat" if c.order == "natural" else ""))


def run_configs(p: Problem, cfgs, ref_out, pool, deadline):
    n = n_chain(est_time(p))
    futs = {pool.submit(build, kernel_op(c), p, n): c for c in cfgs}
    # Every compile finishes before anything is timed: lowering holds the GIL, and timing while other
    # configs compiled starved the dispatch thread (the decode sweep saw some configs 3-40x slow).
    cf.wait(futs)
    rows = []
    for fut, c in futs.items():
        row = {"cfg": dataclasses.asdict(c)}
        try:
            compiled = fut.result()
            if time.time() > deadline:
                row.update(ok=False, error="skipped: out of time budget")
            else:
                t, first = time_compiled(compiled, p, n)
                err = rel_err(first, ref_out)
                row.update(ms=t * 1e3, tflops=p.flops / t / 1e12, err=err, ok=err < TOL)
        except Exception as e:  # noqa: BLE001 - a config that fails (e.g. out of shared memory) is a result
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        rows.append(row)
    return rows


def time_reference(p: Problem):
    n = 2
    compiled = build(reference_op, p, n)
    return time_compiled(compiled, p, n, target_s=0.02)


def phase_a(p: Problem):
    """Tile rows (block_q x heads per program) x heads per program (whole group / one) x block_k, with
    4 warps up to 64 rows and 8 above. An offline compile for sm_90a (Triton 3.9, 2026-11-29) found
    256-row tiles spilling at any warp count and 128-row tiles spilling with 4 warps: not swept."""
    group = p.H // p.KVH
    cfgs = []
    for rows in (16, 32, 64, 128):
        for heads in ((0, 1) if group > 1 else (0,)):
            for bk in (32, 64, 128):
                if rows * bk > 128 * 128:
                    continue
                base = PA.PrefillConfig(block_k=bk, heads=heads, num_warps=4 if rows <= 64 else 8, num_stages=2)
                cfgs.append(PA.config_for_rows(base, rows, p.T, group, p.hd))
    return list(dict.fromkeys(cfgs))


def phase_b(best):
    cfgs = []
    for c in best:
        for w in (4, 8):
            for st in (1, 2, 3, 4):
                if (w, st) != (c.num_warps, c.num_stages):
                    cfgs.append(dataclasses.replace(c, num_warps=w, num_stages=st))
        cfgs.append(dataclasses.replace(c, order="natural"))
    return list(dict.fromkeys(cfgs))


def sweep(results, pool, deadline, t_start):
    _, H, KVH, hd = SHAPES[0]
    cases = [(c, s) for c, s in CASES if c in SWEEP_CASES]
    out = []
    for i, (case, seqs) in enumerate(cases):
        if time.time() > deadline:
            log(f"sweep: out of budget before {case}")
            break
        p = make_problem(case, seqs, H, KVH, hd, seed=i)
        t_ref, ref_out = time_reference(p)
        share = (deadline - time.time()) / (len(cases) - i)
        rows = run_configs(p, phase_a(p), ref_out, pool, time.time() + 0.6 * share)
        good = sorted((r for r in rows if r["ok"]), key=lambda r: r["ms"])
        top = [PA.PrefillConfig(**r["cfg"]) for r in good[:3]]
        rows += run_configs(p, phase_b(top), ref_out, pool, time.time() + 0.4 * share)
        good = sorted((r for r in rows if r["ok"]), key=lambda r: r["ms"])
        for r in rows:
            if not r["ok"] and "skipped" not in r.get("error", ""):
                why = r.get("error") or f"err {r['err']:.2e}"
                log(f"   FAILED {cfg_str(PA.PrefillConfig(**r['cfg']))}: {why}")
        out.append({"case": case, "T": p.T, "flops": p.flops, "ref_ms": t_ref * 1e3, "configs": rows,
                    "best": good[0] if good else None})
        msg = "; ".join(f"{cfg_str(PA.PrefillConfig(**r['cfg']))} {r['ms']:.3f}" for r in good[:6])
        log(f"[{time.time() - t_start:6.1f}s] sweep {case}: ref {t_ref * 1e3:.3f} ms; {len(good)}/{len(rows)} ok; "
            f"best {msg}")
        del p
    results["sweep"] = out


def table_mode(results, pool, t_start):
    """The table's choice and the reference at every (shape, case): compile all, then time."""
    jobs = []
    for name, H, KVH, hd in SHAPES:
        for i, (case, seqs) in enumerate(CASES):
            p = make_problem(case, seqs, H, KVH, hd, seed=100 + i)
            cfg = PA.choose_config(p.T, H, KVH, hd)
            n = n_chain(est_time(p))
            jobs.append((name, p, cfg, n, pool.submit(build, kernel_op(cfg), p, n),
                         pool.submit(build, reference_op, p, 2)))
    cf.wait([f for j in jobs for f in j[4:]])
    log(f"[{time.time() - t_start:6.1f}s] table mode: {len(jobs)} points compiled")
    for name, p, cfg, n, fut, fut_ref in jobs:
        row = {"model": name, "H": p.H, "KVH": p.KVH, "hd": p.hd, "case": p.case, "seqs": p.seqs, "T": p.T,
               "flops": p.flops, "cfg": dataclasses.asdict(cfg)}
        try:
            t_ref, ref_out = time_compiled(fut_ref.result(), p, 2, target_s=0.02)
            row["ref_ms"] = t_ref * 1e3
            t, first = time_compiled(fut.result(), p, n)
            err = rel_err(first, ref_out)
            row.update(ms=t * 1e3, tflops=p.flops / t / 1e12, err=err, ok=err < TOL,
                       sched_us=time_schedule(p, cfg) * 1e6)
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        results["rows"].append(row)
        log(f"[{time.time() - t_start:6.1f}s] {name} {p.case} T={p.T} {cfg_str(cfg)}: "
            f"{row.get('ms', float('nan')):.3f} ms {row.get('tflops', float('nan')):.1f} TFLOP/s "
            f"(err {row.get('err', float('nan')):.1e}), ref {row.get('ref_ms', float('nan')):.3f} ms "
            f"{row.get('error', '')}")
    jobs.clear()


def fresh_op(implementation):
    """The engine's op for a step that is one fresh prompt (ops.fresh_prompt_attention) with a float8 cache:
    its K/V gathered back from the slots it wrote, then jax.nn.dot_product_attention (a 16-bit cache's
    engine step takes them from the write instead: the gather is the difference)."""
    def op(q, k, v, layer, pt, qs, ts, pos, scale):
        slots = pt[0, pos // PS] * PS + pos % PS
        return reference.fresh_prompt_attention(q, *reference.gather_kv(k, v, layer, slots, q.dtype), scale,
                                                implementation=implementation)
    return op


SPAN = 40960   # the engine's page row spans max_model_len (the server's default for Qwen3: 40,960 tokens)


def prefixed_op(implementation):
    """The engine's op for a step that is one sequence's chunk after its cached prefix
    (ops.prefixed_chunk_attention): the prefix gathered over a page row padded to SPAN tokens (scratch page
    0 past the sequence's pages, as in the engine), two attentions merged by their log-sum-exps."""
    def op(q, k, v, layer, pt, qs, ts, pos, scale):
        row = jnp.zeros(max(SPAN // PS, pt.shape[1]), jnp.int32).at[:pt.shape[1]].set(pt[0])
        slots = pt[0, pos // PS] * PS + pos % PS
        return reference.prefixed_chunk_attention(q, k, v, layer, row, pos[0], slots, PS, scale,
                                                  implementation=implementation)
    return op


def fused_rows(results, t_start, implementations=("cudnn", "xla")):
    """The engine's ops for a step that is one sequence's prompt, per implementation: from position 0 the
    fresh-prompt op, after a prefix the prefixed-chunk op; ms, TFLOP/s, and the error against the paged
    reference on the same problem."""
    for name, H, KVH, hd in SHAPES:
        for i, (case, seqs) in enumerate(CASES):
            if len(seqs) != 1:
                continue
            p = make_problem(case, seqs, H, KVH, hd, seed=100 + i)
            _, ref_out = time_reference(p)
            for impl in implementations:
                if seqs[0][0] and impl == "xla" and not INTERPRET:
                    continue   # XLA's dense scores over the whole span: too slow to be a candidate
                row = {"model": name, "case": case, "T": p.T, "implementation": impl, "flops": p.flops}
                try:
                    n = n_chain(est_time(p))
                    op = fresh_op(impl) if seqs[0][0] == 0 else prefixed_op(impl)
                    t, first = time_compiled(build(op, p, n), p, n)
                    err = rel_err(first, ref_out)
                    row.update(ms=t * 1e3, tflops=p.flops / t / 1e12, err=err, ok=err < TOL)
                except Exception as e:  # noqa: BLE001  (cuDNN missing, or a shape it refuses)
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                results.setdefault("fused", []).append(row)
                log(f"[{time.time() - t_start:6.1f}s] one-sequence op {name} {case} {impl}: " +
                    (f"{row['ms']:.3f} ms {row['tflops']:.1f} TFLOP/s (err {row['err']:.1e})" if "ms" in row
                     else f"FAILED {row['error']}"))


def main():
    ap = argparse.ArgumentParser()
    add_sweep_args(ap, budget=240.0)
    ap.add_argument("--fused", action="store_true",
                    help="also the engine's one-sequence ops (fresh prompt, chunk after a prefix) on cuDNN and XLA")
    args = ap.parse_args()
    global INTERPRET, SHAPES, CASES, SWEEP_CASES
    INTERPRET = args.interpret
    if INTERPRET:
        SHAPES = [("tiny", 4, 2, 32)]
        CASES = [("prompt 40", [(0, 40)]), ("chunk 24 @ 50", [(50, 24)]), ("mixed", [(0, 20), (33, 7), (5, 1)])]
        SWEEP_CASES = ["prompt 40"]
    gemm_n = 512 if INTERPRET else 8192
    results, g0, g1, t_start = sweep_and_table_between_ceilings(
        args, sweep, table_mode, lambda: dense_gemm_rate(gemm_n), "gemm_tflops", 1e12, "dense bf16 GEMM TFLOP/s")
    dev = jax.devices()[0]
    g = max(g0, g1)

    print(f"\nPaged prefill attention, bf16, page 16, on {dev.device_kind}, jax {jax.__version__}; dense bf16 GEMM "
          f"{g0 / 1e12:.0f} / {g1 / 1e12:.0f} TFLOP/s (start / end), shares against the larger")
    hdr = (f"{'shape (H/KVH/hd)':>28} {'case':>20} {'T':>5} {'config':>20} {'ms':>8} {'TFLOP/s':>7} {'share':>5} "
           f"{'ref ms':>8} {'speedup':>7} {'sched us':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in results["rows"]:
        shape = f"{r['model']} {r['H']}/{r['KVH']}/{r['hd']}"
        cfg = cfg_str(PA.PrefillConfig(**r["cfg"]))
        if r.get("ok"):
            print(f"{shape:>28} {r['case']:>20} {r['T']:>5} {cfg:>20} {r['ms']:8.3f} {r['tflops']:7.1f} "
                  f"{r['tflops'] * 1e12 / g:5.0%} {r['ref_ms']:8.3f} {r['ref_ms'] / r['ms']:6.1f}x {r['sched_us']:8.1f}")
        else:
            print(f"{shape:>28} {r['case']:>20} {r['T']:>5} {cfg:>20} FAILED {r.get('error') or r.get('err')}")
    if args.sweep:
        print(f"\nsweep ({SHAPES[0][0]}): best config per case")
        for e in results.get("sweep", []):
            b = e["best"]
            if b:
                tf = e["flops"] / (b["ms"] * 1e-3) / 1e12
                print(f"  {e['case']:>20}: {cfg_str(PA.PrefillConfig(**b['cfg'])):>20} {b['ms']:8.3f} ms "
                      f"{tf:6.1f} TFLOP/s {tf * 1e12 / g:5.0%}  (ref {e['ref_ms']:.3f} ms)")
    if args.fused:
        fused_rows(results, t_start, ("xla",) if INTERPRET else ("cudnn", "xla"))
        print("\nThe one-sequence ops: a fresh prompt (K/V gathered from its slots, jax.nn.dot_product_attention, "
              f"causal); a chunk after a prefix (prefix gathered over a {SPAN:,}-token page row + the chunk, two "
              "attentions merged by log-sum-exp), against the paged kernel above")
        for r in results["fused"]:
            print(f"  {r['model']:>28} {r['case']:>16} {r['implementation']:>6}: " +
                  (f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s {r['tflops'] * 1e12 / g:5.0%} (err {r['err']:.1e})"
                   if r.get("ok") else f"FAILED {r.get('error') or r.get('err')}"))
    print(f"total {time.time() - t_start:.0f} s")
    save_results(results, "prefill_attention.json")


if __name__ == "__main__":
    main()
