"""Training text tokenized once into token shards on disk, memory-mapped, cached by content.

The stream: one BOS (when the tokenizer has one), then every document's tokens, documents joined by
the tokens of a blank line. A document is tokenized in pieces (:func:`mha2gqa.core.text.text_pieces`,
at most 64 Ki characters each, cut at line breaks), read batch by batch from ``datasets``' memory-mapped
Arrow table, so building the store and reading it both take memory independent of the corpus size.

A store is a folder ``<cache>/<key>/`` named by the sha256 of what determines its tokens (the text's
bytes or ``datasets`` fingerprint, the tokenizer's files, the text settings)::

    tokens-00000.bin ...   raw little-endian token ids (uint16 when the vocabulary fits, else uint32)
    manifest.json          schema, key, material, dtype, [name, tokens, sha256] per shard (written last)

It is built in a temporary folder and published whole; opening it checks the manifest and every
shard's size, and each shard's sha256 is verified the first time this process reads it (a damaged
or tampered store is one line naming it, never wrong tokens). Window ``i`` of length ``L`` is tokens
``[i*L, i*L + L + 1)`` (inputs ``[:-1]``, targets ``[1:]``), exactly :func:`~mha2gqa.uptrain.data.pack_windows`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mha2gqa.core.cache import entry_name, file_sha256, locked
from mha2gqa.core.checkpoint import TOKENIZER_DEFINITION
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.output import staged_output
from mha2gqa.core.text import PIECE_CHARS, TextSource, text_pieces

SCHEMA = "mha2gqa.tokens/1"
MANIFEST = "manifest.json"
#: Tokens per shard file (256 MiB of uint32).
SHARD_TOKENS = 1 << 26
_BATCH_PIECES = 64  # pieces tokenized per call (fast tokenizers work on a batch in parallel)


def token_chunks(tokenizer, pieces: Iterable[tuple[int, str]]) -> Iterator[list[int]]:
    """The training stream of ``pieces`` (``(document number, text)``, from ``text_pieces``) as
    lists of token ids, in order; their concatenation is the stream."""
    if tokenizer.bos_token_id is not None:
        yield [tokenizer.bos_token_id]
    separator = tokenizer("\n\n", add_special_tokens=False, verbose=False)["input_ids"]
    last_doc = None
    batch: list[tuple[int, str]] = []

    def flush() -> Iterator[list[int]]:
        nonlocal last_doc
        ids = tokenizer([p for _, p in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for (doc, _), piece_ids in zip(batch, ids, strict=True):
            if last_doc is not None and doc != last_doc:
                yield separator
            last_doc = doc
            yield piece_ids
        batch.clear()

    for item in pieces:
        batch.append(item)
        if len(batch) == _BATCH_PIECES:
            yield from flush()
    if batch:
        yield from flush()


def stream_ids(tokenizer, source: str, text_field: str = "text", doc_split: str = "file") -> torch.Tensor:
    """The whole training stream in memory ``[N]`` int64: the reference the store is tested against."""
    chunks = token_chunks(tokenizer, text_pieces(source, text_field, doc_split))
    return torch.tensor([t for c in chunks for t in c], dtype=torch.long)


def tokens_key_material(tokenizer_folder: Path, source: str, text_field: str, doc_split: str) -> dict[str, Any]:
    """What determines a store's tokens: the text (a local file's sha256, a ``datasets`` name with its
    fingerprint), the tokenizer's files, the text settings and the piece rule."""
    path = Path(source).expanduser()
    if path.is_file():
        text: dict[str, Any] = {"file_sha256": file_sha256(path), "bytes": path.stat().st_size}
    else:
        from mha2gqa.core.text import open_source

        ds, _, _ = open_source(source, text_field, doc_split, "data")
        text = {"datasets": source, "fingerprint": ds._fingerprint}
    tokenizer = {
        name: file_sha256(tokenizer_folder / name)
        for name in TOKENIZER_DEFINITION
        if (tokenizer_folder / name).is_file()
    }
    return {
        "schema": SCHEMA,
        "text": text,
        "text_field": text_field,
        "doc_split": doc_split,
        "piece_chars": PIECE_CHARS,
        "tokenizer": tokenizer,
    }


