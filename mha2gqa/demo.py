"""The embedded default job: a small MHA Llama (or, with ``architecture: gpt_neox``, a Pythia-style
GPT-NeoX) trained on CPython's own documentation, converted.

Nothing is downloaded. The text is ``pydoc_data.topics`` (the help topics shipped with CPython);
the model is trained once (about a minute on 2 CPU cores) and cached, then converted to fewer KV
heads and evaluated on held-out topics with the disjoint perplexity protocol.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mha2gqa.core.cache import cache_root
from mha2gqa.core.settings import setting
from mha2gqa.core.signals import check as check_signals

SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]
#: The classes the demo model can be: Llama, or GPT-NeoX as Pythia builds it.
DEMO_ARCHITECTURES = ("llama", "gpt_neox")


@dataclass(frozen=True)
class DemoSettings:
    """Everything that determines the cached demo model (its hash names the cache folder)."""

    vocab_size: int = setting(2048, help="BPE vocabulary size.", minimum=259)
    hidden_size: int = setting(128, help="Hidden size.", minimum=1)
    intermediate_size: int = setting(352, help="MLP size.", minimum=1)
    num_layers: int = setting(4, help="Decoder layers.", minimum=1)
    num_heads: int = setting(8, help="Attention heads (all of them KV heads: MHA).", minimum=1)
    seq_len: int = setting(128, help="Training window (the model gets twice as many positions).", minimum=2)
    batch_size: int = setting(16, help="Training batch.", minimum=1)
    steps: int = setting(400, help="Training steps (~1 min on 2 cores).", minimum=1)
    lr: float = setting(3e-3, help="Peak learning rate.", above=0)
    seed: int = setting(0, help="Seed.", minimum=0, maximum=2**63 - 1)
    heldout_fraction: float = setting(0.1, help="Share of the text held out for evaluation.", above=0, below=1)
    architecture: str = setting(
        "llama",
        help="The model class: a Llama, or a Pythia-style GPT-NeoX (25% partial "
        "rotary, parallel block; converted through PhiForCausalLM).",
        choices=DEMO_ARCHITECTURES,
    )

    def key(self) -> str:
        fields = asdict(self)
        if fields["architecture"] == "llama":  # the key of caches made before the choice existed
            del fields["architecture"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def cpython_text(heldout_fraction: float) -> tuple[str, str]:
    """(train, held-out) text: CPython's pydoc topics in sorted order, the last topics held out. Topics
    repeat passages of one another (the ``with`` statement's, for one), so held-out paragraphs that
    repeat a line of the training topics are dropped: the held-out text is really unseen."""
    from pydoc_data.topics import topics

    from mha2gqa.core.text_ref import compared_lines

    docs = [topics[k].strip() for k in sorted(topics)]
    total = sum(map(len, docs))
    train: list[str] = []
    size = 0
    while docs and size < total * (1 - heldout_fraction):
        size += len(docs[0])
        train.append(docs.pop(0))
    seen = compared_lines(train)
    unseen = [p for doc in docs for p in doc.split("\n\n") if not compared_lines([p]) & seen]
    return "\n\n".join(train), "\n\n".join(unseen)


def build_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE trained on ``text`` that prepends one BOS, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[1], pad_token=SPECIAL[2]
    )


def train_demo_model(folder: Path, settings: DemoSettings, log=print) -> Path:
    """Train the demo MHA model and save it (safetensors, config, tokenizer) into ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mha2gqa.core.output import staged_output

    train_text, _ = cpython_text(settings.heldout_fraction)
    torch.manual_seed(settings.seed)
    tokenizer = build_tokenizer(train_text, settings.vocab_size)
    ids = tokenizer(train_text, return_tensors="pt").input_ids[0]
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        max_position_embeddings=2 * settings.seq_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if settings.architecture == "gpt_neox":  # Pythia's choices: untied, 25% rotary, parallel residual
        extra = dict(tie_word_embeddings=False, rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu")
    else:
        extra = dict(num_key_value_heads=settings.num_heads, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.architecture, **shape, **extra))
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=settings.lr, total_steps=settings.steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(settings.seed)
    t0 = time.perf_counter()
    model.train()
    for step in range(settings.steps):
        check_signals()
        starts = torch.randint(0, ids.numel() - settings.seq_len - 1, (settings.batch_size,), generator=gen)
        batch = torch.stack([ids[s : s + settings.seq_len] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == settings.steps - 1:
            log(f"  step {step + 1:4d}/{settings.steps}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    with staged_output(folder, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "demo_settings.json").write_text(json.dumps(asdict(settings), indent=2) + "\n")
    return folder


def demo_model(settings: DemoSettings, rebuild: bool = False, log=print) -> Path:
    """The cached demo model folder, trained first if needed."""
    folder = cache_root() / f"demo-{settings.key()}" / "mha"
    if rebuild or not (folder / "model.safetensors").is_file():
        log(
            f"training the demo MHA model on CPython's pydoc topics ({settings.steps} steps, cached in {folder.parent})"
        )
        train_demo_model(folder, settings, log)
    return folder


def _text_file(settings: DemoSettings, name: str, part: int) -> Path:
    path = cache_root() / f"demo-{settings.key()}" / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(cpython_text(settings.heldout_fraction)[part], encoding="utf-8")
    return path


def heldout_file(settings: DemoSettings) -> Path:
    """The held-out pydoc topics as a text file beside the cached model (for ``--data``)."""
    return _text_file(settings, "heldout-unseen.txt", 1)  # (heldout.txt: before repeats were dropped)


def train_file(settings: DemoSettings) -> Path:
    """The training topics as a text file beside the cached model (calibration text)."""
    return _text_file(settings, "train.txt", 0)
