"""Run by tests/test_tensor_parallel.py in a process of its own, with 8 CPU devices (the device count is fixed
before jax starts, so the other tests' processes keep theirs). Prints one JSON line per result.

    python tests/tensor_parallel_worker.py logits FAMILY...    each family's prompt logits at TP 1, 2, 4 and 8
    python tests/tensor_parallel_worker.py greedy OPS N FAMILY...  the engine's greedy tokens at TP N
    python tests/tensor_parallel_worker.py settings             sampled, n-gram speculation, int8 KV cache, split layers
    python tests/tensor_parallel_worker.py distributed RANK N PORT  the same, one of N processes (TP N over all)
    python tests/tensor_parallel_worker.py follower RANK N PORT     process 0 generates, the others follow its calls
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "tests" / "data" / "models"
GOLDEN = REPO / "tests" / "data" / "golden"
STORIES = REPO.parent / "shared" / "models" / "stories260k"


def model_dir(family: str) -> Path:
    return STORIES if family == "stories260k" else MODELS / family


def logits(families: list[str]) -> None:
    import jax
    import numpy as np

    from jaxinfer.model.config import load_config
    from jaxinfer.model.transformer import prompt_logits
    from jaxinfer.model.weights import load_params
    from jaxinfer.ops import get_ops
    from jaxinfer.ops.tensor_parallel import tensor_parallel_ops
    from jaxinfer.runner.mesh import make_mesh

    ops = get_ops("reference")
    for family in families:
        d = model_dir(family)
        cfg = load_config(d)
        ids = np.random.default_rng(len(family)).integers(0, cfg.vocab_size, 21)
        ref = np.asarray(prompt_logits(cfg, ops, load_params(d, cfg, progress=False), ids))
        for n in (2, 4, 8):
            mesh = make_mesh(n)
            params = load_params(d, cfg, progress=False, mesh=mesh)
            sharded = sum(not a.sharding.is_fully_replicated for a in jax.tree.leaves(params))
            out = np.asarray(prompt_logits(cfg, tensor_parallel_ops(ops, mesh), params, ids))
            print(json.dumps(dict(family=family, n=n, shape=list(out.shape), ref_shape=list(ref.shape),
                                  max_abs=float(np.abs(out - ref).max()), sharded=sharded,
                                  argmax_equal=bool((out.argmax(-1) == ref.argmax(-1)).all()))), flush=True)


def greedy(ops: str, n: int, families: list[str], **settings) -> None:
    """The greedy tokens of the golden files' prompts (tests/data/golden), 16 a prompt, at TP n."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for family in families:
        golden = np.load(GOLDEN / f"{family}.npz")
        prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
        llm = LLM(model_dir(family), tensor_parallel_size=n, ops=ops, max_num_seqs=4, max_num_batched_tokens=32,
                  decode_steps=4, skip_tokenizer_init=True, progress=False, cache_dir="", **settings)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        print(json.dumps(dict(family=family, n=n, ops=ops, tokens=tokens)), flush=True)


def settings() -> None:
    """Sampled tokens (a seed, top-k and top-p) with n-gram speculation, an int8 KV cache and split layers, at TP 1
    and 2."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    golden = np.load(GOLDEN / "qwen3.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=3, ignore_eos=True)
    for n in (1, 2):
        llm = LLM(model_dir("qwen3"), tensor_parallel_size=n, max_num_seqs=4, max_num_batched_tokens=32,
                  decode_steps=4, skip_tokenizer_init=True, progress=False, cache_dir="", speculative="ngram",
                  kv_cache_dtype="int8", unroll_layers=True)
        assert isinstance(llm.engine.runner.params["layers"], list)   # split layers
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        print(json.dumps(dict(n=n, tokens=tokens)), flush=True)


def distributed(rank: int, processes: int, port: int) -> None:
    """One of `processes` processes (one CPU device each): greedy tokens at TP over all of them."""
    greedy("reference", processes, ["qwen3"], distributed=f"localhost:{port},{processes},{rank}")


def follower(rank: int, processes: int, port: int) -> None:
    """Process 0 generates through a Leader (engine.followers); the others follow its engine calls."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine.followers import Leader, follow

    llm = LLM(model_dir("qwen3"), tensor_parallel_size=processes, max_num_seqs=4, max_num_batched_tokens=32,
              decode_steps=4, skip_tokenizer_init=True, progress=False, cache_dir="",
              distributed=f"localhost:{port},{processes},{rank}")
    if rank > 0:
        print(json.dumps(dict(rank=rank, calls=follow(llm.engine))), flush=True)
        return
    llm.engine = Leader(llm.engine)
    golden = np.load(GOLDEN / "qwen3.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]
    rest = [o.outputs[0].token_ids for o in llm.generate(prompts[2:], params)]   # a second batch, later
    llm.engine.stop_followers()
    print(json.dumps(dict(rank=rank, n=processes, tokens=first + rest)), flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "follower":
        follower(int(args[0]), int(args[1]), int(args[2]))
    elif mode == "distributed":
        distributed(int(args[0]), int(args[1]), int(args[2]))
    elif mode == "settings":
        settings()
    elif mode == "logits":
        logits(args)
    else:
        greedy(args[0], int(args[1]), args[2:])