@dataclass
class TokenStore:
    """An opened store: shards memory-mapped on first use, their checksums verified then."""

    folder: Path
    dtype: np.dtype
    shards: list[tuple[str, int, str]]  # (file name, tokens, sha256)
    vocab_size: int | None = None  # the model's: every id must be below it (checked with each shard)
    _starts: list[int] = field(default_factory=list)
    _maps: dict[int, np.memmap] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._starts = [0]
        for _, n, _ in self.shards:
            self._starts.append(self._starts[-1] + n)

    @property
    def total(self) -> int:
        """Tokens in the stream."""
        return self._starts[-1]

    def num_windows(self, seq_len: int) -> int:
        return max((self.total - 1) // seq_len, 0)

    def _shard(self, i: int) -> np.memmap:
        if i not in self._maps:
            name, n, digest = self.shards[i]
            path = self.folder / name
            if file_sha256(path) != digest:
                raise Mha2GqaError(
                    f"token cache {path}: its checksum does not match the manifest (damaged or changed); remove "
                    f"{self.folder} and run again to rebuild it"
                )
            ids = np.memmap(path, dtype=self.dtype, mode="r", shape=(n,))
            if self.vocab_size is not None and int(ids.max()) >= self.vocab_size:
                raise Mha2GqaError(
                    f"token cache {path}: it holds token id {int(ids.max())}, outside the model's vocabulary of "
                    f"{self.vocab_size} (written for another tokenizer, or edited); remove {self.folder} and run "
                    "again to rebuild it"
                )
            self._maps[i] = ids
        return self._maps[i]

    def tokens(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the stream (across shard boundaries), as int64."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while done < count:
            offset = start + done - self._starts[shard]
            take = min(count - done, self.shards[shard][1] - offset)
            out[done : done + take] = self._shard(shard)[offset : offset + take]
            done += take
            shard += 1
        return out

    def windows(self, indices: torch.Tensor, seq_len: int) -> torch.Tensor:
        """``[len(indices), seq_len + 1]`` windows (window ``i`` starts at token ``i * seq_len``)."""
        rows = [self.tokens(int(i) * seq_len, seq_len + 1) for i in indices]
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, seq_len + 1, dtype=torch.long)

    @classmethod
    def open(cls, folder: Path, vocab_size: int | None = None) -> TokenStore:
        """A published store, its manifest and shard sizes checked (one error naming it otherwise);
        with ``vocab_size``, each shard's ids are checked against it when the shard is first read."""
        path = folder / MANIFEST

        def bad(why: str) -> Mha2GqaError:
            return Mha2GqaError(f"token cache {path}: {why}; remove {folder} and run again to rebuild it")

        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise bad(f"not readable ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or manifest.get("key") != folder.name:
            raise bad("not a token cache of this version, or not of this folder")
        if manifest.get("dtype") not in ("uint16", "uint32"):
            raise bad("its dtype is not uint16 or uint32")
        shards = manifest.get("shards")
        ok = isinstance(shards, list) and shards and all(
            isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and "/" not in s[0] and s[0] != ".."
            and isinstance(s[1], int) and not isinstance(s[1], bool) and s[1] > 0 and isinstance(s[2], str)
            for s in shards
        )  # fmt: skip
        if not ok:
            raise bad("its list of shards is malformed")
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")  # written little-endian
        for name, n, _ in shards:
            file = folder / name
            if not file.is_file() or file.stat().st_size != n * dtype.itemsize:
                raise bad(f"{name} is missing or not {n * dtype.itemsize:,} bytes (truncated?)")
        return cls(folder, dtype, [tuple(s) for s in shards], vocab_size)


def build(folder: Path, chunks: Iterable[list[int]], vocab_size: int, material: dict[str, Any],
          shard_tokens: int = SHARD_TOKENS) -> TokenStore:  # fmt: skip
    """Write the stream of ``chunks`` as store ``folder`` (staged beside it, published whole); each
    chunk goes straight to its shard file, so memory holds one chunk at a time."""
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32).newbyteorder("<")
    with staged_output(folder, what="token cache") as tmp:
        shards: list[list[Any]] = []
        handle, digest, filled = None, hashlib.sha256(), 0

        def close() -> None:
            nonlocal handle, digest, filled
            if handle is not None:
                handle.close()
                shards.append([Path(handle.name).name, filled, digest.hexdigest()])
            handle, digest, filled = None, hashlib.sha256(), 0

        try:
            for chunk in chunks:
                ids = np.asarray(chunk, dtype=np.int64)
                if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                    raise Mha2GqaError(
                        f"the tokenizer produced id {int(ids.max())} outside the vocabulary ({vocab_size})"
                    )
                while ids.size:
                    if handle is None:
                        handle = open(tmp / f"tokens-{len(shards):05d}.bin", "wb")  # noqa: SIM115 (closed by close())
                    take = min(ids.size, shard_tokens - filled)
                    data = ids[:take].astype(dtype).tobytes()
                    handle.write(data)
                    digest.update(data)
                    filled, ids = filled + take, ids[take:]
                    if filled == shard_tokens:
                        close()
        finally:
            close()
        manifest = {"schema": SCHEMA, "key": folder.name, "material": material, "dtype": dtype.name,
                    "shards": shards, "tokens": sum(s[1] for s in shards)}  # fmt: skip
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return TokenStore.open(folder)


def token_store(
    root: Path,
    tokenizer,
    tokenizer_folder: Path,
    text: TextSource,
    log: Callable[[str], None] | None = None,
    shard_tokens: int = SHARD_TOKENS,
    vocab_size: int | None = None,
) -> TokenStore:
    """The store of ``text`` under ``root``: opened when it exists, else built once (runs sharing
    the cache wait for the first builder); ``vocab_size``: the model's, which every id must be below."""
    source, text_field, doc_split = text.source, text.text_field, text.doc_split
    material = tokens_key_material(tokenizer_folder, source, text_field, doc_split)
    key = entry_name(material)
    folder = root / key
    with locked(root, key, f"token cache {root}", f"waiting for another run tokenizing {source} into {folder}", log):
        if folder.exists():  # published whole, or not ours: opening checks which
            return TokenStore.open(folder, vocab_size)
        if log:
            log(f"tokenizing {source} into {folder} (once; later runs reuse it)")
        chunks = token_chunks(tokenizer, text_pieces(source, text_field, doc_split))
        built = build(folder, chunks, len(tokenizer), material, shard_tokens)
        built.vocab_size = vocab_size
        return built
