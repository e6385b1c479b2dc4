"""Evaluation harness: protocols against naive references, identity checks, attention capture
for every family, bad input, results schema."""

import json
import math
from dataclasses import fields

import pytest
import torch
from click.testing import CliRunner
from conftest import FAMILY_CONFIGS, FIXTURES, eval_argv, eval_error, random_model, requires_fixtures, save, tiny_config

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.capture import capturing, softcap_of
from mha2gqa.core.errors import SettingError
from mha2gqa.core.families import families
from mha2gqa.eval.attention import _log_attention, _scores_mask, attention_similarity
from mha2gqa.eval.harness import evaluate
from mha2gqa.eval.perplexity import IGNORE, disjoint_windows, rolling_windows, score_windows, stride_windows
from mha2gqa.eval.settings import EvalSettings


@pytest.fixture(scope="module")
def llama():
    return random_model(tiny_config("llama", max_position_embeddings=128))


def naive_ppl(model, ids, seq_len):
    """The fixtures README's loop: model(x, labels=x).loss per disjoint window."""
    nll = n = 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, seq_len):
            x = ids[s : s + seq_len][None]
            if x.shape[1] < 2:
                break
            nll += model(x, labels=x).loss.item() * (x.shape[1] - 1)
            n += x.shape[1] - 1
    return math.exp(nll / n), n


def test_disjoint_equals_the_naive_loop(llama):
    ids = torch.randint(0, 96, (1000,), generator=torch.Generator().manual_seed(1))
    ours = score_windows([llama], disjoint_windows(ids, 64), batch_size=4)
    ref, n = naive_ppl(llama, ids, 64)
    assert ours.tokens == n == 1000 - math.ceil(1000 / 64)
    assert math.isclose(math.exp(ours.nll_sum[0] / ours.tokens), ref, rel_tol=1e-5)


def test_stride_equal_to_window_is_disjoint(llama):
    ids = torch.randint(0, 96, (700,), generator=torch.Generator().manual_seed(2))
    a = score_windows([llama], stride_windows(ids, 64, 64))
    b = score_windows([llama], disjoint_windows(ids, 64))
    assert (a.tokens, a.windows) == (b.tokens, b.windows) and math.isclose(a.nll_sum[0], b.nll_sum[0], rel_tol=1e-9)


def test_stride_scores_each_token_once_after_the_first():
    ids = torch.arange(100)
    windows = stride_windows(ids, 32, 8)
    scored = torch.cat([t[t != IGNORE] for _, t in windows])
    assert scored.tolist() == list(range(1, 100))
    assert all(w.numel() <= 32 for w, _ in windows)


def lm_eval_rolling(token_list, prefix_token, max_seq_len, context_len=1):
    """lm-evaluation-harness utils.get_rolling_token_windows + make_disjoint_window (verbatim logic)."""
    pred_len = max_seq_len - context_len + 1
    predicted = 0
    first_seq_len = min(max_seq_len, len(token_list))
    out = [([prefix_token, *token_list[: first_seq_len - 1]], token_list[:first_seq_len])]
    predicted += first_seq_len
    while predicted < len(token_list):
        window_pred_len = min(len(token_list) - predicted, pred_len)
        window_end = predicted + window_pred_len
        out.append(
            (
                token_list[window_end - max_seq_len - 1 : window_end - 1],
                token_list[window_end - window_pred_len : window_end],
            )
        )
        predicted += window_pred_len
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in out]


