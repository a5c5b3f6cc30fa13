"""The comparison report's figures over synthetic compare records, and the numpy t-SNE behind Figure 7."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from llmeasyquant.record import Record
from llmeasyquant.report.compare_figures import FIGURES, write_figures
from llmeasyquant.report.style import method_colours, protocol_caption
from llmeasyquant.report.tsne import input_affinities, standardize, tsne

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"
WIKITEXT_TEST_SHA = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"
LAYERS = [f"model.layers.{b}.{part}" for b in range(5)
          for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj")]  # 30 layers


def _protocol() -> dict:
    return {"text_source": "file wiki.test.raw", "text_sha256": WIKITEXT_TEST_SHA, "seqlen": 512, "max_windows": 20,
            "windows": 20, "bos": False, "threads": 2, "seed": 0}


def _row(method: str, scheme: str, level: float, rng: np.random.Generator) -> Record:
    """One compare record; `level` sets how much the method hurts (0 = the unquantized reference)."""
    quantized = level > 0
    edges = np.linspace(-0.2, 0.2, 41)
    floats = np.histogram(rng.normal(0, 0.05, 5000), edges)[0]
    levels = np.round(rng.normal(0, 0.05, 5000) / (0.4 / 15)) * (0.4 / 15)  # 16 levels
    metrics = {
        "method": method, "scheme": scheme, "ppl": 18.0 * (1 + level), "ppl_delta_pct": 100 * level,
        "kld": 0.05 * level, "top1": 1 - 0.1 * level, "quantize_s": 20.0 * level,
        "checkpoint_bytes": int(5e8 / (1 + 3 * quantized)), "bits_per_weight": 32 / (1 + 7 * quantized),
        "calib_samples": int(64 * level), "decode_tok_s": 30.0 + 10 * level, "prefill_tok_s": 300.0,
        "peak_rss_mb": 900.0,
        "latency": {"load": 0.004 * level, "quant": 0.002 * level, "gemm": 0.02, "other": 0.01},
        "layer_errors": {name: 0.01 * level * (1 + rng.random()) for name in LAYERS} if quantized else None,
        "weight_hist": {"layer": LAYERS[8], "edges": edges.tolist(), "float": floats.tolist(),
                        "quantized": np.histogram(levels, edges)[0].tolist()} if quantized else None,
        "weight_summaries": {name: (rng.normal(level, 0.3, 8)).tolist() for name in LAYERS} if quantized else None,
        "context_ppl": {str(n): 18.0 * (1 + level) * (512 / n) ** 0.2 for n in (128, 256, 512, 1024)},
    }
    return Record("compare", "smollm2-135m", metrics, _protocol(), command="llmeasyquant compare", versions={},
                  machine={"processor": "x86_64", "cpus": 16})


def make_records() -> list[Record]:
    """fp32 then three methods, every field filled."""
    rng = np.random.default_rng(0)
    return [_row("fp32", "fp32", 0.0, rng), _row("rtn", "w8a8", 0.05, rng), _row("awq", "w4a16-g64", 0.3, rng),
            _row("gptq", "w4a16-g64", 0.2, rng)]


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG
    assert 5_000 < len(data) < 300_000, f"{path.name}: {len(data)} bytes"


@pytest.mark.parametrize("stem", list(FIGURES))
def test_each_figure_is_a_small_png(tmp_path: Path, stem: str) -> None:
    _, plot = FIGURES[stem]
    path = plot(make_records(), tmp_path / f"{stem}.png")
    _assert_png(path)
    assert [p.name for p in tmp_path.iterdir()] == [f"{stem}.png"]  # written atomically: no temporary left


def test_write_figures_writes_the_eight_in_report_order(tmp_path: Path) -> None:
    paths = write_figures(make_records(), tmp_path / "figs")
    assert list(paths) == ["weight_distributions", "quality", "latency_breakdown", "radar", "error_heatmap",
                           "error_violins", "weight_tsne", "context_scaling"]
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(f"{s}.png" for s in paths)
    for path in paths.values():
        _assert_png(path)


def test_rows_missing_optional_fields_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    records = make_records()
    optional = ("latency", "layer_errors", "weight_hist", "weight_summaries", "context_ppl", "decode_tok_s",
                "calib_samples")
    for field in optional:  # older records: the field absent in one row, None in another
        del records[1].metrics[field]
        records[2].metrics[field] = None
    records[3].metrics["weight_hist"]["float"] = [1, 2, 3]  # malformed: wrong length for its edges
    for path in write_figures(records, tmp_path).values():
        _assert_png(path)
    assert "weight_hist of gptq: 3 float counts for 41 edges; skipping the row" in caplog.text


def test_a_field_no_record_holds_gives_a_not_measured_panel(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    records = make_records()
    for record in records:
        for field in ("latency", "layer_errors", "weight_hist", "weight_summaries", "context_ppl"):
            record.metrics.pop(field)
    with caplog.at_level("INFO", logger="llmeasyquant.report.style"):
        paths = write_figures(records, tmp_path)
    assert len(paths) == 8
    for path in paths.values():
        _assert_png(path)
    said = " ".join(r.getMessage() for r in caplog.records)
    for field in ("latency", "layer_errors", "weight_hist", "weight_summaries", "context_ppl"):
        assert f"no record holds {field}" in said
    assert "no record holds ppl" not in said  # quality and radar still have their data


def test_no_records_at_all_still_gives_eight_figures(tmp_path: Path) -> None:
    assert len(write_figures([], tmp_path)) == 8
    assert protocol_caption([]) == "no records: protocol not recorded"


def test_protocol_caption() -> None:
    records = make_records()
    assert protocol_caption(records) == ("SmolLM2-135M-Instruct · WikiText-2 raw test (file wiki.test.raw) · "
                                         "20 windows × 512 tokens · 2 threads · x86_64, 16 CPUs")
    records[0].machine["cpu"] = "AMD EPYC 9R14"  # the CPU model, where a record names it, beats the architecture
    assert protocol_caption(records).endswith("2 threads · AMD EPYC 9R14, 16 CPUs")
    records[2].protocol["seqlen"] = 2048
    records[0] = dataclasses.replace(records[0], model="./my-model")
    records[0].protocol["text_sha256"] = "0" * 64  # not a known evaluation split: the source as recorded
    caption = protocol_caption(records)
    assert caption.startswith("./my-model · file wiki.test.raw · 20 windows × 512 tokens")
    assert caption.endswith("rows differ in text_sha256, seqlen")


def test_colours_follow_record_order_and_duplicate_methods_get_their_scheme() -> None:
    records = make_records()
    records[3].metrics["method"] = "rtn"
    colours = method_colours(records)
    assert list(colours) == ["fp32", "rtn w8a8", "awq", "rtn w4a16-g64"]
    assert colours["fp32"] == "0.35"  # the reference in grey
    assert len({colours[k] for k in list(colours)[1:]}) == 3
    assert method_colours(records) == colours


def test_radar_scores_put_the_best_row_at_one() -> None:
    from llmeasyquant.report.compare_figures import _normalize

    assert _normalize([20.0, 40.0, None], "best/x") == [1.0, 0.5, 0.0]  # ppl, bytes: lower is better
    assert _normalize([10.0, 40.0], "x/best") == [0.25, 1.0]  # tokens/s
    assert _normalize([0.0, 32.0, 128.0], "1-x/max") == [1.0, 0.75, 0.0]  # calibration samples, setup seconds
    assert _normalize([None, None], "x/best") == [0.0, 0.0]


def test_layers_sort_in_model_order() -> None:
    from llmeasyquant.report.layer_figures import _layer_key

    names = ["lm_head", "model.layers.10.mlp.up_proj", "model.layers.2.self_attn.q_proj", "model.layers.2.mlp.up_proj"]
    assert sorted(names, key=_layer_key) == ["model.layers.2.mlp.up_proj", "model.layers.2.self_attn.q_proj",
                                             "model.layers.10.mlp.up_proj", "lm_head"]


# ---- t-SNE -------------------------------------------------------------------------------------------------------

def _clusters(seed: int = 0, per: int = 30) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 10, size=(3, 12))
    points = np.concatenate([c + rng.normal(0, 1, size=(per, 12)) for c in centres])
    return points, np.repeat(np.arange(3), per)


def test_tsne_keeps_well_separated_clusters_apart() -> None:
    points, labels = _clusters()
    y = tsne(points, perplexity=10, iterations=500, seed=0)
    assert y.shape == (90, 2) and np.all(np.isfinite(y))
    d = np.linalg.norm(y[:, None] - y[None], axis=-1)
    np.fill_diagonal(d, np.inf)
    assert np.all(labels[d.argmin(axis=1)] == labels)  # every point's nearest neighbour is in its own cluster
    same = labels[:, None] == labels[None]
    assert d[~same].min() > 2 * np.median(d[same & np.isfinite(d)])  # gaps between clusters exceed their spread


def test_tsne_is_deterministic_per_seed() -> None:
    points, _ = _clusters(1, per=15)
    a = tsne(points, perplexity=5, iterations=300, seed=3)
    assert np.array_equal(a, tsne(points, perplexity=5, iterations=300, seed=3))
    assert not np.allclose(a, tsne(points, perplexity=5, iterations=300, seed=4))


def test_tsne_inputs() -> None:
    assert np.array_equal(standardize(np.array([[1.0, 5.0], [3.0, 5.0]])), [[-1.0, 0.0], [1.0, 0.0]])
    p = input_affinities(standardize(_clusters(per=10)[0]), perplexity=5)
    assert np.allclose(p, p.T) and p.sum() == pytest.approx(1.0)
    assert tsne(np.ones((2, 3))).shape == (2, 2)  # too few points to arrange: still an answer
    with pytest.raises(ValueError, match="NaN"):
        tsne(np.array([[0.0, np.nan]] * 5))
    with pytest.raises(ValueError, match="2-D"):
        tsne(np.zeros(5))
