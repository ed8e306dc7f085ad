"""Run: PYTHONPATH=. python3 experiments/router_fold_routing.py (CPU, ~1 min).

How often a router folded into o_proj (logits = inv_rms(h) * (r.(s*Wr) + a.W'), float32) picks other top-k experts
than the reference's bf16 router (o rounded, h rounded, normed row rounded, logits rounded), Qwen3-30B-A3B's shapes,
random bf16 weights N(0, 0.02) as bench.random_model writes them, norm scales 1 + N(0, 0.1)."""
import jax, jax.numpy as jnp, numpy as np
bf, f32 = jnp.bfloat16, jnp.float32
D, A, E, K, N = 2048, 4096, 128, 8, 4096
key = jax.random.split(jax.random.PRNGKey(0), 6)
std = 0.02
Wo = (jax.random.normal(key[0], (D, A)) * std).astype(bf)
Wr = (jax.random.normal(key[1], (E, D)) * std).astype(bf)
s = (1 + 0.1 * jax.random.normal(key[2], (D,))).astype(bf)
r = jax.random.normal(key[3], (N, D)).astype(bf)
a = jax.random.normal(key[4], (N, A)).astype(bf)

def rms_inv(h): return jax.lax.rsqrt(jnp.mean(h.astype(f32) ** 2, -1, keepdims=True) + 1e-6)

o = jnp.dot(a, Wo.T, preferred_element_type=f32).astype(bf)
h = (r.astype(f32) + o.astype(f32)).astype(bf)
n = ((h.astype(f32) * rms_inv(h)).astype(bf).astype(f32) * s.astype(f32)).astype(bf)
ref = jnp.dot(n, Wr.T, preferred_element_type=f32).astype(bf).astype(f32)
Af = s.astype(f32)[None, :] * Wr.astype(f32)                       # [E, D]
Wp = Af @ Wo.astype(f32)                                             # [E, A]
z = r.astype(f32) @ Af.T + a.astype(f32) @ Wp.T
fold = rms_inv(h) * z
f32ref = (h.astype(f32) * rms_inv(h)) * s.astype(f32) @ Wr.astype(f32).T   # the router in float32 from the same h

def topk(x): return np.asarray(jax.lax.top_k(x, K)[1])
def differ(x, y):
    tx, ty = topk(x), topk(y)
    sets = np.mean([set(p) != set(q) for p, q in zip(tx, ty)])
    order = np.mean(np.any(tx != ty, axis=1))
    return sets, order
print(f"tokens {N}: top-{K} set / order differ from the bf16 reference router")
print(f"  folded (float32 z, inv from h):   {differ(fold, ref)[0]:.2%} / {differ(fold, ref)[1]:.2%}")
print(f"  router in float32 from the same h: {differ(f32ref, ref)[0]:.2%} / {differ(f32ref, ref)[1]:.2%}")
print(f"  folded against float32 router:     {differ(fold, f32ref)[0]:.2%} / {differ(fold, f32ref)[1]:.2%}")