@pytest.mark.parametrize(("n", "seq_len"), [(1, 8), (7, 8), (8, 8), (9, 8), (50, 8), (100, 16), (33, 32)])
def test_rolling_windows_match_lm_eval_and_score_every_token_once(n, seq_len):
    tokens = list(range(10, 10 + n))
    ours = rolling_windows(tokens, 1, seq_len)
    scored = [int(x) for _, t in ours for x in t[t != IGNORE]]
    assert scored == tokens
    assert all(w.numel() <= seq_len for w, _ in ours)
    for (inp, tgt), (ctx, cont) in zip(ours, lm_eval_rolling(tokens, 1, seq_len), strict=True):
        full = ctx + cont
        assert inp.tolist() == full[:-1][-seq_len:]
        assert tgt[tgt != IGNORE].tolist() == cont


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_capture_rebuilds_each_layers_attention_output_exactly(family):
    """The q/k/v, scaling and mask the recorder sees reproduce the model's own attention output,
    for every family (biases, q/k norms, partial rotary, explicit head_dim, fused qkv)."""
    model = random_model(tiny_config(family))
    checked = []

    def recorder(call):
        layer, q, k, v, mask, scaling, window, output, module = (getattr(call, f.name) for f in fields(call))
        heads = q.shape[1]
        k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
        allowed = _scores_mask(mask, slice(0, q.shape[2]), q.shape[2], window, q.device)
        out = torch.matmul(_log_attention(q, k, allowed, scaling, softcap_of(module)).exp(), v.float()).transpose(1, 2)
        torch.testing.assert_close(out, output.float(), atol=1e-5, rtol=1e-4)
        checked.append(layer)

    before = model.config._attn_implementation
    with torch.no_grad(), capturing(model, recorder):
        model(torch.randint(3, 90, (2, 24)))
    if not families()[family].attention_interface:  # Falcon: nothing to see, and eval says so
        assert checked == []
        return
    assert checked == list(range(model.config.num_hidden_layers))
    assert model.config._attn_implementation == before


def test_identity_gives_zero_divergence(llama, tmp_path):
    batch = torch.randint(3, 90, (1, 48))
    same = attention_similarity(llama, llama, batch, chunk=16).summary
    assert abs(same.mean_kl) < 1e-6 and abs(same.mean_js) < 1e-6 and same.mean_output_rel_error < 1e-6
    assert math.isclose(same.mean_cosine, 1, abs_tol=1e-6) and math.isclose(same.mean_hidden_cosine, 1, abs_tol=1e-6)
    assert same.mean_entropy_original == same.mean_entropy_converted < same.entropy_uniform
    assert math.isclose(same.entropy_uniform, sum(math.log(i + 1) for i in range(48)) / 48, rel_tol=1e-9)


def write_text(path, n_words=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat", "and", "ran"]
    idx = torch.randint(0, len(words), (n_words,), generator=g).tolist()
    text = "\n\n".join(" ".join(words[i] for i in idx[j : j + 50]) for j in range(0, n_words, 50))
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory):
    """A tiny Llama with a real tokenizer (from the fixtures when present, else byte-level BPE)."""
    from mha2gqa.demo import build_tokenizer

    root = tmp_path_factory.mktemp("pair")
    text = write_text(root / "text.txt")
    tok = build_tokenizer(text.read_text(), 300)
    model = random_model(tiny_config("llama", vocab_size=len(tok), max_position_embeddings=64, attention_bias=False))
    src = save(model, root / "mha")
    tok.save_pretrained(src)
    same = convert_checkpoint(src, root / "g4", 4, progress=False).output
    pooled = convert_checkpoint(src, root / "g2", 2, progress=False).output
    return src, same, pooled, text


def test_model_against_itself_and_its_exact_conversion(trained_pair):
    src, same, _, text = trained_pair
    for other in (src, same):
        r = evaluate(str(src), str(other), EvalSettings(data=str(text), seq_len=64, max_tokens=1500, progress=False))
        assert r.agreement.kl.max < 1e-5 and r.agreement.top1_agreement == 1.0
        assert abs(r.agreement.nll_delta) < 1e-6
        assert abs(r.attention.summary.mean_kl) < 1e-5
        assert math.isclose(r.protocols["disjoint"].ppl_ratio, 1.0, rel_tol=1e-6)


