"""A deliberately simple in-memory MHA -> GQA conversion, written independently of the library,
for differential tests: load the whole state dict, loop over layers and groups, stack, pool."""

from __future__ import annotations

import torch


def reference_convert(
    state: dict[str, torch.Tensor], config: dict, layout: dict, groups: int, method: str
) -> dict[str, torch.Tensor]:
    """``layout``: ``k``/``v`` (or ``qkv``) module templates, ``k_norm`` and its ``k_norm_layout``."""
    from mha2gqa.core.architecture import resolve

    config = resolve(config, strict=False).standard()  # GPTBigCode's n_head, Falcon's num_kv_heads...
    h = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or h
    d = config.get("head_dim") or config["hidden_size"] // h
    per = kv // groups
    out = dict(state)

    def pool(heads: list[torch.Tensor]) -> torch.Tensor:
        if method == "first":
            return heads[0]
        return torch.stack([x.to(torch.float32) for x in heads]).mean(dim=0).to(heads[0].dtype)

    def pool_rows(t: torch.Tensor) -> torch.Tensor:
        heads = [t[i * d : (i + 1) * d] for i in range(kv)]
        return torch.cat([pool(heads[j * per : (j + 1) * per]) for j in range(groups)])

    for layer in range(config["num_hidden_layers"]):
        for key in ("k", "v", "qkv"):
            if key not in layout:
                continue
            for suffix in (".weight", ".bias"):
                name = layout[key].format(layer=layer) + suffix
                if name not in state:
                    continue
                if key == "qkv" and layout["family"].qkv_layout == "grouped":  # [G, H/G + 2, d] rows
                    t = state[name]
                    r = h // kv
                    blocks = t.reshape(kv, r + 2, d, *t.shape[1:])
                    q = blocks[:, :r].reshape(h * d, *t.shape[1:])
                    k, v = (blocks[:, r + i].reshape(kv * d, *t.shape[1:]) for i in (0, 1))
                    k, v = pool_rows(k), pool_rows(v)
                    parts = [
                        q.reshape(groups, h // groups, d, *t.shape[1:]),
                        k.reshape(groups, 1, d, *t.shape[1:]),
                        v.reshape(groups, 1, d, *t.shape[1:]),
                    ]
                    out[name] = torch.cat(parts, dim=1).reshape(-1, *t.shape[1:])
                elif key == "qkv":
                    t = state[name]
                    q, k, v = t[: h * d], t[h * d : (h + kv) * d], t[(h + kv) * d :]
                    out[name] = torch.cat([q, pool_rows(k), pool_rows(v)])
                else:
                    out[name] = pool_rows(state[name])
        norm = layout.get("k_norm")
        if norm and layout["k_norm_layout"] == "rows":
            name = norm.format(layer=layer)
            out[name] = pool_rows(state[name])
        elif norm and layout["k_norm_layout"] == "indexed":
            names = [norm.format(layer=layer, head=i) for i in range(kv)]
            for j in range(kv):
                del out[names[j]]
            for j in range(groups):
                out[names[j]] = pool([state[n] for n in names[j * per : (j + 1) * per]])
    return out


def top_k_distillation_formula(student, values, indices, rest, temperature: float = 1.0) -> torch.Tensor:
    """The top-K distillation (``mha2gqa.uptrain.objectives.distillation_top_k``) written as its formula
    over the whole ``[..., vocab]`` logits, for autograd to differentiate: the loss and gradient the
    library's row-by-row analytic version must give (and what it replaced, for its benchmark)."""
    ls = torch.log_softmax(student.to(torch.promote_types(student.dtype, torch.float32)) / temperature, -1)
    idx = indices.long()
    loss = (values.exp() * (values - ls.gather(-1, idx))).sum(-1)
    if idx.shape[-1] < ls.shape[-1]:
        tail = ls.scatter(-1, idx, float("-inf")).logsumexp(-1)
        r = rest.clamp(min=-1e4)
        loss = loss + r.exp() * (r - tail)
    return loss.mean() * temperature**2
