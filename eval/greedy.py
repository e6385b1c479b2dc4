"""The generative probe: greedy continuations of prompts cut from the evaluation text, by both models,
compared token by token. Perplexity and KL measure the next token; users read whole answers, where
one early difference changes everything after it. Two figures: the share of continuations identical to
the original's, and the mean number of tokens before the first divergence (the whole continuation's
length where there is none).

The prompts are cut at evenly spaced places of the token stream (so they sample the whole text, not its
first windows), each :data:`PROMPT_TOKENS` long (a quarter of the window where that is shorter), and
generated in batches with the KV cache, greedily: the same prompts give the same tokens on any run.
"""

from __future__ import annotations

import torch

from mha2gqa.eval.agreement import GreedyProbe

#: Tokens of each prompt (fewer where a quarter of the evaluation window is fewer).
PROMPT_TOKENS = 32
#: Prompts a forward of :func:`continuations` generates at once.
BATCH = 16


def probe_prompts(ids: torch.Tensor, count: int, seq_len: int, new: int) -> torch.Tensor | None:
    """``[count, P]`` prompts cut at evenly spaced places of the token stream ``ids`` ``[N]`` (each with
    room for ``new`` tokens after it in the text); None when ``count`` is 0 or the text is too short."""
    length = max(1, min(PROMPT_TOKENS, seq_len // 4))
    room = ids.numel() - length - new
    if count < 1 or room < 0:
        return None
    count = min(count, room + 1)
    starts = torch.linspace(0, room, count).round().long().tolist()
    return torch.stack([ids[s : s + length] for s in starts])


def greedy_generate(model: torch.nn.Module, ids: torch.Tensor, new: int, pad_id: int, **extra) -> object:
    """``model``'s greedy continuation of ``ids`` ``[B, P]`` (one length: no padding), exactly ``new``
    tokens (``extra``: more of ``generate``'s options); what ``generate`` returns."""
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=pad_id,
        **extra,
    )


@torch.inference_mode()
def continuations(
    model: torch.nn.Module, prompts: torch.Tensor, new: int, pad_id: int, progress: bool = False
) -> torch.Tensor:
    """``[count, new]``: each prompt's greedy continuation (prompts of one length: no padding), generated
    :data:`BATCH` prompts at a time with the KV cache (a bar over the prompts with ``progress``)."""
    from mha2gqa.core.progress import bar as progress_bar

    device = next(model.parameters()).device
    out = []
    with progress_bar(total=len(prompts), unit="prompt", desc="generative probe", disable=not progress) as bar:
        for start in range(0, len(prompts), BATCH):
            batch = prompts[start : start + BATCH].to(device)
            ids = greedy_generate(model, batch, new, pad_id)
            out.append(ids[:, batch.shape[1] :].cpu())
            bar.update(len(batch))
    return torch.cat(out)


def compare(original: torch.Tensor, converted: torch.Tensor, prompt_tokens: int) -> GreedyProbe:
    """Both models' continuations ``[count, new]`` of the same prompts, compared token by token."""
    if original.shape != converted.shape:
        raise ValueError(f"continuations of different shapes: {tuple(original.shape)} and {tuple(converted.shape)}")
    count, new = original.shape
    same = original == converted
    agreeing = torch.where(same.all(1), new, (~same).int().argmax(1))  # tokens before the first divergence
    return GreedyProbe(count, prompt_tokens, new, float(same.all(1).float().mean()), float(agreeing.float().mean()))
