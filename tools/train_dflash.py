"""Distil a DFlash block drafter for a target from text the target generates itself, save it in the published
format, and measure mean accepted lengths (greedy) against an untrained drafter and n-gram prompt lookup.

    .venv/bin/python tools/train_dflash.py --target ../shared/models/stories260k --out /tmp/dflash-stories260k

Needs optax (`pip install -e .[train]`). Steps:
1. data: the target's own continuations (jaxinfer.LLM, ignore_eos, fixed length) of prompts it samples itself
   from BOS (--prefix tokens at temperature 1): half continued greedily, half sampled at temperature 1;
2. the target's hidden states at the drafter's target layers for every position (spec.dflash.target_layer_states);
3. training, block-wise as the authors' drafter is used (their repository holds inference code only; the
   objective follows it and the paper): per sequence, random anchor positions a; the block [token a, mask x k]
   at positions a..a+k sees the context features of positions < a and itself, and predicts tokens a+1..a+k of
   the target's own text; cross-entropy weighted exp(-(j - 1) / decay) for the j-th draft, AdamW with warm-up
   and cosine decay. The target's embedding and lm_head are used, frozen, as the authors do;
4. evaluation on held-out story openers (the tokenizer's encodings), greedy: at each verify step the drafter
   (or n-gram lookup) proposes k tokens after the last committed one; the accepted length is the number of
   them matching the target's greedy continuation, plus 1 for the target's own token; the mean is over all
   verify steps of all prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import save_file

from jaxinfer import LLM
from jaxinfer.model.config import load_config
from jaxinfer.model.weights import load_params
from jaxinfer.ops import get_ops
from jaxinfer.sampling import SamplingParams
from jaxinfer.spec.dflash import (DraftContext, block_input_ids, context_kv, draft_hidden, target_embedding_and_head,
                                  target_layer_states)
from jaxinfer.spec.dflash_config import (DFlashConfig, authors_target_layer_ids, dflash_config_from_hf,
                                         load_dflash_config, load_dflash_params, random_dflash_params)

EVAL_OPENERS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a boy named Tom went to the park.",
    "There was a big dog who liked to run.",
    "Sam and his mom went to the store.",
    "The sun was shining and the birds were singing.",
    "A little cat found a red ball in the garden.",
    "Tim had a toy car that he loved very much.",
    "In a small house, there lived an old man.",
    "Lucy wanted to play with her friend Ben.",
    "The little bird could not fly.",
    "Mom made a cake for the party.",
    "Max saw a big tree near the river.",
    "Anna liked to draw pictures of flowers.",
    "The bunny hopped into the forest.",
    "Jack found a shiny rock on the beach.",
    "Sara was sad because it was raining.",
]


def drafter_hf_config(target, args) -> dict:
    """The drafter's config.json, as the authors publish it (a Qwen3 config with the DFlash fields)."""
    layers = tuple(args.target_layers) if args.target_layers else \
        authors_target_layer_ids(target.num_layers, args.layers)
    return {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "dtype": "float32", "attention_bias": False, "attention_dropout": 0.0,
        "block_size": args.block_size,
        "dflash_config": {"mask_token_id": args.mask_token_id, "target_layer_ids": list(layers)},
        "num_target_layers": target.num_layers, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim, "intermediate_size": args.intermediate, "hidden_act": "silu",
        "max_position_embeddings": target.max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_types": ["full_attention"] * args.layers, "use_sliding_window": False, "tie_word_embeddings": False,
    }


def save_drafter(hf: dict, dcfg: DFlashConfig, params: dict, out: Path) -> None:
    """config.json + model.safetensors with the authors' tensor names."""
    cfg = dcfg.model
    p = jax.tree.map(lambda a: np.ascontiguousarray(np.asarray(a, np.float32)), params)
    lay = p["layers"]
    tensors = {"fc.weight": p["fc"], "hidden_norm.weight": p["hidden_norm"], "norm.weight": p["norm"]}
    q, k = cfg.q_size, cfg.kv_size
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        wqkv, gate_up = lay["wqkv"][i], lay["w_gate_up"][i]
        tensors.update({
            pre + "input_layernorm.weight": lay["attn_norm"]["scale"][i],
            pre + "post_attention_layernorm.weight": lay["mlp_norm"]["scale"][i],
            pre + "self_attn.q_proj.weight": wqkv[:q], pre + "self_attn.k_proj.weight": wqkv[q:q + k],
            pre + "self_attn.v_proj.weight": wqkv[q + k:], pre + "self_attn.o_proj.weight": lay["wo"][i],
            pre + "self_attn.q_norm.weight": lay["q_norm"][i], pre + "self_attn.k_norm.weight": lay["k_norm"][i],
            pre + "mlp.gate_proj.weight": gate_up[:cfg.intermediate_size],
            pre + "mlp.up_proj.weight": gate_up[cfg.intermediate_size:],
            pre + "mlp.down_proj.weight": lay["w_down"][i]})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def make_data(llm: LLM, n: int, prefix: int, length: int, seed: int) -> np.ndarray:
    """[n, prefix + length + 1] token ids: BOS, `prefix` tokens sampled from BOS, then `length` more (even rows
    greedy, odd rows sampled at temperature 1)."""
    bos = llm.tokenizer.bos_token_id
    starts = llm.generate([[bos]] * n, [SamplingParams(temperature=1.0, max_tokens=prefix, ignore_eos=True,
                                                       seed=seed + r) for r in range(n)])
    prompts = [[bos] + list(o.outputs[0].token_ids) for o in starts]
    params = [SamplingParams(temperature=0.0 if r % 2 == 0 else 1.0, max_tokens=length, ignore_eos=True,
                             seed=seed + n + r) for r in range(n)]
    outs = llm.generate(prompts, params)
    return np.array([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], np.int32)


