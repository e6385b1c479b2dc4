"""Training-free methods beyond mean pooling: random and svd (activation-aware, RoPE-aware)."""

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES, load, logits, random_model, requires_fixtures, save, tiny_config
from test_convert import IDS, equalise_groups, read_all

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.convert.calibration.stats import LayerStats, output_gram, output_weighted_code, top_eigvecs
from mha2gqa.convert.methods import HeadShape
from mha2gqa.convert.methods.svd import svd_merge_layer
from mha2gqa.core.architecture import dims_of


def rotary_dim(cfg) -> int:
    return dims_of(cfg).rotary


SVD_FAMILIES = ["llama", "mistral", "qwen2", "gemma", "phi", "phi3", "olmo", "starcoder2"]


def with_tokenizer(model, folder, text):
    from mha2gqa.demo import build_tokenizer

    save(model, folder)
    build_tokenizer(text.read_text(), 300).save_pretrained(folder)
    return folder


def calibrated(calib_text, method: str = "svd", **kw) -> dict:
    """``convert_checkpoint`` keywords for ``method`` calibrated on the first 512 tokens of ``calib_text``
    (no calibration when the method and grouping do not read it: convert refuses it then)."""
    from mha2gqa.convert.settings import ConvertSettings

    calibration = {"calibration": str(calib_text), "calibration_tokens": 512, "calibration_seq_len": 32}
    if not ConvertSettings(num_kv_heads=1, method=method, **kw).reads_calibration:
        calibration = {}
    return {"method": method, **calibration, "progress": False, **kw}


