"""Calibration text the original writes itself (core/self_text.py): the same bytes for the same seed,
a stopped generation resumed to the same bytes, a damaged cache refused in one line naming the file,
the chat template's user turn as a start, the nucleus and the mix by hand, and the command's refusals."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import llama_with_tokenizer, story_text

from mha2gqa.cli import main
from mha2gqa.core import self_text as st
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.self_text import SelfTextSettings, mixed, nucleus, self_text

SMALL = SelfTextSettings(tokens=200, document_tokens=24, batch_size=4, device="cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("self-text")
    return str(llama_with_tokenizer(root / "mha", story_text(root / "t.txt"), max_positions=64))


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_text(model, tmp_path):
    a = self_text(model, SMALL, tmp_path / "a")
    b = self_text(model, SMALL, tmp_path / "b")
    c = self_text(model, SelfTextSettings(**{**SMALL.__dict__, "seed": 1}), tmp_path / "c")
    assert a.path.read_bytes() == b.path.read_bytes() and a.sha256 == b.sha256 and not a.reused
    assert c.path.read_bytes() != a.path.read_bytes()
    assert a.tokens >= SMALL.tokens and a.documents >= SMALL.batch_size
    again = self_text(model, SMALL, tmp_path / "a")
    assert again.reused and again.path == a.path


def test_a_stopped_generation_resumes_from_its_parts_to_the_same_bytes(model, tmp_path, monkeypatch):
    whole = self_text(model, SMALL, tmp_path / "whole")
    real, calls = st.write_batch, []

    def stop_at_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(st, "write_batch", stop_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        self_text(model, SMALL, tmp_path / "stopped")
    monkeypatch.setattr(st, "write_batch", real)
    (entry,) = [p for p in (tmp_path / "stopped").iterdir() if p.is_dir()]
    assert sorted(p.name for p in entry.glob("part-*.json")) == ["part-000000.json", "part-000001.json"]
    lines: list[str] = []
    resumed = self_text(model, SMALL, tmp_path / "stopped", log=lines.append)
    assert any("resuming" in line and "2 batch(es)" in line for line in lines)
    assert resumed.path.read_bytes() == whole.path.read_bytes()


@pytest.mark.parametrize("damage", ["text", "part", "record", "manifest"])
def test_a_damaged_cache_is_refused_in_one_line_naming_the_file(model, tmp_path, damage):
    written = self_text(model, SMALL, tmp_path)
    entry = written.path.parent
    target = {"text": st.TEXT, "part": "part-000000.txt", "record": "part-000001.json", "manifest": st.MANIFEST}[damage]
    path = entry / target
    if damage == "record":
        path.write_text('{"sha256": 3}')
    else:
        path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    if damage in ("part", "record"):  # a finished entry reads its text, not its parts: unfinish it
        (entry / st.MANIFEST).unlink()
    with pytest.raises(Mha2GqaError) as e:
        self_text(model, SMALL, tmp_path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message and "remove" in message


def test_a_rescaled_model_writes_the_same_text(model, tmp_path):
    """The text follows the function, not how its weights are written: the same model rescaled
    (exact powers of two, ``test_guard._rescaled``) writes the same bytes for the same seed."""
    from conftest import load, save
    from test_guard import _rescaled
    from transformers import AutoTokenizer

    m = load(model)
    _rescaled(m)
    other = save(m, tmp_path / "rescaled")
    AutoTokenizer.from_pretrained(model).save_pretrained(other)
    a, b = self_text(model, SMALL, tmp_path / "a"), self_text(str(other), SMALL, tmp_path / "b")
    assert a.path.read_bytes() == b.path.read_bytes() and a.tokens >= SMALL.tokens


def test_a_chat_template_gives_every_other_batch_a_user_turn_to_start_from(model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    assert st.starts(tok, chat=True) == [[tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]]
    tok.chat_template = "{% for m in messages %}<|user|> {{ m['content'] }}{% endfor %}"
    prefixes = st.starts(tok, chat=True)
    assert len(prefixes) == 2 and tok.decode(prefixes[1]).strip() == "<|user|>"
    assert st.starts(tok, chat=False) == prefixes[:1]


def test_a_budget_one_batch_could_fill_holds_both_starts(model, tmp_path):
    """Each start writes at most its share: without the cap the BOS batch alone filled a budget it
    could hold (SmolLM2 at `convert --self-text 0.25`: 10,249 tokens, no chat turn at all)."""
    import shutil

    chat = tmp_path / "chat-model"
    shutil.copytree(model, chat)
    (chat / "chat_template.jinja").write_text("{% for m in messages %}<|user|> {{ m['content'] }}{% endfor %}")
    s = SelfTextSettings(tokens=40, document_tokens=24, batch_size=4, device="cpu")  # one batch holds 96
    written = self_text(str(chat), s, tmp_path / "cache")
    parts = sorted(written.path.parent.glob("part-*.json"))
    counts = [json.loads(p.read_text())["tokens"] for p in parts]
    assert len(parts) >= 2 and max(counts) < 20 + s.batch_size, counts  # a batch stops within a step of its share
    second = (written.path.parent / "part-000001.txt").read_text()
    assert second.startswith("<|user|>") and "<|user|>" not in (written.path.parent / "part-000000.txt").read_text()


def test_the_nucleus_keeps_the_smallest_set_that_holds_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(4000, 1))
    g = torch.Generator().manual_seed(0)
    only_top = nucleus(logits, 1.0, 0.4, g)
    assert only_top.eq(0).all()  # 0.5 >= 0.4: the first token alone
    two = nucleus(logits, 1.0, 0.8, g)  # 0.5 + 0.3 reach 0.8: the first two, renormalized 5:3
    assert set(two.tolist()) == {0, 1} and abs(two.eq(0).float().mean().item() - 0.625) < 0.03
    every = nucleus(logits, 1.0, 1.0, g)  # the whole distribution, each token at its probability
    assert set(every.tolist()) == {0, 1, 2, 3} and abs(every.eq(3).float().mean().item() - 0.05) < 0.015
    hotter = nucleus(logits, 2.0, 1.0, g)  # temperature 2: probabilities as their square roots
    assert abs(hotter.eq(3).float().mean().item() - 0.05**0.5 / sum(p**0.5 for p in (0.5, 0.3, 0.15, 0.05))) < 0.02


@pytest.mark.parametrize("first", [1024, 8])
def test_the_nucleus_ranks_a_few_tokens_first_and_draws_what_ranking_all_would(first, monkeypatch):
    """Rows peaked and flat (a nucleus of one token to thousands): the tokens drawn are those of the set
    ranked over the whole vocabulary and the same uniform draws, whether a row's set lies within its
    first ranks or reaches past them (``RANK_FIRST`` 8)."""
    monkeypatch.setattr(st, "RANK_FIRST", first)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=g) * torch.linspace(0.05, 12, 64)[:, None]
    for top_p in (0.5, 0.95):
        drawn = nucleus(logits, 1.0, top_p, torch.Generator().manual_seed(1))
        u = torch.rand(64, generator=torch.Generator().manual_seed(1))
        probs, order = torch.softmax(logits, -1).sort(-1, descending=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
        cumulative = probs.cumsum(-1)
        at = (cumulative <= (u * cumulative[:, -1])[:, None]).sum(-1)
        assert torch.equal(drawn, order.gather(-1, at[:, None])[:, 0])
        assert probs.gt(0).sum(-1).max() > 8 and probs.gt(0).sum(-1).min() == 1  # (both kinds of row)


def test_the_mix_interleaves_at_its_share_and_ends_where_either_text_does(monkeypatch):
    monkeypatch.setattr(st, "PIECE", 1)  # (pieces of a document's size; PIECE's own test below)
    ours = st.SEPARATOR.join(["a" * 10] * 6)
    text, share = mixed(ours, "\n".join(["b" * 10] * 3), 0.5)  # a line each: pieces of whole lines
    assert text.strip().split(st.SEPARATOR) == ["a" * 10, "b" * 10] * 3 and share == pytest.approx(0.5)
    text, share = mixed(ours, "\n\n".join(["b" * 10] * 100), 0.25)  # paragraphs
    docs = text.strip().split(st.SEPARATOR)
    assert docs.count("a" * 10) == 6 and share == pytest.approx(0.25)
    assert docs[-4:].count("a" * 10) >= 1  # the end holds both kinds too
    text, _ = mixed(st.SEPARATOR.join(["a" * 30] * 2), "\n".join(["b" * 10] * 9), 0.5)
    assert text.strip().split(st.SEPARATOR)[1] == "\n".join(["b" * 10] * 3)  # pieces of a document's size


def test_the_users_text_comes_in_pieces_of_a_window_however_short_the_models_documents():
    """Documents of 10 characters, lines of 100: each piece of the user's text holds at least PIECE
    characters of it, in its own order, between the model's documents."""
    ours = st.SEPARATOR.join(["a" * 10] * 2000)
    user = "\n".join(f"{i:03d}" + "b" * 96 for i in range(200))
    docs = mixed(ours, user, 0.25)[0].strip().split(st.SEPARATOR)
    theirs = [d for d in docs if "b" in d]
    assert all(len(d) >= st.PIECE for d in theirs[:-1]) and "\n".join(theirs) == user[: len("\n".join(theirs))]
    assert docs.count("a" * 10) > len(theirs)  # (the model's documents between them)
    short = mixed(st.SEPARATOR.join(["a" * 10] * 40), user, 0.25)  # too little written for pieces of PIECE
    assert short[1] == pytest.approx(0.25, abs=0.05)


