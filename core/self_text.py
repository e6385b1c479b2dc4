"""Calibration text the original model writes itself, alone or mixed with the user's text.

A conversion calibrated on one kind of text (WikiText, most often) keeps the original's behaviour on
that kind and loses more elsewhere. The model's own samples cover what it knows (LLM-QAT's data-free
recipe): each document starts from the model's own distribution, not from a fixed prompt (a BOS
token, else EOS: the first token is sampled from what the model writes first), and, where the
tokenizer has a chat template, every other batch starts where the template opens a user turn, so an
instruct model writes both sides of a conversation; no batch writes more than its start's share of
the budget, so a budget one batch could fill holds both kinds. Sampling is seeded, with a temperature and
nucleus (top-p) cut, batched with the KV cache, in bfloat16 where the device computes it natively; a
document ends at EOS or its token budget.

An entry is a folder ``<cache>/self-text/<key>`` (the key: a hash of the model's identity, the
settings, the device and dtype and the library versions), written batch by batch:
``part-<n>.txt`` and its record ``part-<n>.json`` (the part's sha256 and tokens, written after it), then
``text.txt`` and the manifest (its sha256), last. A stopped generation resumes from its recorded
parts; the same seed gives the same bytes on the same machine (threads pinned: the last bits of a
forward can move a sample). Every file is checked against its record when it is read: a damaged one
is refused in one line naming it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mha2gqa.core.devices import DEVICE_HELP
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.settings import setting, validate

if TYPE_CHECKING:
    import torch

SCHEMA = "mha2gqa.self_text/1"
#: The sampler's version, in the cache key: a change to how tokens are drawn writes new entries.
SAMPLER = 7
MANIFEST = "mha2gqa_self_text.json"
TEXT = "text.txt"
#: a mix's text file (:func:`mix_file`)
MIX = "calibration-mix.txt"
#: What separates documents in the text file (a blank line: a paragraph break for ``--doc-split``).
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class SelfTextSettings:
    """How the original writes its own calibration text (``mha2gqa self-text``)."""

    tokens: int = setting(16384, help="Tokens the model writes in all.", minimum=1)
    seed: int = setting(0, help="Seed of the sampling: the same seed writes the same text.", minimum=0,
                        maximum=2**31 - 1)  # fmt: skip
    temperature: float = setting(1.0, help="Sampling temperature.", above=0, maximum=10)
    top_p: float = setting(0.95, help="Nucleus sampling: the smallest set of tokens of this mass.", above=0, maximum=1)
    document_tokens: int = setting(512, help="Most tokens of one document (it ends sooner at EOS).", minimum=8)
    batch_size: int = setting(64, help="Documents written at once.", minimum=1)
    chat: bool = setting(True, help="Where the tokenizer has a chat template, start every other batch at a user turn.")
    mix: str | None = setting(
        None, help="The user's text to mix the written text into (a file or a datasets name); none: alone."
    )
    share: float = setting(
        0.5,
        help="Share of the written text in the mix (by characters); the mix ends where either text does.",
        above=0,
        below=1,
    )
    text_field: str = setting("text", help="Field holding the text of --mix in .jsonl/.parquet/datasets sources.")
    device: str = setting("auto", help=DEVICE_HELP)

    def check(self) -> SelfTextSettings:
        from mha2gqa.core.devices import check_device_name
        from mha2gqa.core.errors import SettingError
        from mha2gqa.core.text import check_text_source

        validate(self)
        check_device_name(self.device)
        check_text_source(self.mix, "mix")
        if self.share != 0.5 and self.mix is None:
            raise SettingError("share", "{name} is the written text's share of --mix: give --mix TEXT too")
        return self

    def sampling(self) -> dict[str, Any]:
        """What decides the written text (its cache key's part), without the mix."""
        keys = ("tokens", "seed", "temperature", "top_p", "document_tokens", "batch_size", "chat")
        return {k: getattr(self, k) for k in keys}


# -- sampling ---------------------------------------------------------------------------------------
def starts(tokenizer, chat: bool) -> list[list[int]]:
    """The prefixes documents start from: the BOS token (else EOS), and where ``chat`` and the tokenizer
    has a chat template, the template's text up to a user turn's content."""
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if first is None:
        raise Mha2GqaError("the tokenizer has neither a BOS nor an EOS token to start a document from")
    out = [[int(first)]]
    if chat and getattr(tokenizer, "chat_template", None):
        marker = "\u2063mha2gqa\u2063"
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
        except Exception:  # a template that needs more than one user turn: documents from BOS only
            return out
        if marker in rendered:
            ids = tokenizer(rendered.split(marker)[0], add_special_tokens=False)["input_ids"]
            if ids:
                out.append([int(i) for i in ids])
    return out


#: tokens ranked first for each row (:func:`nucleus`); a row whose nucleus reaches past them is ranked again
#: on all its candidates (SmolLM2 at 1.0, top-p 0.95: a median nucleus of some hundreds of its 49K tokens)
RANK_FIRST = 1024


def nucleus(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]``: sampled at ``temperature`` from the smallest set of
    tokens whose probability reaches ``top_p`` (the most likely token always in it), by the inverse of
    the set's cumulative distribution at one uniform draw a row (from ``generator``). Each row ranks its
    :data:`RANK_FIRST` most likely tokens, and only a row whose set reaches past them ranks its tokens
    of probability at least ``(1 - top_p) / V``: those below hold less than ``1 - top_p`` together, so
    none of them is in the set (the same set as ranking all); at ``top_p`` 1 each token is drawn at its
    probability, unranked."""
    import torch

    probs = torch.softmax(logits.float() / temperature, -1)
    u = torch.rand(probs.shape[0], generator=generator).to(probs.device)
    if top_p >= 1:  # the whole distribution: nothing to rank (nor a float sum near 1 to cut the tail)
        return _inverse(probs, u)
    k = max(1, int((probs >= (1 - top_p) / probs.shape[-1]).sum(-1).max()))
    out, short = _ranked_draw(probs, min(k, RANK_FIRST), top_p, u)
    if k > RANK_FIRST and short.any():  # rows whose set reaches past the first ranks: all their candidates
        out[short] = _ranked_draw(probs[short], k, top_p, u[short])[0]
    return out


def _ranked_draw(probs: torch.Tensor, k: int, top_p: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B] tokens, [B] whether a row's top ``k`` hold less than ``top_p``)``: each row of ``probs``
    ``[B, V]`` ranked to its ``k`` most likely, cut after the first that reach ``top_p``, drawn at ``u``."""
    ranked, order = probs.topk(k, -1)
    cut = ranked.masked_fill(ranked.cumsum(-1) - ranked >= top_p, 0.0)
    return order.gather(-1, _inverse(cut, u)[:, None])[:, 0], ranked.sum(-1) < top_p


def _inverse(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The column of each row of ``weights`` ``[B, k]`` (non-negative) where its cumulative sum passes
    ``u`` ``[B]`` (uniform in [0, 1)) times its total: a draw at each column's share of the row."""
    import torch

    cumulative = weights.cumsum(-1)
    at = torch.searchsorted(cumulative, (u * cumulative[:, -1])[:, None], right=True)[:, 0]
    last = (cumulative < cumulative[:, -1:]).sum(-1)  # the column that reaches the total (a rounded u: no further)
    return torch.minimum(at, last)


def write_batch(
    model, prefix: list[int], s: SelfTextSettings, generator: torch.Generator, eos: int | None, write: Writing
):
    """``s.batch_size`` documents from ``prefix``, each up to ``s.document_tokens`` new tokens (EOS ends
    one; a finished document leaves the batch and its KV cache), with the KV cache, until ``write``'s
    budget of tokens is written: ``[B, P + s.document_tokens]`` ids and ``[B]`` the new tokens of each
    (EOS not counted). ``write.on_step(n)`` hears the tokens each step added (the progress bar)."""
    import torch

    with torch.inference_mode():
        return _write_batch(model, prefix, s, generator, eos, write)


@dataclass(frozen=True)
class Writing:
    """What one batch may write (``budget`` tokens), who hears each step (``on_step``), and the EOS
    tokens that end a document (``turns``: 2 from a chat turn, whose first EOS closes the user's
    message, so the model writes the reply too)."""

    budget: int
    on_step: Callable[[int], object] | None = None
    turns: int = 1


def _write_batch(model, prefix: list[int], s: SelfTextSettings, generator, eos: int | None, write: Writing):
    import torch

    device = next(model.parameters()).device
    name = _cache_arg(model)
    out = model(input_ids=torch.tensor([prefix] * s.batch_size, device=device), use_cache=True)
    rows = torch.arange(s.batch_size, device=device)  # the documents still being written
    written = torch.full((s.batch_size, s.document_tokens), eos if eos is not None else 0, dtype=torch.long)
    lengths = torch.zeros(s.batch_size, dtype=torch.long)
    seen = torch.zeros(s.batch_size, dtype=torch.long, device=device)  # each document's EOS so far
    for step in range(s.document_tokens):
        token = nucleus(out["logits"][:, -1], s.temperature, s.top_p, generator)
        if eos is not None:
            seen[rows] += token == eos
        live = seen[rows] < write.turns  # (an EOS before the last one is the document's own)
        written[rows.cpu(), step] = token.cpu()
        lengths[rows[live].cpu()] += 1
        if write.on_step is not None:
            write.on_step(int(live.sum()))
        if not bool(live.any()) or int(lengths.sum()) >= write.budget:
            break
        cache = _cache_of(out)
        if not bool(live.all()):  # finished documents leave the batch
            cache.batch_select_indices(live.nonzero()[:, 0])
            rows, token = rows[live], token[live]
        out = model(input_ids=token[:, None], **{name: cache}, use_cache=True)
    ids = torch.cat([torch.tensor([prefix] * s.batch_size), written], 1)
    return ids, lengths


def _cache_arg(model) -> str:
    """The name ``model``'s forward takes its KV cache by (``cache`` in newer transformers)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    """The KV cache a forward returned (``cache``, ``past_key_values`` before)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def documents(tokenizer, ids: torch.Tensor, lengths: torch.Tensor, prefix: int) -> list[str]:
    """The text of each written document: its prefix (kept where it is a chat turn, so the template's
    markup is in the text as the model read it) and its new tokens before EOS."""
    out = []
    for row, n in zip(ids.tolist(), lengths.tolist(), strict=True):
        kept = row[: prefix + n] if prefix > 1 else row[prefix : prefix + n]
        text = tokenizer.decode(kept, skip_special_tokens=prefix <= 1).strip()
        if text:
            out.append(text)
    return out


# -- the cache entry --------------------------------------------------------------------------------
@dataclass
class Entry:
    """One entry's folder, with its files checked as they are read."""

    folder: Path

    def damaged(self, name: str, why: str) -> Mha2GqaError:
        return Mha2GqaError(
            f"self-text cache {self.folder / name}: {why}; remove {self.folder} and run again to rewrite it"
        )

    def record(self, name: str) -> dict[str, Any]:
        """A JSON record of the entry (a part's or the manifest), refused unless it is one of ours."""
        try:
            data = json.loads((self.folder / name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            raise self.damaged(name, "it is not a readable JSON record") from None
        ok = isinstance(data, dict) and isinstance(data.get("sha256"), str) and isinstance(data.get("tokens"), int)
        if not ok or isinstance(data["tokens"], bool) or data["tokens"] < 0:
            raise self.damaged(name, "it is not a record of this tool's (sha256 and tokens)")
        return data

    def text(self, name: str, sha256: str) -> str:
        """The text file ``name``, refused unless its bytes have ``sha256``."""
        try:
            data = (self.folder / name).read_bytes()
        except OSError as e:
            raise self.damaged(name, f"it cannot be read ({e.strerror or e})") from None
        if hashlib.sha256(data).hexdigest() != sha256:
            raise self.damaged(name, f"its content changed since it was written ({len(data):,} bytes)")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.damaged(name, "it is not UTF-8 text") from None

    def write(self, name: str, data: str) -> None:
        from mha2gqa.core.output import replace_own_file

        replace_own_file(self.folder / name, data)

    def parts(self) -> Iterator[tuple[int, str, int]]:
        """The recorded parts in order, ``(index, text, tokens)``, each checked; stops at the first
        part without a record (one a stop interrupted: written again)."""
        n = 0
        while (self.folder / f"part-{n:06d}.json").is_file():
            record = self.record(f"part-{n:06d}.json")
            yield n, self.text(f"part-{n:06d}.txt", record["sha256"]), record["tokens"]
            n += 1


def writing_dtype(device: torch.device) -> torch.dtype:
    """What the model writes in: bfloat16 where ``device`` computes it natively (a GPU, a CPU with
    AVX512-BF16 or AMX: SmolLM2-135M writes 1.44x as many tokens a second on 2 such cores,
    benchmarks/self_text_speed.py), else float32."""
    import torch

    from mha2gqa.core.models import computes_bf16

    return torch.bfloat16 if computes_bf16(device) else torch.float32


def _material(model: str, folder: Path, s: SelfTextSettings, device: torch.device, dtype: torch.dtype) -> dict:
    import torch

    from mha2gqa.core.cache import computed_with, model_identity

    return {"schema": SCHEMA, "sampler": SAMPLER, "model": model_identity(model, folder), "sampling": s.sampling(),
            "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads(),
            "versions": computed_with()}  # fmt: skip


@dataclass(frozen=True)
class Written:
    """A finished entry: its text file, sha256, tokens and documents, and whether it was reused."""

    path: Path
    sha256: str
    tokens: int
    documents: int
    reused: bool


def self_text(model: str, s: SelfTextSettings, root: Path | None = None, log: Callable[[str], None] | None = None,
              progress: bool = False) -> Written:  # fmt: skip
    """The text ``model`` (a folder or hub id) writes under ``s``: the cached entry under ``root``
    (default ``<cache>/self-text``) when it is complete (checked), else written now, resumed from the
    parts a stopped run recorded (under the entry's lock: runs sharing a cache write it once)."""
    from mha2gqa.core.cache import cache_root, entry_name, locked
    from mha2gqa.core.checkpoint import resolve_folder
    from mha2gqa.core.models import resolve_device

    device = resolve_device(s.device)
    dtype = writing_dtype(device)
    folder = resolve_folder(model, None, False)[0]
    material = _material(model, folder, s, device, dtype)
    root = Path(root) if root is not None else cache_root() / "self-text"
    key = entry_name(material)
    entry = Entry(root / key)
    with locked(root, key, f"self-text cache {root}", f"waiting for another run writing {entry.folder}", log):
        found = _finished(entry, key)
        if found is not None:
            if log:
                log(f"self-text: reusing {found.path} ({found.tokens:,} tokens)")
            return found
        entry.folder.mkdir(parents=True, exist_ok=True)
        (entry.folder / "material.json").write_text(json.dumps(material, indent=1) + "\n", encoding="utf-8")
        return _write(model, entry, key, s, (device, dtype), log, progress)


def _finished(entry: Entry, key: str) -> Written | None:
    """The complete entry (manifest and text checked), or None where it has no manifest yet."""
    if not (entry.folder / MANIFEST).is_file():
        return None
    manifest = entry.record(MANIFEST)
    if manifest.get("schema") != SCHEMA or manifest.get("key") != key or not isinstance(manifest.get("documents"), int):
        raise entry.damaged(MANIFEST, "its schema or key does not match its folder")
    entry.text(TEXT, manifest["sha256"])
    return Written(entry.folder / TEXT, manifest["sha256"], manifest["tokens"], manifest["documents"], True)


def _fitted(s: SelfTextSettings, positions: int | None, prefix: int) -> SelfTextSettings:
    """``s`` with documents no longer than the model's ``positions`` leave after the longest ``prefix``
    (a learned position table has no row past them; a rotary model was not trained past them)."""
    import dataclasses

    if positions is None or s.document_tokens + prefix <= positions:
        return s
    if positions - prefix < 8:
        raise Mha2GqaError(
            f"the model reads {positions} positions: too few to write documents from a {prefix}-token start"
        )
    return dataclasses.replace(s, document_tokens=positions - prefix)


def _write(model: str, entry: Entry, key: str, s: SelfTextSettings, place, log, progress: bool) -> Written:
    """Write (or finish) the entry: batch after batch until ``s.tokens`` are written, then the text
    and its manifest."""
    import torch

    from mha2gqa.core.dims import max_positions
    from mha2gqa.core.models import load_model, load_tokenizer
    from mha2gqa.core.progress import bar as progress_bar
    from mha2gqa.core.signals import check as check_signals

    texts, tokens = [], 0
    for _, text, n in entry.parts():
        texts.append(text)
        tokens += n
    if log and texts:
        log(f"self-text: resuming {entry.folder} after {len(texts)} batch(es), {tokens:,} tokens")
    loaded = load_model(model, *place)
    tokenizer = load_tokenizer(Path(loaded.folder))
    prefixes = starts(tokenizer, s.chat)
    s = _fitted(s, max_positions(loaded.model.config), max(map(len, prefixes)))
    eos = tokenizer.eos_token_id
    bar = progress_bar(total=s.tokens, initial=min(tokens, s.tokens), unit="tok", unit_scale=True,
                       desc="self-text", disable=not progress)  # fmt: skip
    started, fresh = time.perf_counter(), 0
    with bar:
        while tokens < s.tokens:
            check_signals()
            n = len(texts)
            generator = torch.Generator().manual_seed(s.seed * 1_000_003 + n)
            prefix = prefixes[n % len(prefixes)]
            turns = 1 if n % len(prefixes) == 0 else 2  # (the first start is BOS, the second a chat turn)
            budget = min(s.tokens - tokens, -(-s.tokens // len(prefixes)))  # every start its share
            ids, lengths = write_batch(loaded.model, prefix, s, generator, eos, Writing(budget, bar.update, turns))
            text = SEPARATOR.join(documents(tokenizer, ids, lengths, len(prefix)))
            entry.write(f"part-{n:06d}.txt", text)
            record = {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "tokens": int(lengths.sum())}
            entry.write(f"part-{n:06d}.json", json.dumps(record) + "\n")
            texts.append(text)
            tokens, fresh = tokens + record["tokens"], fresh + record["tokens"]
            bar.set_postfix_str(f"{fresh / max(time.perf_counter() - started, 1e-9):,.0f} tok/s", refresh=False)
    body = SEPARATOR.join(t for t in texts if t) + "\n"
    entry.write(TEXT, body)
    sha = hashlib.sha256(body.encode("utf-8")).hexdigest()
    count = sum(len([d for d in t.split(SEPARATOR) if d]) for t in texts)
    manifest = {"schema": SCHEMA, "key": key, "sha256": sha, "tokens": tokens, "documents": count}
    entry.write(MANIFEST, json.dumps(manifest, indent=1) + "\n")
    if log:
        log(f"self-text: {tokens:,} tokens in {count:,} documents written to {entry.folder / TEXT} "
            f"({fresh / max(time.perf_counter() - started, 1e-9):,.0f} tok/s)")  # fmt: skip
    return Written(entry.folder / TEXT, sha, tokens, count, False)


# -- the mix ----------------------------------------------------------------------------------------
#: the fewest characters of the user's text kept together in a mix (about a calibration window of
#: English prose, 512 tokens): a window the stages read holds a stretch of the user's text as written,
#: its references back within reach, beside the model's documents
PIECE = 2048
#: the fewest pieces of the user's text a mix holds (a short written text takes shorter pieces, so its
#: share stays what was asked)
PIECES = 8
#: how a mix is made, in its cache key: another rule writes another entry
MIXING = 2


def mixed(written: str, user: str, share: float) -> tuple[str, float]:
    """The written text's documents and pieces of the user's text ``user`` (whole lines, of
    :func:`_piece_size` each, whatever its layout: paragraphs or a line each) interleaved, one kind
    after the other as each falls behind its share of the characters (``share``: the written text's),
    until one kind runs out (the user's pieces then until the share is met): every stretch of the text
    holds both at that share, its end too (where the stage guard's held-out windows are cut). Returns
    the text and the written share it has."""
    ours = [d for d in written.split(SEPARATOR) if d.strip()]
    theirs = _pieces(user, _piece_size(ours, share))
    out, have, i, j = [], [0, 0], 0, 0
    while j < len(theirs) and (i < len(ours) or have[0] > share * sum(have)):
        if i < len(ours) and have[0] <= share * sum(have):
            out.append(ours[i])
            have[0], i = have[0] + len(ours[i]), i + 1
        else:
            out.append(theirs[j])
            have[1], j = have[1] + len(theirs[j]), j + 1
    return SEPARATOR.join(out) + "\n", have[0] / max(sum(have), 1)


def _piece_size(ours: list[str], share: float) -> int:
    """The fewest characters of a piece of the user's text beside the written documents ``ours``:
    :data:`PIECE`, or less where the written text would then meet fewer than :data:`PIECES` of them at
    ``share``, and never less than a written document's mean length."""
    held = sum(map(len, ours))
    return max(held // max(len(ours), 1), min(PIECE, int(held * (1 - share) / share) // PIECES))


def _pieces(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of whole lines, each at least ``size`` characters (the last may be shorter)."""
    out, current, held = [], [], 0
    for line in text.splitlines():
        if line.strip():
            current.append(line)
            held += len(line) + 1
        if held >= max(size, 1):
            out.append("\n".join(current).strip())
            current, held = [], 0
    if current:
        out.append("\n".join(current).strip())
    return [p for p in out if p]


def mix_file(written: Written, user: str, share: float, root: Path | None = None) -> tuple[Path, float, str]:
    """:func:`mixed` of the ``written`` entry's text and ``user`` at ``share``, as a cache entry of its own
    (``<root>/mix-<key>/calibration-mix.txt``, the key: the written text's sha256, the user text's and the share;
    its record checked on every read, like the written parts): ``(its path, the written share it has,
    its sha256)``. The same inputs give the same file, written once."""
    from mha2gqa.core.cache import cache_root, entry_name, locked

    user_sha = hashlib.sha256(user.encode("utf-8")).hexdigest()
    root = Path(root) if root is not None else cache_root() / "self-text"
    key = "mix-" + entry_name(
        {"schema": SCHEMA, "mixing": MIXING, "written": written.sha256, "user": user_sha, "share": share}
    )
    entry = Entry(root / key)
    with locked(root, key, f"self-text cache {root}"):
        if (entry.folder / MANIFEST).is_file():
            record = entry.record(MANIFEST)
            entry.text(MIX, record["sha256"])
            kept = record.get("share")
            if not isinstance(kept, float) or not 0 < kept < 1:
                raise entry.damaged(MANIFEST, "its share is not a number between 0 and 1")
            return entry.folder / MIX, kept, record["sha256"]
        body, got = mixed(written.path.read_text(encoding="utf-8"), user, share)
        sha = hashlib.sha256(body.encode("utf-8")).hexdigest()
        entry.folder.mkdir(parents=True, exist_ok=True)
        entry.write(MIX, body)
        entry.write(MANIFEST, json.dumps({"sha256": sha, "tokens": written.tokens, "share": got}, indent=1) + "\n")
        return entry.folder / MIX, got, sha
