"""tools/protocol.py: the benchmarking protocol's arithmetic, against figures worked out by hand (each assertion
below fails when a formula changes: tokens/s over the whole step, MFU with and without the attention term, the
median and min-max, the best point, the ratio and its overlap flag)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import protocol  # noqa: E402  (tools/ is not a package)


def test_step_figures_by_hand():
    # Three steps of 3,000 tokens: forward+backward 1, 1, 2 s; optimizer 0.5 s each -> steps 1.5, 1.5, 2.5 s.
    f = protocol.step_figures([1.0, 1.0, 2.0], [0.5, 0.5, 0.5], [3.0, 2.0, 1.0], tokens=3000, flops_per_token=6e9,
                              peak_tflops=1.0, attention_flops_per_token=1e9, recomputed=1.0)
    assert f["step_times_s"] == [1.5, 1.5, 2.5]
    assert f["step_s"] == 1.5 and f["fwd_bwd_s"] == 1.0 and f["optimizer_s"] == 0.5
    assert f["tokens_per_s"] == pytest.approx(2000.0)  # 3000 / 1.5: the optimizer's time counts
    assert f["tokens_per_s_fwd_bwd"] == pytest.approx(3000.0)
    assert f["mfu"] == pytest.approx(12.0)  # 2000 tokens/s x 6e9 FLOPs / 1e12 FLOP/s
    assert f["mfu_no_attention"] == pytest.approx(10.0)  # 6 N alone: 2000 x 5e9 / 1e12
    assert f["mfu_fwd_bwd"] == pytest.approx(18.0)
    assert f["hfu_fwd_bwd"] == pytest.approx(24.0)  # + a recomputed forward, a third of 6e9
    assert f["losses"] == [3.0, 2.0, 1.0]


def test_step_figures_without_recompute_hfu_is_mfu():
    f = protocol.step_figures([2.0], [0.0], [1.0], tokens=100, flops_per_token=1e10, peak_tflops=1.0, recomputed=0.0)
    assert f["hfu_fwd_bwd"] == pytest.approx(f["mfu_fwd_bwd"]) == pytest.approx(0.5)


def test_step_figures_refuse_mismatched_times():
    with pytest.raises(ValueError, match="2 forward"):
        protocol.step_figures([1.0, 1.0], [0.5], [1.0], tokens=1, flops_per_token=1.0, peak_tflops=1.0)


def test_train_flops_per_token_is_the_adapters():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_speedloader.models import get_adapter

    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    adapter = get_adapter(LlamaForCausalLM(config))
    # Per block: q 64x64, k and v 64x32 each, o 64x64, MLP 3 x 64x176, two norms of 64; the final norm; the LM head
    # (a matmul every token: counted, the input embedding is not).
    non_embedding = 3 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64) + 64 + 64 * 100
    assert adapter.num_non_embedding_params() == non_embedding
    by_hand = 6 * non_embedding + 12 * 3 * 64 * 128
    assert protocol.train_flops_per_token(non_embedding, 3, 64, 128) == by_hand
    assert adapter.flops_per_token(128) == pytest.approx(by_hand)
    assert protocol.train_flops_per_token(non_embedding, 3, 64, 128, attention=False) == 6 * non_embedding


def test_spread_median_and_range():
    s = protocol.spread([30.0, 10.0, 20.0, 40.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (25.0, 10.0, 40.0, 4)
    assert s["spread"] == pytest.approx(30.0 / 25.0)
    with pytest.raises(ValueError):
        protocol.spread([])


def test_ratio_is_median_over_median_and_flags_overlap():
    ours, theirs = protocol.spread([100.0, 110.0, 120.0]), protocol.spread([60.0, 80.0, 105.0])
    r = protocol.ratio(ours, theirs)
    assert r["ratio"] == pytest.approx(110.0 / 80.0) and r["overlap"]  # 100-120 meets 60-105
    apart = protocol.ratio(ours, protocol.spread([60.0, 80.0, 99.0]))
    assert not apart["overlap"]
    assert protocol.ranges_overlap({"min": 1, "max": 2}, {"min": 2, "max": 3})


def test_best_point_keeps_out_of_memory_points_out():
    rows = [{"spec": "a", "status": "oom"}, {"spec": "b", "status": "ok", "tokens_per_s": 5.0},
            {"spec": "c", "status": "ok", "tokens_per_s": 7.0}, {"spec": "d", "status": "failed", "tokens_per_s": 9.0},
            {"spec": "e", "status": "skipped"}]
    assert protocol.best_point(rows)["spec"] == "c"
    assert protocol.best_point(rows[:1]) is None
    assert protocol.best_point([{"spec": "g", "status": "ok", "generated_tokens_per_s": 3.0}],
                               key="generated_tokens_per_s")["spec"] == "g"


def test_divisors_and_order():
    assert protocol.divisors(8) == [1, 2, 4, 8] and protocol.divisors(12) == [1, 2, 3, 4, 6, 12]
    with pytest.raises(ValueError):
        protocol.divisors(0)
    assert protocol.run_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert protocol.run_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert protocol.run_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_check_protocol_minimums():
    protocol.check_protocol(invocations=3, steps=5, warmup=2)
    with pytest.raises(ValueError, match=r"invocations=2 \(at least 3\).*steps=4 \(at least 5\)"):
        protocol.check_protocol(invocations=2, steps=4, warmup=2)
    with pytest.raises(ValueError, match="warmup=1"):
        protocol.check_protocol(invocations=3, steps=5, warmup=1)


def test_summarize_counts_only_runs_that_finished():
    runs = [{"status": "ok", "tokens_per_s": 10.0}, {"status": "oom"}, {"status": "ok", "tokens_per_s": 14.0},
            {"status": "ok", "tokens_per_s": 12.0}]
    s = protocol.summarize(runs)
    assert (s["median"], s["min"], s["max"], s["n"], s["not_ok"]) == (12.0, 10.0, 14.0, 3, ["oom"])
    assert protocol.summarize([{"status": "oom"}])["median"] is None


def test_paired_ratio_over_the_invocations_both_ran_in():
    """Rows as {invocation: figure}: the same invocations divide all; differing ones divide the shared ones (3 or
    more) or are flagged."""
    same = protocol.paired_ratio({0: 300.0, 1: 330.0, 2: 360.0}, {0: 100.0, 1: 110.0, 2: 120.0})
    assert same["ratio"] == pytest.approx(3.0) and same["invocations"] is None and not same["separate_invocations"]
    later = protocol.paired_ratio({0: 300.0, 1: 300.0, 2: 300.0, 3: 400.0, 4: 400.0, 5: 400.0},
                                  {3: 100.0, 4: 100.0, 5: 100.0})
    assert later["ratio"] == pytest.approx(4.0) and later["invocations"] == [3, 4, 5]
    assert not later["separate_invocations"] and later["overlap"] is False
    apart = protocol.paired_ratio({0: 300.0, 1: 300.0, 2: 300.0}, {2: 100.0, 3: 100.0, 4: 100.0})
    assert apart["separate_invocations"] and apart["invocations"] == [2] and apart["ratio"] == pytest.approx(3.0)