def test_the_command_writes_its_output_with_a_record_and_refuses_bad_input(model, tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    user = story_text(tmp_path / "user.txt", lines=80)
    out = tmp_path / "calibration.txt"
    args = ["self-text", model, str(out), "--tokens", "120", "--document-tokens", "16", "--batch-size", "4",
            "--device", "cpu", "-q"]  # fmt: skip
    result = CliRunner().invoke(main, [*args, "--mix", str(user), "--share", "0.3"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "calibration.txt.mha2gqa.json").read_text())
    import hashlib

    assert record["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest() and "mixed into" in result.output
    assert "the cat" in out.read_text()
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "exists" in again.output
    assert CliRunner().invoke(main, [*args, "--overwrite"]).exit_code == 0  # its own output: replaced
    other = tmp_path / "mine.txt"
    other.write_text("a user's own file")
    refused = CliRunner().invoke(main, ["self-text", model, str(other), "--overwrite", "-q"])
    assert refused.exit_code != 0 and "not written by mha2gqa" in refused.output
    foreign = tmp_path / "theirs.txt.mha2gqa.json"
    foreign.write_text("a user's own notes")  # where OUTPUT's record would go: refused before any work
    blocked = CliRunner().invoke(main, ["self-text", model, str(tmp_path / "theirs.txt"), "-q"])
    assert blocked.exit_code != 0 and "not written by mha2gqa" in blocked.output
    assert not (tmp_path / "theirs.txt").exists() and foreign.read_text() == "a user's own notes"
    missing = str(tmp_path / "none.txt")
    bad_inputs = ((["--share", "0.3"], "--mix"), (["--temperature", "0"], "--temperature"),
                  (["--top-p", "nan"], "--top-p"), (["--mix", missing], "no such file"))  # fmt: skip
    for bad, why in bad_inputs:
        r = CliRunner().invoke(main, ["self-text", model, str(tmp_path / "x.txt"), *bad])
        assert r.exit_code != 0 and why in r.output and "Traceback" not in r.output, (bad, r.output)
        assert not (tmp_path / "x.txt").exists()


def test_documents_fit_a_learned_position_table(tmp_path):
    """A GPT-2 with 64 positions: the default 512-token documents are cut to what its table holds
    (no IndexError), the text still written to its budget."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mha2gqa.demo import build_tokenizer

    text = story_text(tmp_path / "t.txt")
    tok = build_tokenizer(text.read_text(), 300)
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    written = self_text(str(folder), SelfTextSettings(tokens=300, batch_size=4, device="cpu"), tmp_path / "cache")
    assert written.tokens >= 300 and written.documents >= 300 // 63  # documents of at most 63 new tokens
    assert st._fitted(SelfTextSettings(), 64, 1).document_tokens == 63


class _Cache:
    """A stand-in KV cache: it only follows which rows are left."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows = len(indices)


class _AlwaysEos(torch.nn.Module):
    """A model that writes EOS (id 2) at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=True, cache=None):
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], 5), -30.0)
        logits[..., 2] = 30.0
        return {"logits": logits, "cache": cache or _Cache(input_ids.shape[0])}


def test_a_chat_turns_first_eos_closes_the_users_message_and_the_reply_is_written_too():
    s = SelfTextSettings(document_tokens=6, batch_size=3)
    g = torch.Generator().manual_seed(0)
    _, plain = st.write_batch(_AlwaysEos(), [1], s, g, 2, st.Writing(100))
    _, chat = st.write_batch(_AlwaysEos(), [1], s, g, 2, st.Writing(100, turns=2))
    assert plain.tolist() == [0, 0, 0] and chat.tolist() == [1, 1, 1]  # the user's EOS kept, the last not