@pytest.mark.parametrize("family", SVD_FAMILIES)
def test_svd_on_equalised_groups_keeps_the_logits(family, calib_text, tmp_path):
    config = tiny_config(family, vocab_size=300)
    kv = config.num_key_value_heads
    g = kv // 2
    model = random_model(config, seed=3)
    equalise_groups(model, family, g)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    out = convert_checkpoint(src, tmp_path / "out", g, **calibrated(calib_text)).output
    converted = load(out)
    assert converted.config.num_key_value_heads == g
    torch.testing.assert_close(logits(converted, IDS), logits(model, IDS), atol=1e-4, rtol=1e-4)
    record = json.loads((out / "mha2gqa_conversion.json").read_text())["conversion"]
    assert record["method"] == "svd" and record["calibration"]["tokens"] == 512


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi", "phi3"])
def test_absorbed_bases_leave_the_model_unchanged_when_complete(family):
    """With one source head per group the V basis and the K plane coefficients are complete:
    absorbing them into q_proj and o_proj (RoPE-commuting complex coefficients per plane, the
    ordinary subspace on non-rotary dims) must leave every logit unchanged."""
    from mha2gqa.core.families import families

    model = random_model(tiny_config(family), seed=5)
    cfg = model.config
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim if hasattr(cfg, "head_dim") else 8
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    rot = rotary_dim(cfg)
    fam = families()[family]
    before = logits(model, IDS)
    state = model.state_dict()
    gen = torch.Generator().manual_seed(0)

    def spd(n, complex_=False):
        a = torch.randn(n, n, generator=gen, dtype=torch.float64)
        if complex_:
            a = torch.complex(a, torch.randn(n, n, generator=gen, dtype=torch.float64))
        return a @ a.mH + n * torch.eye(n, dtype=a.dtype)

    for layer in range(cfg.num_hidden_layers):
        stats = LayerStats(
            torch.stack([spd(d) for _ in range(kv)]),
            torch.stack([torch.stack([spd(1, True) for _ in range(rot // 2)]) for _ in range(kv)]),
            torch.stack([spd(d - rot) for _ in range(kv)]),
            torch.rand(h, rot // 2, generator=gen, dtype=torch.float64) + 0.1,
        )
        names = {}
        if fam.fused:
            qkv = state[fam.qkv_proj.format(layer=layer) + ".weight"].double()
            w = dict(zip(("q", "k", "v"), qkv.split([h * d, kv * d, kv * d]), strict=True))
        else:
            w = {}
            for key, module in (("q", fam.q_proj), ("k", fam.k_proj), ("v", fam.v_proj)):
                for suffix, role in ((".weight", key), (".bias", f"{key}_bias")):
                    name = module.format(layer=layer) + suffix
                    if name in state:
                        w[role], names[role] = state[name].double(), name
        w["o"] = state[fam.o_proj.format(layer=layer) + ".weight"].double()
        out = svd_merge_layer(w, stats, shape=HeadShape(h, kv, kv, d, rot))
        assert not torch.allclose(out["o"], w["o"])  # the bases really moved something
        if fam.fused:
            state[fam.qkv_proj.format(layer=layer) + ".weight"] = torch.cat([out["q"], out["k"], out["v"]]).float()
        for role, name in names.items():
            state[name] = out[role].float()
        state[fam.o_proj.format(layer=layer) + ".weight"] = out["o"].float()
    model.load_state_dict(state)
    torch.testing.assert_close(logits(model, IDS), before, atol=1e-4, rtol=1e-4)


def test_rope_commuting_plane_coefficients_keep_scores_at_every_position():
    """k' = c * k and q' = q / conj(c) on each rotary plane (complex numbers) leave q.k after RoPE
    unchanged for every pair of positions; a real per-dimension scaling does not."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = tiny_config("llama")
    d, t = 8, 40
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.randn(1, 1, t, d, dtype=torch.float64)
    q, k = torch.randn(1, 1, t, d, dtype=torch.float64), x
    cos, sin = rope(x.float(), torch.arange(t)[None])
    c = torch.complex(torch.randn(d // 2, dtype=torch.float64), torch.randn(d // 2, dtype=torch.float64))

    def planes_mul(v, coef):
        z = torch.complex(v[..., : d // 2], v[..., d // 2 :]) * coef
        return torch.cat([z.real, z.imag], -1)

    def scores(qq, kk):
        qr, kr = apply_rotary_pos_emb(qq, kk, cos.double(), sin.double())
        return qr @ kr.transpose(-1, -2)

    base = scores(q, k)
    torch.testing.assert_close(scores(planes_mul(q, 1 / c.conj()), planes_mul(k, c)), base)
    scale = torch.rand(d, dtype=torch.float64) + 0.5
    assert not torch.allclose(scores(q / scale, k * scale), base)


def test_svd_same_head_count_is_an_exact_copy_and_bad_input(calib_text, tmp_path):
    src = with_tokenizer(random_model(tiny_config("llama", vocab_size=300)), tmp_path / "src", calib_text)
    out = convert_checkpoint(src, tmp_path / "same", 4, "svd", progress=False).output
    a, b = read_all(src), read_all(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x"), "-g", "2", "--method", "svd"])
    assert result.exit_code == 1 and "needs calibration text: pass --calibration" in result.output
    qwen3 = save(random_model(tiny_config("qwen3")), tmp_path / "qwen3")
    result = CliRunner().invoke(
        main,
        ["convert", str(qwen3), str(tmp_path / "y"), "-g", "2", "--method", "svd", "--calibration", str(calib_text)],
    )
    assert result.exit_code == 1 and "normalises q/k per head" in result.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_random_is_seeded_fresh_init_and_loads(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2")
    a = convert_checkpoint(src, tmp_path / "a", 2, "random", seed=1, progress=False).output
    b = convert_checkpoint(src, tmp_path / "b", 2, "random", seed=1, progress=False).output
    c = convert_checkpoint(src, tmp_path / "c", 2, "random", seed=2, progress=False).output
    ta, tb, tc, ts = read_all(a), read_all(b), read_all(c), read_all(src)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(ta[k], tb[k]) and not torch.equal(ta[k], tc[k])
    assert ta[k].shape == (16, 32) and abs(ta[k].std().item() - 0.02) < 0.005
    assert torch.equal(ta["model.layers.0.self_attn.k_proj.bias"], torch.zeros(16))
    assert torch.equal(ta["model.layers.0.self_attn.q_proj.weight"], ts["model.layers.0.self_attn.q_proj.weight"])
    assert torch.isfinite(logits(load(a), IDS)).all()
    same = read_all(convert_checkpoint(src, tmp_path / "same", 4, "random", progress=False).output)
    assert all(torch.equal(same[n], ts[n]) for n in ts)


@requires_fixtures("stories260K", "text")
def test_svd_beats_mean_by_a_wide_margin_on_a_real_model(tmp_path):
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.settings import EvalSettings

    src = FIXTURES / "stories260K"
    text = (FIXTURES / "text" / "tinystories_train_head.txt").read_text()
    calib, held = tmp_path / "calib.txt", tmp_path / "held.txt"
    calib.write_text(text[: len(text) // 2])
    held.write_text(text[int(len(text) * 0.85) :])
    settings = EvalSettings(data=str(held), seq_len=512, max_tokens=8192, attention=False, progress=False)
    ratios = {}
    for method in ("mean", "svd"):
        calibration = {"calibration": str(calib), "calibration_tokens": 8192} if method == "svd" else {}
        out = convert_checkpoint(src, tmp_path / method, 2, method, progress=False, **calibration).output
        r = evaluate(str(src), str(out), settings)
        ratios[method] = (r.headline.ppl_ratio, r.agreement.kl.mean)
    (mean_ratio, mean_kl), (svd_ratio, svd_kl) = ratios["mean"], ratios["svd"]
    assert (svd_ratio - 1) * 5 <= mean_ratio - 1 and svd_kl < mean_kl, ratios


def relate_groups(model, family: str, groups: int, seed: int = 0, orthogonal: bool = False) -> None:
    """Make each group's K/V heads exact transforms of its first head that svd must undo: complex
    coefficients per rotary plane, an invertible matrix on non-rotary key dims and on values
    (``orthogonal``: unit coefficients and orthogonal matrices, which ``aligned`` must undo)."""
    from mha2gqa.core.families import families

    equalise_groups(model, family, groups)
    fam, cfg = families()[family], model.config
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    rot, half = rotary_dim(cfg), rotary_dim(cfg) // 2
    per = kv // groups
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in range(cfg.num_hidden_layers):
            transforms = {}
            for head in range(kv):  # one transform per head, shared by its weight and bias rows
                c = torch.complex(torch.randn(half, generator=gen), torch.randn(half, generator=gen))
                a = torch.randn(d - rot, d - rot, generator=gen) + 2 * torch.eye(d - rot)
                b = torch.randn(d, d, generator=gen) * 0.3 + torch.eye(d)
                if orthogonal:
                    c = c / c.abs()
                    a, b = torch.linalg.qr(a)[0], torch.linalg.qr(b)[0]
                transforms[head] = (c, a, b)
            for suffix in (".weight", ".bias"):
                if fam.fused:
                    t = params.get(fam.qkv_proj.format(layer=layer) + suffix)
                    if t is None:
                        continue
                    k_off, v_off, k_t, v_t = h * d, (h + kv) * d, t, t
                else:
                    k_t = params.get(fam.k_proj.format(layer=layer) + suffix)
                    v_t = params.get(fam.v_proj.format(layer=layer) + suffix)
                    if k_t is None:
                        continue
                    k_off = v_off = 0
                for head in range(kv):
                    if head % per == 0:
                        continue
                    c, a, b = transforms[head]
                    ks = slice(k_off + head * d, k_off + (head + 1) * d)
                    vs = slice(v_off + head * d, v_off + (head + 1) * d)
                    kh = k_t[ks].clone()
                    shape = (half,) + (1,) * (kh.dim() - 1)
                    z = torch.complex(kh[:half], kh[half:rot]) * c.reshape(shape)
                    kh[:half], kh[half:rot] = z.real, z.imag
                    if rot < d:
                        kh[rot:] = a @ kh[rot:]
                    k_t[ks] = kh
                    if v_t is not None:
                        v_t[vs] = b @ v_t[vs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi", "phi3", "starcoder2"])
def test_svd_undoes_rope_commuting_transforms_between_heads(family, calib_text, tmp_path):
    config = tiny_config(family, vocab_size=300)
    model = random_model(config, seed=7)
    relate_groups(model, family, 2)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    before = logits(model, IDS)
    out = convert_checkpoint(src, tmp_path / "svd", 2, **calibrated(calib_text)).output
    torch.testing.assert_close(logits(load(out), IDS), before, atol=2e-4, rtol=1e-3)
    mean = convert_checkpoint(src, tmp_path / "mean", 2, "mean", progress=False).output
    assert (logits(load(mean), IDS) - before).abs().max() > 1e-2  # mean pooling cannot undo them


@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi", "phi3"])
def test_aligned_undoes_rotations_between_heads(family, calibrated, calib_text, tmp_path):
    model = random_model(tiny_config(family, vocab_size=300), seed=11)
    relate_groups(model, family, 2, orthogonal=True)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    kwargs = (
        {"calibration": str(calib_text), "calibration_tokens": 512, "calibration_seq_len": 32} if calibrated else {}
    )
    out = convert_checkpoint(src, tmp_path / "al", 2, "aligned", progress=False, **kwargs).output
    torch.testing.assert_close(logits(load(out), IDS), logits(model, IDS), atol=2e-4, rtol=1e-3)
    record = json.loads((out / "mha2gqa_conversion.json").read_text())["conversion"]
    assert (
        record["calibration"]["weights_only"] is not calibrated
        if not calibrated
        else record["calibration"]["tokens"] == 512
    )


def test_aligned_equalised_groups_and_same_count(calib_text, tmp_path):
    model = random_model(tiny_config("llama", vocab_size=300), seed=12)
    equalise_groups(model, "llama", 1)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    out = convert_checkpoint(src, tmp_path / "al", 1, "aligned", progress=False).output
    torch.testing.assert_close(logits(load(out), IDS), logits(model, IDS), atol=1e-4, rtol=1e-4)
    same = convert_checkpoint(src, tmp_path / "same", 4, "aligned", progress=False).output
    a, b = read_all(src), read_all(same)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["llama", "gemma", "phi", "phi3", "qwen2", "mistral"])
def test_layer_streamed_calibration_equals_a_whole_model_pass(family, calib_text, tmp_path):
    """Differential: statistics gathered layer by layer from the shards equal those of the loaded
    model run end to end (embedding scaling, partial rotary, fused qkv, biases included)."""
    from mha2gqa.convert.calibration.stats import CalibrationStats, accumulate
    from mha2gqa.convert.calibration.streaming import CalibrationText, PassOptions, collect
    from mha2gqa.convert.engine.layers import calibration_ids
    from mha2gqa.core.capture import capturing

    model = random_model(tiny_config(family, vocab_size=300), seed=2)
    src = save(model, tmp_path / "src")
    from mha2gqa.demo import build_tokenizer

    build_tokenizer(calib_text.read_text(), 300).save_pretrained(src)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="30KB")  # streamed across shards too
    build_tokenizer(calib_text.read_text(), 300).save_pretrained(tmp_path / "sharded")
    groups = model.config.num_key_value_heads // 2
    streamed = collect(
        tmp_path / "sharded", groups, CalibrationText(str(calib_text), 256, 32), PassOptions("cpu", compact=False)
    )
    ref = CalibrationStats(groups, streamed.head_dim, streamed.rotary_dim)
    with torch.no_grad(), capturing(model, lambda c: accumulate(ref, c.layer, c.q, c.k, c.v)):
        for w in calibration_ids(src, str(calib_text), 256, 32):
            model.base_model(w[None])
    assert streamed.tokens == 256 and set(streamed.layers) == set(ref.layers) == {0, 1}
    for layer in ref.layers:
        a, b = streamed.layers[layer], ref.layers[layer]
        for field in ("v_gram", "k_plane_gram", "k_rest_gram", "q_plane_energy"):
            torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", ["mean", "svd"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_similarity_grouping_finds_heads_that_repeat_kv_order_would_not_pair(family, method, calib_text, tmp_path):
    """Heads h and h + G are equal (the strided pattern): contiguous pooling breaks the model, the
    similarity grouping pairs them by permuting query heads with their KV heads, and the conversion
    is exact again."""
    model = random_model(tiny_config(family, vocab_size=300), seed=13)
    equalise_groups(model, family, 2, strided=True)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    before = logits(model, IDS)
    out = convert_checkpoint(src, tmp_path / "sim", 2, **calibrated(calib_text, method, grouping="similarity")).output
    torch.testing.assert_close(logits(load(out), IDS), before, atol=1e-4, rtol=1e-4)
    record = json.loads((out / "mha2gqa_conversion.json").read_text())["conversion"]
    assert record["grouping"] == "similarity"
    assert record["source_kv_heads_per_kv_head_by_layer"] == {"0": [[0, 2], [1, 3]], "1": [[0, 2], [1, 3]]}
    contiguous = convert_checkpoint(src, tmp_path / "cont", 2, **calibrated(calib_text, method)).output
    assert (logits(load(contiguous), IDS) - before).abs().max() > 1e-2
    # Attention similarity compares each converted head with the head it came from: exact here.
    from mha2gqa.core.conversion_record import read_conversion_record
    from mha2gqa.eval.attention import attention_similarity, head_order_of

    order = head_order_of(read_conversion_record(out).conversion)
    assert order == {0: [0, 2, 1, 3], 1: [0, 2, 1, 3]}
    same = attention_similarity(load(src), load(out), IDS, chunk=8, head_order=order).summary
    assert same.mean_kl < 1e-6 and same.mean_contribution_rel_error < 1e-3
    unaligned = attention_similarity(load(src), load(out), IDS, chunk=8).summary
    assert unaligned.mean_kl > 1e-3


def test_similarity_grouping_bad_input(calib_text, tmp_path):
    src = with_tokenizer(random_model(tiny_config("llama", vocab_size=300)), tmp_path / "src", calib_text)
    for args, message in [
        (["--grouping", "similarity"], "--grouping similarity needs calibration text"),
        (
            ["--grouping", "similarity", "--method", "random", "--calibration", str(calib_text)],
            "does not apply to --method random",
        ),
    ]:
        result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x"), "-g", "2", *args])
        assert result.exit_code == 1 and message in result.output, result.output


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_streamed_calibration_of_a_bf16_checkpoint_runs_layers_in_float32(family, calib_text, tmp_path):
    """bf16 weights: embeddings are looked up as stored, layers and RoPE tables run in float32, so
    the statistics match a float32 pass over the same (upcast) weights."""
    from mha2gqa.convert.calibration.stats import CalibrationStats, accumulate
    from mha2gqa.convert.calibration.streaming import CalibrationText, PassOptions, collect
    from mha2gqa.convert.engine.layers import calibration_ids
    from mha2gqa.core.capture import capturing
    from mha2gqa.demo import build_tokenizer

    model = random_model(tiny_config(family, vocab_size=300), seed=4).to(torch.bfloat16)
    src = save(model, tmp_path / "bf16")
    build_tokenizer(calib_text.read_text(), 300).save_pretrained(src)
    streamed = collect(src, 2, CalibrationText(str(calib_text), 128, 32), PassOptions("cpu", compact=False))
    ref_model = load(src)  # float32, RoPE tables computed afresh (a .float() of the bf16 model would keep bf16 ones)
    ref = CalibrationStats(2, streamed.head_dim, streamed.rotary_dim)
    with torch.no_grad(), capturing(ref_model, lambda c: accumulate(ref, c.layer, c.q, c.k, c.v)):
        for w in calibration_ids(src, str(calib_text), 128, 32):
            ref_model.base_model(w[None])
    # Gemma scales the embeddings by sqrt(hidden) in the model's own dtype (bf16 rounding, ~0.4%)
    rtol = 5e-2 if family == "gemma" else 1e-2
    for layer in ref.layers:
        a, b = streamed.layers[layer], ref.layers[layer]
        for x, y in ((a.v_gram, b.v_gram), (a.k_plane_gram, b.k_plane_gram)):
            torch.testing.assert_close(x, y, rtol=rtol, atol=1e-3 * y.abs().max().item())


def test_svd_reads_a_pickle_checkpoint_only_with_allow_pickle(calib_text, tmp_path):
    from mha2gqa.demo import build_tokenizer

    model = random_model(tiny_config("llama", vocab_size=300))
    src = tmp_path / "src"
    src.mkdir()
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    build_tokenizer(calib_text.read_text(), 300).save_pretrained(src)
    kw = {"calibration": str(calib_text), "calibration_tokens": 256, "calibration_seq_len": 32, "progress": False}
    out = convert_checkpoint(src, tmp_path / "out", 2, "svd", allow_pickle=True, **kw).output
    assert load(out).config.num_key_value_heads == 2
    from mha2gqa.core.errors import Mha2GqaError

    with pytest.raises(Mha2GqaError, match="--allow-pickle"):
        convert_checkpoint(src, tmp_path / "no", 2, "svd", **kw)


def _weighted_error(gram, per_head, encode, decode) -> float:
    """``E sum_h |O_h (v_h - decode_h encode^T v)|^2`` from ``gram = E v v^T`` (exact, no sampling)."""
    s, d = per_head.shape[0], per_head.shape[-1]
    residual = torch.eye(s * d, dtype=torch.float64) - decode @ encode.T
    weight = torch.block_diag(*per_head)
    return float(torch.trace(residual.T @ weight @ residual @ gram))


def test_output_weighted_value_code_loses_least_as_the_output_projection_sees_it():
    gen = torch.Generator().manual_seed(0)
    s, d, hidden, r = 3, 4, 20, 2
    x = torch.randn(500, s * d, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 3.0, s * d)
    gram = x.T @ x / 500
    o = torch.randn(hidden, s * r * d, generator=gen, dtype=torch.float64) * torch.rand(s * r * d, generator=gen)
    per_head = output_gram(o, s * r, d).reshape(s, r, d, d).sum(1)
    # by hand: head 0's Gram is the sum over its r query heads of O_i^T O_i
    o0 = torch.cat([o[:, i * d : (i + 1) * d] for i in range(r)])
    torch.testing.assert_close(per_head[0], o0.T @ o0)
    encode, decode = output_weighted_code(gram, per_head)
    top = top_eigvecs(gram, d)
    weighted, plain = _weighted_error(gram, per_head, encode, decode), _weighted_error(gram, per_head, top, top)
    assert weighted < 0.9 * plain, (weighted, plain)
    for _ in range(20):  # no other code of this size does better (random perturbations of the optimum)
        e2 = encode + 0.05 * torch.randn(encode.shape, generator=gen, dtype=torch.float64)
        d2 = decode + 0.05 * torch.randn(decode.shape, generator=gen, dtype=torch.float64)
        p = torch.linalg.pinv(e2.T @ gram @ e2) @ e2.T @ gram  # best decode for e2
        assert _weighted_error(gram, per_head, e2, p.T) >= weighted * (1 - 1e-3)
        assert _weighted_error(gram, per_head, e2, d2) >= weighted * (1 - 1e-3)
    # an output projection that weights every direction alike gives the principal subspace back
    same = torch.eye(d, dtype=torch.float64).expand(s, d, d)
    e1, d1 = output_weighted_code(gram, same)
    torch.testing.assert_close(d1 @ e1.T, top @ top.T)


def test_calibration_records_each_query_heads_output_gram(calib_text, tmp_path):
    from mha2gqa.convert.calibration.streaming import CalibrationText, PassOptions, collect

    model = random_model(tiny_config("llama", vocab_size=300), seed=3)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    stats = collect(src, 2, CalibrationText(str(calib_text), 128, 32), PassOptions("cpu", compact=False))
    dims = dims_of(model.config)
    for i, layer in enumerate(model.model.layers):
        want = output_gram(layer.self_attn.o_proj.weight.detach(), dims.num_heads, dims.head_dim)
        torch.testing.assert_close(stats.layers[i].o_gram, want)
    small = collect(src, 2, CalibrationText(str(calib_text), 128, 32), PassOptions("cpu"))
    assert all(s.o_gram is None and s.v_decode is not None for s in small.layers.values())
    plain = collect(
        src, 2, CalibrationText(str(calib_text), 128, 32), PassOptions("cpu", compact=False, weigh_values=False)
    )
    assert all(s.o_gram is None for s in plain.layers.values())  # a refit's start: the principal subspace


@pytest.mark.parametrize("grouping", ["contiguous", "similarity"])
def test_a_refits_statistics_keep_the_weighted_value_code_aside(calib_text, tmp_path, grouping):
    """A refit starts from the values' principal subspace, and the stage guard holds it to ``svd``'s
    output-weighted code: one calibration pass gives both, each the very code its own pass gives
    (compacted and not, regrouped too), and statistics without one aside have no weighted form."""
    from mha2gqa.convert.calibration.streaming import CalibrationText, PassOptions, collect

    model = random_model(tiny_config("llama", vocab_size=300), seed=3)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    args, kw = (src, 2, CalibrationText(str(calib_text), 128, 32)), {"device": "cpu", "grouping": grouping}
    weighted, plain = collect(*args, PassOptions(**kw)), collect(*args, PassOptions(weigh_values=False, **kw))
    assert plain.weighted() is None and weighted.weighted() is None  # nothing kept aside
    for compact in (True, False):
        both = collect(*args, PassOptions(weigh_values=False, weighted_aside=True, compact=compact, **kw))
        aside = both.weighted()
        d = both.head_dim
        for i in both.layers:
            assert both.layers[i].perm == weighted.layers[i].perm == aside.layers[i].perm
            for j in range(2):
                for got, want in ((both, plain), (aside, weighted)):
                    (ea, da), (eb, db) = got.layers[i].value_code(j, d), want.layers[i].value_code(j, d)
                    torch.testing.assert_close(da @ ea.T, db @ eb.T)
                    torch.testing.assert_close(ea.T @ ea, eb.T @ eb)  # the encoder's scale too


def test_compact_statistics_keep_what_the_merges_read(calib_text, tmp_path):
    """Compacted per-layer statistics (eigenbasis and first block-row instead of the Grams) give the
    same subspaces and Procrustes inputs, and the same converted model, as the full Grams."""
    from mha2gqa.convert.calibration.streaming import CalibrationText, PassOptions, collect

    model = random_model(tiny_config("phi", vocab_size=300), seed=21)  # partial rotary: rest dims too
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    full = collect(src, 2, CalibrationText(str(calib_text), 256, 32), PassOptions("cpu", compact=False))
    small = collect(src, 2, CalibrationText(str(calib_text), 256, 32), PassOptions("cpu"))
    d, rest = full.head_dim, full.head_dim - full.rotary_dim
    for layer, a in small.layers.items():
        b = full.layers[layer]
        assert a.v_gram is None and a.k_rest_gram is None and b.v_gram is not None
        for j in range(2):
            (ea, da), (eb, db) = a.value_code(j, d), b.value_code(j, d)
            torch.testing.assert_close(da @ ea.T, db @ eb.T)  # same projection (signs may differ)
            torch.testing.assert_close(a.value_row(j, d), b.value_row(j, d))
            ra, rb = a.rest_basis(j, rest), b.rest_basis(j, rest)
            torch.testing.assert_close(ra @ ra.T, rb @ rb.T)
            torch.testing.assert_close(a.rest_row(j, rest), b.rest_row(j, rest))


def test_merge_residual_is_zero_for_one_or_identical_heads_and_grouping_never_loses_to_contiguous():
    from mha2gqa.convert.calibration.grouping import least_residual_groups, merge_residual
    from mha2gqa.convert.calibration.stats import CalibrationStats, accumulate

    torch.manual_seed(0)
    q = torch.randn(1, 8, 64, 8)
    k, v = torch.randn(1, 4, 64, 8), torch.randn(1, 4, 64, 8)
    k[:, 2], v[:, 2] = k[:, 0], v[:, 0]  # head 2 repeats head 0; repeat_kv would pair 0 with 1
    stats = CalibrationStats(1, 8, 8)
    accumulate(stats, 0, q, k, v)
    full = stats.layers[0]
    assert merge_residual(full, [1]) == pytest.approx(0.0, abs=1e-12)
    assert merge_residual(full, [0, 2]) == pytest.approx(0.0, abs=1e-12)
    assert merge_residual(full, [0, 1]) > 0.1
    assert least_residual_groups(full, 2) == [[0, 2], [1, 3]]
    k[:, 2], v[:, 2] = torch.randn(64, 8), torch.randn(64, 8)
    k[:, 1], v[:, 1] = k[:, 0], v[:, 0]  # now the contiguous pairs are the identical ones
    stats = CalibrationStats(1, 8, 8)
    accumulate(stats, 0, q, k, v)
    assert least_residual_groups(stats.layers[0], 2) == [[0, 1], [2, 3]]


# ---- what the record and the model card say changed ------------------------------------------------


@pytest.mark.parametrize(
    "family,method,grouping,roles",
    [
        ("llama", "mean", "contiguous", {"k_proj", "v_proj"}),
        ("llama", "first", "contiguous", {"k_proj", "v_proj"}),
        ("llama", "random", "contiguous", {"k_proj", "v_proj"}),
        ("llama", "svd", "contiguous", {"q_proj", "k_proj", "v_proj", "o_proj"}),
        ("llama", "aligned", "contiguous", {"q_proj", "k_proj", "v_proj", "o_proj"}),
        ("llama", "mean", "similarity", {"q_proj", "k_proj", "v_proj", "o_proj"}),
        ("phi3", "mean", "contiguous", {"qkv_proj"}),
        ("phi3", "svd", "contiguous", {"qkv_proj", "o_proj"}),
        ("stablelm", "mean", "contiguous", {"k_proj", "v_proj", "k_layernorm"}),
    ],
)
def test_the_card_names_exactly_the_tensors_that_changed(family, method, grouping, roles, calib_text, tmp_path):
    """The record's ``rewritten`` list is exactly the set of tensors whose bytes differ from the source
    (as templates), and the card says it: only K/V for pooling methods, every projection otherwise."""
    import re

    extra = {"qk_layernorm": True} if family == "stablelm" else {}
    model = random_model(tiny_config(family, vocab_size=300, **extra), seed=2)
    if grouping == "similarity":  # heads h and h + 2 equal: the grouping pairs them, so q/o move
        equalise_groups(model, family, 2, strided=True)
    src = with_tokenizer(model, tmp_path / "s", calib_text)
    calibrated = method == "svd" or grouping == "similarity"
    options = (
        {"calibration": str(calib_text), "calibration_tokens": 256, "calibration_seq_len": 32} if calibrated else {}
    )
    out = convert_checkpoint(src, tmp_path / "o", 2, method, grouping=grouping, progress=False, **options).output
    a, b = read_all(src), read_all(out)
    changed = {re.sub(r"\.\d+\.", ".{layer}.", n, count=1) for n in a if n not in b or not torch.equal(a[n], b[n])}
    changed = {re.sub(r"\.norms\.\d+\.", ".norms.{head}.", n) for n in changed}
    record = json.loads((out / "mha2gqa_conversion.json").read_text())["conversion"]
    assert set(record["rewritten"]) == changed
    assert {t.split(".")[-2] if ".norms." not in t else t.split(".")[-4] for t in changed} == roles
    card = (out / "README.md").read_text()
    assert all(f"`{t}`" in card for t in changed)
    if roles <= {"k_proj", "v_proj", "qkv_proj", "k_layernorm"} and method in ("mean", "first", "random"):
        assert "Only the attention K/V projections changed" in card
    else:
        assert "The attention Q/K/V/O projections changed" in card and "Only the attention" not in card
    if grouping == "similarity":
        assert "grouping `similarity`" in card and "query heads move with their KV heads" in card


def test_head_contribution_error_sees_through_the_basis_svd_absorbs(calib_text, tmp_path):
    """Heads that differ by RoPE-commuting transforms: svd converts them exactly, so each head's
    contribution to the residual stream is unchanged (error ~0), while its raw output, expressed in
    the new value basis, differs; mean pooling cannot undo the transforms and shows real error."""
    from mha2gqa.eval.attention import attention_similarity

    model = random_model(tiny_config("llama", vocab_size=300), seed=7)
    relate_groups(model, "llama", 2)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    svd = convert_checkpoint(src, tmp_path / "svd", 2, **calibrated(calib_text)).output
    mean = convert_checkpoint(src, tmp_path / "mean", 2, "mean", progress=False).output
    batch = torch.randint(3, 300, (1, 48), generator=torch.Generator().manual_seed(0))
    exact = attention_similarity(load(src), load(svd), batch, chunk=16).summary
    pooled = attention_similarity(load(src), load(mean), batch, chunk=16).summary
    assert exact.mean_contribution_rel_error < 1e-4 < exact.mean_output_rel_error
    assert pooled.mean_contribution_rel_error > 1e-2


def test_eigenvectors_take_one_sign_so_near_equal_statistics_give_near_equal_weights(calib_text, tmp_path, monkeypatch):
    """An eigenvector is defined up to its sign, and LAPACK's choice can flip under a change in the last
    bits (statistics summed in another order on several processes): the conversion must not follow it.
    Here the solver is made to hand every eigenvector back negated (its other valid answer); the
    converted weights must be the same bytes."""
    from safetensors.torch import load_file

    from mha2gqa.convert.calibration.stats import canonical_sign

    vecs = torch.randn(3, 6, 4, dtype=torch.complex128)
    fixed = canonical_sign(vecs)
    assert torch.equal(canonical_sign(-vecs), fixed) and torch.equal(canonical_sign(fixed), fixed)
    lead = fixed.gather(-2, fixed.abs().argmax(-2, keepdim=True))
    assert (lead.real > 0).all() and torch.equal(fixed.abs(), vecs.abs())
    model = random_model(tiny_config("llama", vocab_size=300), seed=3)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    kw = calibrated(calib_text, refit=True, refit_steps=4)
    plain = convert_checkpoint(src, tmp_path / "plain", 1, **kw).output
    eigh = torch.linalg.eigh

    def flipped(gram):
        values, vectors = eigh(gram)
        return values, -vectors

    monkeypatch.setattr(torch.linalg, "eigh", flipped)
    other = convert_checkpoint(src, tmp_path / "other", 1, **kw).output
    a, b = load_file(plain / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