def test_mean_pooled_conversion_diverges_and_results_follow_the_schema(trained_pair, tmp_path):
    src, _, pooled, text = trained_pair
    out = tmp_path / "results.json"
    options = "--protocol disjoint --protocol stride --protocol rolling --doc-split paragraph"
    result = CliRunner().invoke(main, eval_argv(src, pooled, text, 64, 1500, "--output", out, options=options))
    assert result.exit_code == 0, result.output
    assert "agreement: KL mean" in result.stdout and "ratio" in result.stdout
    r = json.loads(out.read_text())
    assert r["schema"] == "mha2gqa.eval/1"
    assert set(r["protocols"]) == {"disjoint", "stride", "rolling"}
    assert r["agreement"]["kl"]["mean"] > 0 and r["agreement"]["top1_agreement"] < 1
    s = r["attention"]["summary"]
    assert s["mean_kl"] > 0 and s["mean_js"] > 0 and s["mean_output_rel_error"] > 0
    assert len(r["attention"]["layers"]) == 2 and len(r["attention"]["layers"][0]["heads"]) == 4
    rolling = r["protocols"]["rolling"]
    assert rolling["original"]["bits_per_byte"] == pytest.approx(
        rolling["original"]["nll_sum"] / rolling["settings"]["bytes"] / math.log(2)
    )
    assert r["models"]["converted"]["conversion"]["num_kv_heads_after"] == 2
    assert r["data"]["stream_tokens"] == 1500 and r["settings"]["stride"] == 32
    for key in ("versions", "device", "tokenizer", "git_revision", "seconds"):
        assert key in r


def test_jsonl_and_parquet_sources(trained_pair, tmp_path):
    src, _, _, text = trained_pair
    docs = text.read_text().split("\n\n")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet")
    ppl = []
    for f in ("d.jsonl", "d.parquet"):
        r = evaluate(
            str(src),
            None,
            EvalSettings(data=str(tmp_path / f), text_field="body", seq_len=64, max_tokens=600, progress=False),
        )
        ppl.append(r.protocols["disjoint"].original.ppl)
        assert r.data.documents == len(docs)
    assert ppl[0] == ppl[1]


def test_bad_inputs_are_one_line_errors(trained_pair, tmp_path):
    src, _, pooled, text = trained_pair
    assert "no such file" in eval_error("--original", src, "--data", tmp_path / "missing.txt")
    assert "cannot load it with datasets" in eval_error("--original", src, "--data", "no_such_dataset_xyz:test")
    assert "not a file, and not a datasets name" in eval_error("--original", src, "--data", "plainword")
    short = tmp_path / "short.txt"
    short.write_text("alpha beta")
    assert "fewer than one window of 64" in eval_error("--original", src, "--data", short, "--seq-len", "64")
    assert "longer than the model's 64 positions" in eval_error("--original", src, "--data", text, "--seq-len", "65")
    other = tmp_path / "other"
    import shutil

    shutil.copytree(pooled, other)
    from mha2gqa.demo import build_tokenizer

    build_tokenizer("zeta eta theta " * 200, 280).save_pretrained(other)
    mismatched = ("--original", src, "--converted", other, "--data", text, "--seq-len", "64")
    assert "tokenizer mismatch" in eval_error(*mismatched)
    pair = ("--original", src, "--converted", pooled, "--data", text, "--seq-len", "64")
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a file: give a folder" in eval_error(*pair, "--reference-cache", afile)
    assert "is not a writable folder" in eval_error(*pair, "--reference-cache", afile / "sub")
    assert "lies inside" in eval_error(*pair, "--reference-cache", src / "cache")
    assert "cannot create it" in eval_error(*pair, "--reference-cache", "/proc/mha2gqa-cache")
    assert "must be at least 0" in eval_error(*pair, "--reference-top-k", "-1")
    assert "with --load-both" in eval_error(*pair, "--reference-top-k", "8", "--load-both")


@requires_fixtures("stories260K-mha-expanded", "text")
def test_real_fixture_pooled_to_4_is_exact_and_to_2_is_not(tmp_path):
    src = FIXTURES / "stories260K-mha-expanded"
    data = str(FIXTURES / "text" / "tinystories_train_head.txt")
    settings = EvalSettings(data=data, seq_len=256, max_tokens=4096, attention_seq_len=256, progress=False)
    g4 = convert_checkpoint(src, tmp_path / "g4", 4, progress=False).output
    g2 = convert_checkpoint(src, tmp_path / "g2", 2, progress=False).output
    exact = evaluate(str(src), str(g4), settings)
    assert exact.agreement.kl.max < 1e-4 and exact.agreement.top1_agreement == 1.0
    assert exact.attention.summary.mean_kl < 1e-4
    lossy = evaluate(str(src), str(g2), settings)
    assert lossy.agreement.kl.mean > 0.5 and lossy.protocols["disjoint"].ppl_ratio > 5
    assert lossy.attention.summary.mean_kl > 0.1