def layer_states_of(tcfg, ops, tparams, tokens: np.ndarray, layer_ids, chunk: int = 64) -> np.ndarray:
    """The target's states [N, n, T, D] at layer_ids of every row of tokens [N, T]."""
    fn = jax.jit(jax.vmap(lambda t: target_layer_states(tcfg, ops, tparams, t, layer_ids)))
    return np.concatenate([np.asarray(fn(jnp.asarray(tokens[i:i + chunk]))) for i in range(0, len(tokens), chunk)])


def make_loss(dcfg: DFlashConfig, ops, embed, head, decay: float):
    k = dcfg.num_drafts
    weights = jnp.exp(-jnp.arange(k, dtype=jnp.float32) / decay)

    def sequence_ce(params, states, tokens, anchors):
        T = tokens.shape[0]
        ctx_k, ctx_v = context_kv(dcfg, ops, params, states, jnp.arange(T, dtype=jnp.int32))

        def block(a):
            h = draft_hidden(dcfg, ops, params, DraftContext(ctx_k, ctx_v, a), embed[block_input_ids(dcfg, tokens[a])])
            logits = ops.logits(h[1:], head)
            labels = jax.lax.dynamic_slice(tokens, (a + 1,), (k,))
            return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0], \
                jnp.argmax(logits, -1) == labels

        return jax.vmap(block)(anchors)

    def loss(params, states, tokens, anchors):
        ce, hit = jax.vmap(sequence_ce, in_axes=(None, 0, 0, 0))(params, states, tokens, anchors)
        return jnp.sum(ce * weights) / (ce.shape[0] * ce.shape[1] * jnp.sum(weights)), jnp.mean(hit, axis=(0, 1))

    return loss


def drafts_at_every_position(dcfg: DFlashConfig, ops, params, embed, head, states, tokens) -> np.ndarray:
    """argmax drafts [T, k] with the block at each position c (context 0..c-1, last committed token c)."""
    T = tokens.shape[0]
    ctx_k, ctx_v = context_kv(dcfg, ops, params, states, jnp.arange(T, dtype=jnp.int32))

    def at(c):
        h = draft_hidden(dcfg, ops, params, DraftContext(ctx_k, ctx_v, c), embed[block_input_ids(dcfg, tokens[c])])
        return jnp.argmax(ops.logits(h[1:], head), -1)

    return jax.vmap(at)(jnp.arange(T, dtype=jnp.int32))


def ngram_proposal(seq: np.ndarray, c: int, k: int, max_n: int = 3) -> list[int]:
    """Prompt lookup: the longest n (max_n..1) whose last n committed tokens seq[c-n+1..c] occurred before (the
    most recent occurrence), and up to k committed tokens that followed it."""
    for n in range(max_n, 0, -1):
        if c - n + 1 < 0:
            continue
        pattern = seq[c - n + 1:c + 1]
        for end in range(c - 1, n - 2, -1):
            if np.array_equal(seq[end - n + 1:end + 1], pattern):
                return list(seq[end + 1:min(end + 1 + k, c + 1)])
    return []


