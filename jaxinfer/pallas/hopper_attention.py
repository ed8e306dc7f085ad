"""Causal flash attention of one fresh prompt on Hopper tensor cores through Mosaic GPU (wgmma + TMA).

`fresh_prompt_flash(q [T, H, hd], k, v [T, KVH, hd], scale) -> [T, H, hd]`: the op
`fresh_prompt_attention` (reference.fresh_prompt_attention: a prompt at positions 0..T-1 attending to
itself, GQA) for bf16/f16 prompts whose length tiles by the CTA's rows. It exists for the 1k prompt step,
where cuDNN's flash attention took 31.5 us a layer plus ~6 us of idle before it for its 4-byte memset,
against ~11 us of tensor-core work.

A work item is 2 x block_q consecutive rows of one query head: two compute warpgroups of block_q rows each.
The grid is persistent (one CTA an SM; FlashConfig.persistent) and deals the items, heaviest first (the last
query tiles see the most keys), to the CTAs back and forth. A CTA's memory warpgroup streams each item's Q and
its KV head's K and V blocks (block_kv = 2 x block_q keys, so both warpgroups see the same number of blocks:
the diagonal block is an item's last, and only it is masked) through a `stages`-deep shared-memory ring by
TMA, one stream across the CTA's items, so the next item's loads overlap the last one's end. A step: S = Q K^T
by wgmma into a float32 accumulator (the two warpgroups taking turns on the tensor cores), scaled (log2 e
folded in), the online softmax in registers (base 2), P rounded to the input dtype and through shared memory
into acc += P V by wgmma. The output is acc / l rounded to the input dtype, stored by TMA from shared memory.
Options measured against each other in bench/kernels/hopper_attention.py (FlashConfig): ping-pong, the
persistent grid, two Q buffers. (FA3's intra-warpgroup overlap in place of ping-pong ran 50% slower at 1k-8k.)

Interpret mode (`interpret=True`, Mosaic GPU's) runs it on the CPU for tests, warpgroups as threads with
barriers checked phase by phase (it found a deadlock); it cannot show every race: tests/gpu has the kernel
on the H200.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxinfer.pallas import tables
from jaxinfer.pallas.blocks import run_mosaic
from jaxinfer.pallas.hopper_gemm import num_sms
from jaxinfer.pallas.tables import FlashConfig

f32 = jnp.float32
LOG2E = math.log2(math.e)


def table_config(q: jax.ShapeDtypeStruct | jax.Array, k: jax.ShapeDtypeStruct | jax.Array) -> FlashConfig | None:
    """The measured config for this prompt's length, or None where cuDNN's flash attention is the faster."""
    T = q.shape[0]
    for first, last, config in tables.FRESH_PROMPT_FLASH:
        if first <= T <= last and supported(q, k, config):
            return config
    return None


SMEM_BYTES = 227 * 1024 - 1024     # an H200 CTA's shared memory, less room for the barriers


def smem_bytes(hd: int, config: FlashConfig, itemsize: int = 2) -> int:
    """Shared memory of the kernel's buffers: Q and the output (a block_q x hd tile a warpgroup each), P (block_q x
    block_kv a warpgroup) and the K/V ring."""
    bq, bkv = config.block_q, config.block_kv
    return itemsize * (2 * (config.q_buffers + 1) * bq * hd + 2 * bq * bkv + 2 * config.stages * bkv * hd)


def supported(q: jax.ShapeDtypeStruct | jax.Array, k: jax.ShapeDtypeStruct | jax.Array,
              config: FlashConfig = FlashConfig()) -> bool:
    """Shapes and dtypes the kernel takes: 16-bit, the head dim a multiple of 64 (128-byte swizzled rows) whose
    buffers fit the shared memory (hd 64 and 128), the prompt a multiple of the CTA's rows, whole GQA groups."""
    T, H, hd = q.shape
    Tk, KVH, hdk = k.shape
    return (q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and T == Tk and hd == hdk
            and hd % 64 == 0 and H % KVH == 0 and config.block_q % 64 == 0 and T % config.block_kv == 0
            and config.stages >= 1 and config.q_buffers in (1, 2)
            and smem_bytes(hd, config) <= SMEM_BYTES)


