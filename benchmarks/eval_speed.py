"""Speed and memory of the evaluation harness against the plain transformers ways, on CPU or GPU.

(a) Perplexity: tokens/s of ``mha2gqa``'s disjoint pass (``score_windows``) vs the plain loop
    ``model(x, labels=x).loss`` over the same windows, same model, same process (alternating runs,
    median). Both must give the same perplexity.
(b) Attention similarity at ``--attn-seq-len`` (default 1024): ``attention_similarity`` vs the eager
    route (``attn_implementation="eager"``, ``output_attentions=True``, statistics on the full
    ``[layers, heads, T, T]`` matrices), each in its own process: wall time and peak RSS above the
    loaded models (CPU) or peak CUDA memory (GPU).

    python benchmarks/eval_speed.py                 # CPU, a random 8-layer Llama (hidden 512, 8 heads)
    python benchmarks/eval_speed.py --device cuda --dtype bfloat16 --hidden 2048 --layers 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
import psutil, torch
sys.path.insert(0, sys.argv[1])
import eval_speed as b
args = json.loads(sys.argv[2])
route = sys.argv[3]
torch.manual_seed(0)
device = torch.device(args["device"])
models = b.build_pair(args, eager=(route == "eager"))
gen = torch.Generator().manual_seed(1)
batch = torch.randint(3, args["vocab"], (1, args["attn_seq_len"]), generator=gen).to(device)
if device.type == "cuda":  # a warm-up call first: kernel selection and caching are not the route's cost
    b.ROUTES[route](models, batch)
    torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
base = psutil.Process().memory_info().rss
t = time.perf_counter()
summary = b.ROUTES[route](models, batch)
if device.type == "cuda":
    torch.cuda.synchronize()
wall = time.perf_counter() - t
if device.type == "cuda":
    peak = torch.cuda.max_memory_allocated()
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
print(json.dumps({"wall": wall, "peak_bytes": peak, "summary": summary}))
"""