def _numbers(results) -> dict:
    """Everything an evaluation measured, without timings, paths and the reference cache's record."""
    r = results.to_dict()
    drop = {"seconds", "tokens_per_second", "created", "reference", "settings", "versions", "git_revision", "device"}
    return {k: v for k, v in r.items() if k not in drop} | {
        "protocols": {
            p: {k: v for k, v in e.items() if k not in ("seconds", "tokens_per_second")}
            for p, e in r["protocols"].items()
        },
        "attention": {k: v for k, v in r["attention"].items() if k != "seconds"},
    }


def test_one_model_at_a_time_equals_both_in_memory_and_its_cache_serves_several(trained_pair, tmp_path):
    """Every protocol, the agreement statistics, the attention statistics and the samples of a pair
    scored one model at a time (the original's scores cached) equal the two-model pass exactly; a
    second conversion reuses the cached original without loading it."""
    import mha2gqa.eval.harness as harness

    src, same, pooled, text = trained_pair
    kw = dict(
        data=str(text),
        seq_len=64,
        stride=24,
        max_tokens=900,
        batch_size=2,
        doc_split="paragraph",
        protocols=("disjoint", "stride", "rolling"),
        attention_windows=2,
        samples=2,
        sample_tokens=5,
        progress=False,
    )
    both = evaluate(str(src), str(pooled), EvalSettings(**kw, load_both=True))
    cache = tmp_path / "cache"
    messages: list[str] = []
    one = evaluate(str(src), str(pooled), EvalSettings(**kw, reference_cache=str(cache)), log=messages.append)
    assert _numbers(one) == _numbers(both)
    assert one.agreement.kl.mean > 0 and len(one.samples) == 2
    assert one.reference.bytes > 0 and any("scoring the original once" in m for m in messages)
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]  # (and its lock)
    assert len(entries) == 1 and (entries[0] / "mha2gqa_reference.json").is_file()

    loads: list[int] = []
    real_load = harness._load
    harness._load, messages[:] = (lambda run, i: loads.append(i) or real_load(run, i)), []
    try:
        again = evaluate(str(src), str(same), EvalSettings(**kw, reference_cache=str(cache)), log=messages.append)
    finally:
        harness._load = real_load
    assert loads == [1], "the cached original must not be loaded again"
    assert (
        any("reusing" in m for m in messages) and [p for p in cache.iterdir() if not p.name.startswith(".")] == entries
    )
    assert again.agreement.kl.max < 1e-5 and again.models["original"] == one.models["original"]
    assert _numbers(again)["protocols"]["disjoint"]["original"] == _numbers(one)["protocols"]["disjoint"]["original"]

    # Other settings make another entry beside it; a temporary cache leaves nothing behind.
    evaluate(str(src), str(same), EvalSettings(**{**kw, "seq_len": 32}, reference_cache=str(cache)))
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        evaluate(str(src), str(same), EvalSettings(**{**kw, "seq_len": 32}))
    finally:
        tempfile.tempdir = before
    assert not any(scratch.iterdir())