def _kernel(q_ref, k_ref, v_ref, out_ref, q_smem2, o_smem2, p_smem2, k_smem, v_smem, q_bar, q_free, k_bar, v_bar,
            k_free, v_free, turn, *, config: FlashConfig, scale: float, group: int, ctas: int):
    bq, bkv, stages, nq = config.block_q, config.block_kv, config.stages, config.q_buffers
    T, H, hd = q_ref.shape
    dtype = q_ref.dtype
    n_tiles = T // bkv
    n_items = H * n_tiles
    rounds = -(-n_items // ctas)
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")

    def item_of(r):
        """The CTA's r-th work item (a query head's 2 x block_q rows): items by decreasing work, dealt to the CTAs
        back and forth (round r even: CTA c takes the c-th of the round, odd: the c-th from its end), so a CTA
        with a heavy item in one round gets a light one in the next. -> (valid, head, tile, K/V blocks)."""
        idx = r * ctas + jnp.where(r % 2 == 0, cta, ctas - 1 - cta)
        tile = n_tiles - 1 - idx // H
        return idx < n_items, idx % H, tile, tile + 1      # blocks 0..tile: block `tile` is the diagonal

    def take_turn():     # ping-pong: wait until the other compute warpgroup has reached its matching point
        if config.pingpong:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        o_smem, p_smem = o_smem2.at[wg], p_smem2.at[wg]
        c = scale * LOG2E

        def softmax(s, m_i, l_i, row0, j, masked: bool):
            """Block j's scores s (log2 e and the scale folded in) into P and the running max and sum: (p, m, alpha,
            l), alpha rescaling what was summed before."""
            if masked:   # the diagonal block: key j * bkv + col visible to row row0 + r when col <= row
                rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA) + row0
                cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA) + j * bkv
                s = jnp.where(cols <= rows, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))     # finite: every row sees key 0 in block 0
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            return p, m_new, alpha, l_i * alpha + p.sum(axis=1)

        def step(g0, row0, q_smem, q_buf, last, j, carry, masked: bool):
            """K/V block j of the item (g0 + j of the CTA's stream): S, the online softmax, acc += P V."""
            acc, m_i, l_i = carry
            slot = lax.rem(g0 + j, stages)
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                take_turn()     # the other warpgroup's softmax ends; its products go next
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), f32)) * c
            plgpu.barrier_arrive(k_free.at[slot])
            if last:
                plgpu.barrier_arrive(q_free.at[q_buf])     # the Q buffer may take a later item's Q
            p, m_new, alpha, l_i = softmax(s, m_i, l_i, row0, j, masked)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p_smem[...] = p.astype(dtype)     # wgmma's A from shared memory (Mosaic GPU's interpreter takes no other)
            plgpu.commit_smem()
            if config.pingpong:
                plgpu.barrier_arrive(turn)     # softmax done
            plgpu.barrier_wait(v_bar.at[slot])
            if config.pingpong:
                plgpu.barrier_wait(turn)       # the other's QK^T is issued: the tensor cores are ours

            def pv(pv_ref):
                plgpu.wgmma(pv_ref, p_smem, v_smem.at[slot])
                plgpu.wgmma_wait(0)
                return pv_ref[...]

            acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, hd), f32))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        def finish(row0, head, acc, l_i):
            """The item's output rows: acc / l, rounded, stored by TMA through o_smem."""
            acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the previous item's output is out of o_smem
            o_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[pl.ds(row0, bq), head])

        def item(r, g0):
            valid, head, tile, blocks = item_of(r)

            @pl.when(valid)
            def _():
                row0 = tile * bkv + wg * bq
                q_buf = lax.rem(r, nq)
                q_smem = q_smem2.at[q_buf, wg]
                plgpu.barrier_wait(q_bar.at[q_buf * 2 + wg])
                m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, f32), plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((bq,), 0, f32), plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((bq, hd), 0, f32), plgpu.Layout.WGMMA)
                pl.when(wg == 1)(take_turn)     # warpgroup 1 starts one turn behind warpgroup 0 ...
                carry = lax.fori_loop(0, blocks - 1,
                                      functools.partial(step, g0, row0, q_smem, q_buf, False, masked=False),
                                      (acc, m_i, l_i))
                acc, m_i, l_i = step(g0, row0, q_smem, q_buf, True, blocks - 1, carry, masked=True)
                pl.when(wg == 0)(take_turn)     # ... and warpgroup 0 ends one turn after it: as many arrivals each
                finish(row0, head, acc, l_i)

            return g0 + jnp.where(valid, blocks, 0)

        lax.fori_loop(0, rounds, item, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def item(r, carry):
            g0, n = carry
            valid, head, tile, blocks = item_of(r)
            kv_head = lax.div(head, jnp.array(group, head.dtype))

            @pl.when(valid)
            def _():
                q_buf = lax.rem(r, nq)

                @pl.when(r >= nq)     # the last item in this buffer has done its last QK^T
                def _():
                    plgpu.barrier_wait(q_free.at[q_buf])

                for w in range(2):
                    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(tile * bkv + w * bq, bq), head], q_smem2.at[q_buf, w],
                                            q_bar.at[q_buf * 2 + w])

                @pl.loop(0, blocks)
                def _block(j):
                    # K and V each as soon as both compute warpgroups are done with the block `stages` before it
                    # in the stream: V's release comes after the next block's QK^T in ping-pong, so waiting for
                    # both before K would deadlock a 1-deep ring
                    g = g0 + j
                    slot = lax.rem(g, stages)
                    rows = pl.ds(j * bkv, bkv)
                    pl.when(g >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                    plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_smem.at[slot], k_bar.at[slot])
                    pl.when(g >= stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                    plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_smem.at[slot], v_bar.at[slot])

            return g0 + jnp.where(valid, blocks, 0), n + valid.astype(jnp.int32)

        total, n_items_cta = lax.fori_loop(0, rounds, item, (0, 0))

        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(g):     # the last blocks' releases and Q's: every barrier phase observed before the CTA exits
            slot = lax.rem(g, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        @pl.loop(jnp.maximum(n_items_cta - nq, 0), n_items_cta)
        def _drain_q(r):
            plgpu.barrier_wait(q_free.at[lax.rem(r, nq)])


@functools.partial(jax.jit, static_argnames=("scale", "config", "ctas", "interpret"))
def fresh_prompt_flash(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, *,
                       config: FlashConfig = FlashConfig(), ctas: int | None = None,
                       interpret: bool = False) -> jax.Array:
    """Causal attention of one prompt at positions 0..T-1 over itself: q [T, H, hd], k, v [T, KVH, hd].
    ctas: the persistent grid's size (default: the GPU's SM count; config.persistent False: one CTA an item)."""
    if not supported(q, k, config) or v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"fresh_prompt_flash: q {q.shape} {q.dtype}, k {k.shape} {k.dtype}, v {v.shape} "
                         f"{v.dtype} do not tile by {config}")
    T, H, hd = q.shape
    group = H // k.shape[1]
    bq, bkv, stages = config.block_q, config.block_kv, config.stages
    n_items = H * (T // bkv)
    ctas = min(ctas or num_sms(), n_items) if config.persistent else n_items
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    scratch = dict(
        q_smem2=plgpu.SMEM((config.q_buffers, 2, bq, hd), q.dtype, transforms=(tiling, swizzle)),
        o_smem2=plgpu.SMEM((2, bq, hd), q.dtype, transforms=(tiling, swizzle)),
        p_smem2=plgpu.SMEM((2, bq, bkv), q.dtype, transforms=(tiling, swizzle)),
        k_smem=plgpu.SMEM((stages, bkv, hd), q.dtype, transforms=(tiling, swizzle)),
        v_smem=plgpu.SMEM((stages, bkv, hd), q.dtype, transforms=(tiling, swizzle)),
        q_bar=plgpu.Barrier(num_barriers=2 * config.q_buffers),
        q_free=plgpu.Barrier(num_arrivals=2, num_barriers=config.q_buffers),
        k_bar=plgpu.Barrier(num_barriers=stages),
        v_bar=plgpu.Barrier(num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        turn=plgpu.Barrier(num_arrivals=2),
    )

    def entry(q_ref, k_ref, v_ref, out_ref):
        pl.run_scoped(functools.partial(_kernel, q_ref, k_ref, v_ref, out_ref, config=config, scale=scale,
                                        group=group, ctas=ctas), **scratch, collective_axes="wg")

    call = plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(ctas,), grid_names=("cta",), num_threads=3, thread_name="wg",
        kernel_name="fresh_prompt_flash",
        compiler_params=plgpu.CompilerParams(approx_math=True))
    return run_mosaic(call, q, k, v, interpret=interpret)