def build_pair(args: dict, eager: bool = False):
    """A random Llama MHA model and its mean-pooled conversion to ``kv`` heads (in memory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=args["hidden"] * 8 // 3,
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        max_position_embeddings=4096,
    )
    impl = "eager" if eager else "sdpa"
    dtype = getattr(torch, args["dtype"])
    torch.manual_seed(0)
    orig = LlamaForCausalLM(LlamaConfig(**cfg, num_key_value_heads=args["heads"], attn_implementation=impl))
    conv = LlamaForCausalLM(LlamaConfig(**cfg, num_key_value_heads=args["kv"], attn_implementation=impl))
    state = orig.state_dict()
    d = args["hidden"] // args["heads"]
    for name, t in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = t.reshape(args["kv"], -1, d, t.shape[1]).mean(1).reshape(-1, t.shape[1])
    conv.load_state_dict(state)
    return [m.to(args["device"], dtype).eval() for m in (orig, conv)]


def ours(models, batch):
    from mha2gqa.core.typed import plain
    from mha2gqa.eval.attention import attention_similarity

    return plain(attention_similarity(models[0], models[1], batch).summary)


def eager(models, batch):
    """The plain route: full attention matrices from both models, statistics on them."""
    import torch

    from mha2gqa.eval.metrics import cosine, entropy, js_divergence, kl_divergence

    with torch.no_grad():
        a = models[0](batch, output_attentions=True, output_hidden_states=True)
        b = models[1](batch, output_attentions=True, output_hidden_states=True)
        kl, js, cos, hid = [], [], [], []
        for pa, pb, ha, hb in zip(a.attentions, b.attentions, a.hidden_states[1:], b.hidden_states[1:], strict=True):
            la, lb = pa.float().log(), pb.float().log()
            kl.append(kl_divergence(la, lb).mean().item())
            js.append(js_divergence(la, lb).mean().item())
            cos.append(cosine(pa.float(), pb.float()).mean().item())
            entropy(la), entropy(lb)
            hid.append(cosine(ha.float(), hb.float()).mean().item())
    n = len(kl)
    return {
        "mean_kl": sum(kl) / n,
        "mean_js": sum(js) / n,
        "mean_cosine": sum(cos) / n,
        "mean_hidden_cosine": sum(hid) / n,
    }


ROUTES = {"ours": ours, "eager": eager}


def attention_bench(args: dict) -> dict:
    out = {}
    for route in ("ours", "eager"):
        res = subprocess.run(
            [sys.executable, "-c", CHILD, str(Path(__file__).parent), json.dumps(args), route],
            capture_output=True,
            text=True,
            env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
        )
        if res.returncode != 0:
            raise SystemExit(f"{route} failed:\n{res.stderr[-2000:]}")
        out[route] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def perplexity_bench(args: dict) -> dict:
    import torch

    from mha2gqa.eval.perplexity import disjoint_windows, score_windows

    model = build_pair(args)[0]
    ids = torch.randint(3, args["vocab"], (args["ppl_tokens"],), generator=torch.Generator().manual_seed(2))
    windows = disjoint_windows(ids, args["seq_len"])
    device = torch.device(args["device"])

    def plain() -> tuple[float, int]:
        nll = n = 0
        with torch.no_grad():
            for w, _ in windows:
                x = w[None].to(device)
                nll += model(x, labels=x).loss.item() * (x.shape[1] - 1)
                n += x.shape[1] - 1
        return nll, n

    def mine() -> tuple[float, int]:
        res = score_windows([model], windows, batch_size=args["batch_size"])
        return res.nll_sum[0], res.tokens

    times: dict[str, list[float]] = {"plain": [], "mha2gqa": []}
    ppl = {}
    for _ in range(args["repeats"]):
        for name, fn in (("plain", plain), ("mha2gqa", mine)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            nll, n = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
            ppl[name] = math.exp(nll / n)
    tokens = sum(w.numel() - 1 for w, _ in windows)
    return {name: {"tokens_per_s": tokens / statistics.median(ts), "ppl": ppl[name]} for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--attn-seq-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = vars(p.parse_args())
    print(
        f"model: random Llama, {args['layers']} layers, hidden {args['hidden']}, {args['heads']} heads "
        f"(converted: {args['kv']} KV heads), {args['device']} {args['dtype']}"
    )
    ppl = perplexity_bench(args)
    ratio = ppl["mha2gqa"]["tokens_per_s"] / ppl["plain"]["tokens_per_s"]
    print(
        f"(a) perplexity, {args['ppl_tokens']} tokens in windows of {args['seq_len']}: plain loop "
        f"{ppl['plain']['tokens_per_s']:,.0f} tok/s, mha2gqa {ppl['mha2gqa']['tokens_per_s']:,.0f} tok/s "
        f"(batch {args['batch_size']}): {ratio:.2f}x; ppl {ppl['plain']['ppl']:.4f} vs {ppl['mha2gqa']['ppl']:.4f}"
    )
    att = attention_bench(args)
    o, e = att["ours"], att["eager"]
    print(
        f"(b) attention similarity at {args['attn_seq_len']} tokens: eager {e['wall']:.2f} s, "
        f"{e['peak_bytes'] / 2**20:,.0f} MiB; mha2gqa {o['wall']:.2f} s, {o['peak_bytes'] / 2**20:,.0f} MiB "
        f"-> {e['wall'] / o['wall']:.1f}x faster, {o['peak_bytes'] / e['peak_bytes']:.1%} of the memory"
    )
    print(
        f"    mean KL ours {o['summary']['mean_kl']:.5f} vs eager {e['summary']['mean_kl']:.5f}; "
        f"hidden cosine {o['summary']['mean_hidden_cosine']:.5f} vs {e['summary']['mean_hidden_cosine']:.5f}"
    )


if __name__ == "__main__":
    main()