def test_a_temporary_reference_larger_than_its_block_is_scored_block_by_block_to_the_same_numbers(
    trained_pair, tmp_path
):
    """A temporary reference over --reference-block is built and replayed block by block (whole
    batches; every protocol, rolling's documents of many lengths among them): every figure, the
    int8 yardstick's included, equals one block's exactly; no block's entry outlives its replay, and
    the disk held at once is a block's, not the text's."""
    import tempfile

    import mha2gqa.eval.harness as harness
    from mha2gqa.eval import reference

    src, _, pooled, text = trained_pair
    kw = dict(data=str(text), seq_len=64, stride=24, max_tokens=900, batch_size=2, doc_split="paragraph",
              protocols=("disjoint", "stride", "rolling"), attention_windows=2, samples=2, sample_tokens=5,
              greedy_prompts=4, greedy_tokens=4, compare_quantization=("int8",), progress=False)  # fmt: skip
    whole = evaluate(str(src), str(pooled), EvalSettings(**kw))
    sizes: list[int] = []
    real_build = reference.build

    def spy(root, key, material, need, inputs):
        sizes.append(need)
        return real_build(root, key, material, need, inputs)

    scratch, messages = tmp_path / "tmp", []
    scratch.mkdir()
    before, tempfile.tempdir, reference.build = tempfile.tempdir, str(scratch), spy
    try:
        blocked = evaluate(str(src), str(pooled), EvalSettings(**kw, reference_block="300KB"), log=messages.append)
    finally:
        tempfile.tempdir, reference.build = before, real_build
    assert whole.reference.blocks is None and blocked.reference.blocks == len(sizes) > 3
    timed = {"quantization"}  # (its seconds; its figures are compared below)
    assert {k: v for k, v in _numbers(blocked).items() if k not in timed} == {
        k: v for k, v in _numbers(whole).items() if k not in timed
    }
    assert blocked.quantization["int8"].agreement == whole.quantization["int8"].agreement
    assert blocked.quantization["int8"].ppl_ratio == whole.quantization["int8"].ppl_ratio
    assert max(sizes) < whole.reference.bytes / 2 and not any(scratch.iterdir())
    assert any(f"in {len(sizes)} blocks" in m for m in messages) and any(m.startswith("estimate:") for m in messages)
    assert harness._blocks  # (the planner the harness uses)


def test_a_temporary_reference_that_cannot_fit_its_folder_is_refused_before_any_model_loads(
    trained_pair, tmp_path, monkeypatch
):
    import shutil
    from collections import namedtuple

    import mha2gqa.eval.harness as harness
    from mha2gqa.core.errors import Mha2GqaError

    src, _, pooled, text = trained_pair
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    monkeypatch.setattr(harness, "_load", lambda *a: pytest.fail("a model loaded before the refusal"))
    with pytest.raises(Mha2GqaError, match=r"temporary disk at once .* point TMPDIR at a bigger disk"):
        evaluate(str(src), str(pooled), EvalSettings(data=str(text), seq_len=64, max_tokens=900, progress=False))


def test_reference_cache_refuses_what_is_not_its_own(trained_pair, tmp_path):
    from mha2gqa.core.errors import Mha2GqaError
    from mha2gqa.eval import reference

    src, _, pooled, text = trained_pair
    kw = dict(data=str(text), seq_len=64, max_tokens=300, samples=0, attention=False, progress=False)
    with pytest.raises(Mha2GqaError, match="lies inside"):
        evaluate(str(src), str(pooled), EvalSettings(**kw, reference_cache=str(src / "cache")))
    evaluate(str(src), str(pooled), EvalSettings(**kw, reference_cache=str(tmp_path)))
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (entry / "mha2gqa_reference.json").write_text("{}")
    with pytest.raises(Mha2GqaError, match="does not match"):
        evaluate(str(src), str(pooled), EvalSettings(**kw, reference_cache=str(tmp_path)))
    assert reference.estimate_bytes(10, 200, 2, None) == int(2000 * 1.01) + 2**20
    with pytest.raises(Mha2GqaError, match="need about"), reference.build(tmp_path / "c", "k", {}, 2**62, {}):
        pass