def accepted_lengths(seq: np.ndarray, start: int, k: int, propose) -> list[int]:
    """Accepted length (matching drafts + 1) of each verify step of a greedy run over seq, the first committed
    token at `start`; steps run while a whole block of k fits in seq."""
    out, c = [], start
    while c + k < len(seq):
        proposal = propose(c)
        a = 0
        while a < len(proposal) and proposal[a] == seq[c + 1 + a]:
            a += 1
        out.append(a + 1)
        c += a + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target model folder")
    ap.add_argument("--out", required=True, type=Path, help="where to save the trained drafter")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=192)
    ap.add_argument("--target-layers", type=int, nargs="*", help="default: the authors' choice")
    ap.add_argument("--mask-token-id", type=int, default=0)
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=6, help="tokens the target samples from BOS as a prompt")
    ap.add_argument("--length", type=int, default=160, help="tokens of the target's continuation")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16, help="sequences a step")
    ap.add_argument("--anchors", type=int, default=16, help="blocks a sequence a step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--decay", type=float, default=4.0, help="loss weight exp(-(j-1)/decay) of the j-th draft")
    ap.add_argument("--norm-init", choices=("target", "ones"), default="target",
                    help="the drafter's final norm scale at the start: the target's final norm's, or ones (the "
                         "authors' init)")
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:7.1f} s] {msg}", flush=True)

    ops = get_ops("reference")
    tcfg = load_config(args.target)
    tparams = load_params(args.target, tcfg, progress=False)
    embed, head = target_embedding_and_head(tcfg, tparams)
    hf = drafter_hf_config(tcfg, args)
    dcfg = dflash_config_from_hf(hf)
    k = dcfg.num_drafts
    llm = LLM(args.target, progress=False)

    tokens = make_data(llm, args.sequences, args.prefix, args.length, args.seed)
    log(f"data: {tokens.shape} tokens from the target")
    states = layer_states_of(tcfg, ops, tparams, tokens, dcfg.target_layer_ids)
    log(f"target states {states.shape} at layers {list(dcfg.target_layer_ids)}")

    params = random_dflash_params(dcfg, args.seed)
    if args.norm_init == "target":   # the drafter's last norm feeds the target's lm_head, as the target's does
        params["norm"] = jnp.asarray(tparams["final_norm"]["scale"], jnp.float32)
    untrained = params
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10), args.steps, args.lr / 20)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = opt.init(params)
    loss_fn = make_loss(dcfg, ops, embed, head, args.decay)

    @jax.jit
    def train_step(params, opt_state, states, tokens, anchors):
        (loss, hit), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, states, tokens, anchors)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, hit

    rng = np.random.default_rng(args.seed)
    lo, hi = args.prefix + 1, tokens.shape[1] - 1 - k     # anchors: the continuation's tokens with k after them
    for step in range(1, args.steps + 1):
        rows = rng.integers(0, len(tokens), args.batch)
        anchors = rng.integers(lo, hi + 1, (args.batch, args.anchors)).astype(np.int32)
        params, opt_state, loss, hit = train_step(params, opt_state, jnp.asarray(states[rows]),
                                                  jnp.asarray(tokens[rows]), jnp.asarray(anchors))
        if step % 100 == 0 or step == 1:
            log(f"step {step}: loss {float(loss):.3f}, argmax hits by draft position "
                f"{np.round(np.asarray(hit), 2).tolist()}")
    save_drafter(hf, dcfg, params, args.out)
    dcfg = load_dflash_config(args.out)            # the evaluation reads the saved drafter back
    params = load_dflash_params(args.out, dcfg)
    log(f"saved {args.out}")

    bos = llm.tokenizer.bos_token_id
    prompts = [[bos] + llm.tokenizer.encode(text, add_special_tokens=False) for text in EVAL_OPENERS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.eval_tokens, ignore_eos=True))
    seqs = [np.array(p + list(o.outputs[0].token_ids), np.int32) for p, o in zip(prompts, outs)]
    # one shape for every prompt: padding after a sequence's end changes none of its positions' states or drafts
    padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for r, seq in enumerate(seqs):
        padded[r, :len(seq)] = seq
    all_states = layer_states_of(tcfg, ops, tparams, padded, dcfg.target_layer_ids)
    drafts = jax.jit(jax.vmap(lambda p, s, t: drafts_at_every_position(dcfg, ops, p, embed, head, s, t),
                              in_axes=(None, 0, 0)))
    drafted = {name: np.asarray(drafts(p, jnp.asarray(all_states), jnp.asarray(padded)))
               for name, p in (("trained DFlash", params), ("untrained DFlash", untrained))}
    results = {"trained DFlash": [], "untrained DFlash": [], "n-gram (n=3..1)": []}
    for r, (prompt, seq) in enumerate(zip(prompts, seqs)):
        start = len(prompt)   # the target's first token, from the prefill
        for name, d in drafted.items():
            results[name] += accepted_lengths(seq, start, k, lambda c: list(d[r, c]))
        results["n-gram (n=3..1)"] += accepted_lengths(seq, start, k, lambda c: ngram_proposal(seq, c, k))
    print(f"\nmean accepted length (greedy, k = {k}, {len(prompts)} held-out prompts, {args.eval_tokens} tokens each)")
    print(f"{'proposer':<20} {'mean':>6} {'steps':>6}")
    for name, lengths in results.items():
        print(f"{name:<20} {np.mean(lengths):6.3f} {len(lengths):6d}")
    log("done")


if __name__ == "__main__":
    main()