def _eager_head_similarity(model, batch) -> list[torch.Tensor]:
    """Per layer, the H x H cosine of the heads' full attention matrices from ``output_attentions``."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(batch, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    out = []
    for a in attentions:
        gram = torch.einsum("bhqk,bgqk->hg", a.double(), a.double())
        norm = gram.diagonal().sqrt()
        out.append(gram / (norm[:, None] * norm[None, :]))
    return out


def test_head_diversity_matches_eager_and_sees_identical_heads_and_equalised_groups(tmp_path):
    from transformers import AutoModelForCausalLM

    orig = random_model(tiny_config("llama", max_position_embeddings=128, attention_bias=False), seed=3)
    conv = random_model(
        tiny_config("llama", max_position_embeddings=128, attention_bias=False, num_key_value_heads=2), seed=4
    )
    batch = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    att = attention_similarity(orig, conv, batch, chunk=16)
    for layer, ref_o, ref_c in zip(
        att.layers, _eager_head_similarity(orig, batch), _eager_head_similarity(conv, batch), strict=True
    ):
        sim = layer.head_similarity
        torch.testing.assert_close(torch.tensor(sim.original.matrix, dtype=torch.float64), ref_o, atol=2e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(sim.converted.matrix, dtype=torch.float64), ref_c, atol=2e-6, rtol=0)
        within = (ref_c[0, 1] + ref_c[1, 0] + ref_c[2, 3] + ref_c[3, 2]) / 4  # groups {0, 1}, {2, 3}
        assert sim.converted.within_groups == pytest.approx(within.item(), abs=2e-6)
        off = ref_o[~torch.eye(4, dtype=torch.bool)].mean()
        assert sim.original.mean == pytest.approx(off.item(), abs=2e-6) and sim.original.mean < 0.99
    assert att.summary.head_similarity_converted_within_groups is not None

    # Heads made identical (q, k, v of every head = head 0's): similarity 1 off the diagonal.
    same = random_model(tiny_config("llama", max_position_embeddings=128, attention_bias=False), seed=6)
    d = 8
    with torch.no_grad():
        for layer in same.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[d:] = proj.weight[:d].repeat(3, 1)
    s = attention_similarity(same, same, batch, chunk=16).summary
    assert s.head_similarity_original_mean == pytest.approx(1.0, abs=1e-6)

    # Groups equalised (q, k, v within each pair of heads) and converted to 2 KV heads: within 1.
    eq = random_model(tiny_config("llama", max_position_embeddings=128, attention_bias=False), seed=7)
    with torch.no_grad():
        for layer in eq.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                for j in (0, 2):
                    proj.weight[(j + 1) * d : (j + 2) * d] = proj.weight[j * d : (j + 1) * d]
    src = save(eq, tmp_path / "eq")
    g2 = AutoModelForCausalLM.from_pretrained(convert_checkpoint(src, tmp_path / "g2", 2, progress=False).output).eval()
    s = attention_similarity(eq, g2, batch, chunk=16).summary
    assert s.head_similarity_converted_within_groups == pytest.approx(1.0, abs=1e-6)
    assert s.head_similarity_converted_across_groups < 0.99 and s.mean_kl < 1e-6


def test_rolling_follows_lm_eval_conventions_checked_by_hand(trained_pair, tmp_path):
    """lm-eval <= 0.4.9: the document without special tokens after one BOS prefix; 0.4.10+: the
    tokenizer's own BOS too, so BOS is scored after BOS. The window is the model's full length."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, _, _, _ = trained_pair
    doc = "the cat sat on the mat and ran"
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": doc}) + "\n")
    tok, model = AutoTokenizer.from_pretrained(src), AutoModelForCausalLM.from_pretrained(src).eval()
    ids, bos = tok(doc, add_special_tokens=False)["input_ids"], tok.bos_token_id
    assert tok(doc)["input_ids"] == [bos, *ids]  # this tokenizer adds BOS

    def nll(seq: list[int]) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].double(), -1)
        return -logp.gather(1, torch.tensor(seq[1:])[:, None]).sum().item()

    def rolling(**kw) -> dict:
        s = EvalSettings(data=str(data), protocols=("rolling",), samples=0, progress=False, **kw)
        return evaluate(str(src), None, s).to_dict()["protocols"]["rolling"]

    old, new = rolling(), rolling(rolling_convention="lm-eval-0.4.10")
    assert old["original"]["tokens"] == len(ids) and new["original"]["tokens"] == len(ids) + 1
    assert old["original"]["nll_sum"] == pytest.approx(nll([bos, *ids]), rel=1e-5)
    assert new["original"]["nll_sum"] == pytest.approx(nll([bos, bos, *ids]), rel=1e-5)
    words = len(doc.split())
    assert new["original"]["word_perplexity"] == pytest.approx(math.exp(nll([bos, bos, *ids]) / words), rel=1e-5)
    assert old["settings"]["seq_len"] == 64 and new["settings"]["convention"] == "lm-eval-0.4.10"


def test_rolling_window_defaults_to_the_models_full_length(tmp_path):
    from mha2gqa.demo import build_tokenizer

    text = write_text(tmp_path / "t.txt", n_words=300)
    tok = build_tokenizer(text.read_text(), 300)
    src = save(random_model(tiny_config("llama", vocab_size=len(tok), max_position_embeddings=4096)), tmp_path / "m")
    tok.save_pretrained(src)
    r = evaluate(str(src), None, EvalSettings(data=str(text), protocols=("rolling",), progress=False))
    assert r.protocols["rolling"].settings["seq_len"] == 4096  # lm-eval's max_length, not min(2048, ...)
    assert r.settings["seq_len"] == 2048  # the other protocols' default


def test_top_k_reference_keeps_ppl_and_same_top_exact_and_bounds_kl_from_below(trained_pair, tmp_path):
    src, _, pooled, text = trained_pair
    kw = dict(data=str(text), seq_len=64, max_tokens=900, batch_size=2, attention=False, samples=0, progress=False)
    exact = evaluate(str(src), str(pooled), EvalSettings(**kw))
    vocab = exact.tokenizer["vocab_size"]
    full = evaluate(str(src), str(pooled), EvalSettings(**kw, reference_top_k=vocab))  # every token kept
    small = evaluate(str(src), str(pooled), EvalSettings(**kw, reference_top_k=4))
    for r in (full, small):
        for m in ("original", "converted"):
            got, want = getattr(r.protocols["disjoint"], m).nll_sum, getattr(exact.protocols["disjoint"], m).nll_sum
            assert got == pytest.approx(want, rel=1e-6)
        a, e = r.agreement, exact.agreement
        assert a.top1_agreement == e.top1_agreement and a.delta_p.mean == pytest.approx(e.delta_p.mean)
    assert full.agreement.kl.mean == pytest.approx(exact.agreement.kl.mean, rel=1e-4)
    assert full.agreement.reference_rest_mass.max < 1e-6
    # with 4 tokens and a bucket: a lower bound of each KL (log-sum inequality), and a smaller cache
    assert small.agreement.kl.mean <= exact.agreement.kl.mean + 1e-9
    assert small.agreement.kl_reverse.mean <= exact.agreement.kl_reverse.mean + 1e-9
    assert 0 < small.agreement.reference_rest_mass.mean < 1
    assert small.reference.form == "top-4" and small.reference.bytes < exact.reference.bytes / 4
    from mha2gqa.eval.summary import summary_lines

    assert any("lower bounds" in line for line in summary_lines(small))
    assert not any("lower bounds" in line for line in summary_lines(exact))
    with pytest.raises(SettingError, match="--load-both"):
        evaluate(str(src), str(pooled), EvalSettings(**kw, reference_top_k=4, load_both=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_top_k_form_taken_row_by_row_is_the_whole_logits_form_to_the_bit(dtype):
    """The original's top-k form (the reference cache's, the teacher cache's) is taken a few tokens at a
    time (bounded temporaries): each token's values, indices, rest and target are those of the formula
    over the whole logits, to the bit, across chunk boundaries and with k above the vocabulary."""
    from mha2gqa.core.memory import LOGIT_ROWS, logit_rows
    from mha2gqa.eval.perplexity import top_k_form

    g = torch.Generator().manual_seed(0)
    n = 2 * LOGIT_ROWS + 5
    for m in (0, 1, LOGIT_ROWS, n):  # the slices cover every token once, in order, none empty
        covered = [i for rows in logit_rows(m) for i in range(m)[rows]]
        assert covered == list(range(m)) and all(r.start < m for r in logit_rows(m))
    logits = (torch.randn(n, 300, generator=g) * 4).to(dtype)
    ids = torch.randint(0, 300, (n,), generator=g)
    for k in (8, 1000):
        lo = torch.log_softmax(logits.float(), -1)
        values, indices = lo.topk(min(k, 300), -1)
        whole = {
            "values": values,
            "indices": indices.int(),
            "rest": lo.scatter(-1, indices, float("-inf")).logsumexp(-1),
            "target": lo.gather(1, ids[:, None])[:, 0],
        }
        form = top_k_form(logits, ids, k)
        assert form.keys() == whole.keys()
        for name, t in whole.items():
            assert form[name].dtype == t.dtype and torch.equal(form[name], t), name
