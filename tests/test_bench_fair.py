"""tools/bench_fair.py: each family's sweep (ladders, the kept-pair estimate, the pruning of points known not to fit),
the best-point choice, the summary's ratios, and one whole table run on the CPU through real worker processes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_fair  # noqa: E402  (tools/ is not a package)
import regime_map  # noqa: E402
from host_load import HostLoad  # noqa: E402

T40 = bench_fair.TABLES["train_7b_L8_b8_cap40"]


def _args(**kw) -> argparse.Namespace:
    base = dict(steps=5, warmup=2, device="cpu", dry_run=False, host_busy=0, host_copy=0, timeout=60, invocations=3,
                gpus=1)
    return argparse.Namespace(**{**base, **kw})


def test_kept_pairs_by_hand():
    shape = bench_fair.Shape.of(T40)
    assert (shape.params, shape.root_params, shape.unit_params) == (1881214976, 262148096, 202383360)
    # 40 GiB - 16 B x (root + unit 1) - 2 gathered bf16 units - 4 GiB = 30,412,668,928 B over 34 x 4096 x 4096 B a
    # sequence's pair: 53.3 -> 53 of 64 pairs; twice the sequences, half the pairs.
    assert [bench_fair.kept_pairs(T40, shape, n) for n in (1, 2, 4)] == [53, 26, 13]
    tight = bench_fair.TABLES["map_7b_L8_b8_cap24"]
    assert bench_fair.kept_pairs(tight, shape, 1) == 23
    assert bench_fair.ceiling_fits(T40, shape) and not bench_fair.ceiling_fits(tight, shape)


def test_ladders_sweep_every_micro_batch_with_the_same_allowances():
    shape = bench_fair.Shape.of(T40)
    fsdp2 = bench_fair.train_ladders(T40, "fsdp2-offload", shape)
    assert len(fsdp2) == 4  # n = 1, 2, 4, 8
    assert fsdp2[0][0] == ["fsdp2-offload:1x8:root=device:dev=1:recompute=off:reshard=off"]
    assert fsdp2[3][-1] == ["fsdp2-offload:8x1:root=device:dev=1"]
    layer_major = bench_fair.train_ladders(T40, "layer-major", shape)
    assert len(layer_major) == 3  # N = 1 is the canonical schedule, not layer-major
    assert layer_major[0][0] == ["speedloader-overlap:1x8:root=device:dev=1:adamw=pool:keep=53"]  # the trainer's step
    assert [tier[0].rsplit("=", 1)[1] for tier in layer_major[0]] == ["53", "45", "37", "29"]
    ceiling = bench_fair.train_ladders(bench_fair.TABLES["map_7b_L8_b8_cap24"], "ceiling", shape)
    assert all(spec.endswith(":cap=none:recompute=off:reshard=off") for spec in ceiling[0][0])
    # Between no recompute and every block: one block (the 8th), then every other, as torchtitan's selective option.
    assert [[s.split(":cap=none")[1] for s in tier] for tier in ceiling[0]] == [
        [":recompute=off:reshard=off"], [":recompute=every8:reshard=off", ":recompute=off"],
        [":recompute=every2:reshard=off", ":reshard=off"], [""]]
    two_layers = bench_fair.train_ladders(bench_fair.TABLES["cpu_check"], "fsdp2-offload",
                                          bench_fair.Shape.of(bench_fair.TABLES["cpu_check"]))
    assert [len(tier) for tier in two_layers[0]] == [1, 2, 1, 1]  # every 2nd block is the last of 2: once
    assert bench_fair.train_ladders(T40, "deepspeed-offload", shape)[1] == [["deepspeed-offload:2x4"]]
    with pytest.raises(ValueError, match="unknown training family"):
        bench_fair.train_ladders(T40, "megatron", shape)


def test_sweep_prunes_tiers_that_ran_out_of_memory_at_a_smaller_micro_batch(tmp_path, monkeypatch):
    # Memory grows with n: a tier out of memory at n is out of memory at every larger n. The stand-in worker says
    # 'oom' for every tier-0 point and for every point at n = 4 (what a GPU would; the CPU has no cap to hit).
    launched = []

    def fake_run_point(table, spec, args, **fields):
        launched.append(spec)
        oom = fields["tier"] == 0 or ":4x2" in spec or ":8x1" in spec
        return {"spec": spec, "family": bench_fair.family_of(spec), **fields,
                "status": "oom" if oom else "ok", "tokens_per_s": 1.0 + len(launched)}

    monkeypatch.setattr(bench_fair, "run_point", fake_run_point)
    record = {"sweep": [], "invocations": [], "device": "cpu", "commit": "x"}
    bench_fair.sweep(T40, ["fsdp2-offload"], _args(), record, tmp_path / "r.json")
    by_spec = {r["spec"]: r["status"] for r in record["sweep"]}
    assert by_spec["fsdp2-offload:1x8:root=device:dev=1:recompute=off:reshard=off"] == "oom"
    assert by_spec["fsdp2-offload:1x8:root=device:dev=1:recompute=off"] == "ok"  # tier 1 fits: the ladder stops
    assert by_spec["fsdp2-offload:1x8:root=device:dev=1:recompute=every8:reshard=off"] == "ok"  # one block recomputed
    assert "fsdp2-offload:1x8:root=device:dev=1" not in by_spec
    assert "fsdp2-offload:2x4:root=device:dev=1:recompute=every2:reshard=off" not in by_spec
    assert by_spec["fsdp2-offload:2x4:root=device:dev=1:recompute=off:reshard=off"] == "skipped"  # not launched
    assert "fsdp2-offload:2x4:root=device:dev=1:recompute=off:reshard=off" not in launched
    assert by_spec["fsdp2-offload:4x2:root=device:dev=1"] == "oom"  # n = 4: nothing fits
    assert all(v == "skipped" for k, v in by_spec.items() if ":8x1" in k)  # so nothing at n = 8 is launched
    assert not any(":8x1" in s for s in launched)
    best = bench_fair.best_specs(record, T40, ["fsdp2-offload"])
    assert best == {"fsdp2-offload": "fsdp2-offload:2x4:root=device:dev=1:recompute=off"}  # the fastest that ran


def test_a_point_that_timed_out_prunes_nothing_at_larger_micro_batches(tmp_path, monkeypatch):
    # DeepSpeed's first worker on a fresh machine builds its CPU Adam extension and may outlast the worker's timeout:
    # that says nothing about memory, so n = 2, 4, 8 still run (and a point out of memory still prunes what follows).
    launched = []

    def fake_run_point(table, spec, args, **fields):
        launched.append(spec)
        status = "timeout" if ":1x8" in spec else "oom" if ":4x2" in spec else "ok"
        return {"spec": spec, "family": bench_fair.family_of(spec), **fields, "status": status,
                "tokens_per_s": 1.0 if status == "ok" else None}

    monkeypatch.setattr(bench_fair, "run_point", fake_run_point)
    record = {"sweep": [], "invocations": [], "device": "cpu", "commit": "x"}
    bench_fair.sweep(T40, ["deepspeed-offload"], _args(), record, tmp_path / "r.json")
    by_spec = {r["spec"]: r["status"] for r in record["sweep"]}
    assert by_spec == {"deepspeed-offload:1x8": "timeout", "deepspeed-offload:2x4": "ok",
                       "deepspeed-offload:4x2": "oom", "deepspeed-offload:8x1": "skipped"}
    assert launched == ["deepspeed-offload:1x8", "deepspeed-offload:2x4", "deepspeed-offload:4x2"]
    assert bench_fair.sweep_pending(record, T40) == {}  # every micro-batch has its row: run, out of memory, skipped


def test_a_sweep_stopped_part_way_names_what_is_left_and_the_peer_not_repeated():
    """A sweep part stopped by its time budget leaves micro-batches of a family unrun: the summary names them (the
    family's best point may be among them), and a peer swept but not repeated with its best point so far. A ladder
    whose points ran under an older spec of its tiers counts as swept."""
    record = {"sweep": [_row("deepspeed-offload:1x8", 100.0, 1), _row("deepspeed-offload:2x4", 130.0, 2),
                        _row("speedloader-overlap:1x8:root=device:dev=1:keep=23", 300.0, 1),  # before adamw=pool
                        _row("speedloader-overlap:2x4:root=device:dev=1:adamw=pool:keep=11", 320.0, 2),
                        _row("speedloader-overlap:4x2:root=device:dev=1:adamw=pool:keep=5", None, 4, status="oom"),
                        _row("speedloader-overlap:1x8:root=device:dev=1:adamw=pool:keep=23:eager", 250.0, 1)],
              "invocations": [{"index": i, "rows": [_row("speedloader-overlap:2x4:root=device:dev=1:adamw=pool:keep=11",
                                                         320.0, 2)]} for i in range(3)],
              "device": "cpu", "commit": "x"}
    for row in record["sweep"]:
        row["family"] = bench_fair.family_of(row["spec"])
    s = bench_fair.summarize(record, T40)
    eager_left = [ladder[0][0] for ladder in bench_fair.train_ladders(T40, bench_fair.EAGER, bench_fair.Shape.of(T40))][1:]
    assert [spec.split(":")[1] for spec in eager_left] == ["2x4", "4x2"]  # layer-major eager, swept beside DeepSpeed
    assert s["sweep_pending"] == {"deepspeed-offload": ["deepspeed-offload:4x2", "deepspeed-offload:8x1"],
                                  bench_fair.EAGER: eager_left}
    assert s["peers_not_repeated"] == {"deepspeed-offload": {"spec": "deepspeed-offload:2x4", "tokens_per_s": 130.0}}
    record["summary"] = s
    text = bench_fair.markdown(record, T40)
    assert "- deepspeed-offload: swept, not repeated: its best point deepspeed-offload:2x4 ran at 130.0" in text
    assert ("- deepspeed-offload's sweep is partial: 2 micro-batches not run yet (deepspeed-offload:4x2, "
            "deepspeed-offload:8x1): run --part sweep again") in text


def test_a_ladder_tries_the_next_tier_where_the_allocator_retried(tmp_path, monkeypatch):
    # Layer-major's kept pairs at the 40 GiB cap: at n = 1 keep=53 fits but the allocator retried in the timed steps
    # (its reserved memory met the cap), so keep=45 runs too and is the faster; the ladder then stops (37, 29 not
    # run). At n = 2 keep=26 ran without retries: the ladder stops there. At n = 4 keep=13 is out of memory and
    # keep=11 retried: keep=9 runs, and keep=7 does not.
    launched = []
    retries = {"keep=53": 3, "keep=11": 2}
    speed = {"keep=53": 10.0, "keep=45": 12.0, "keep=26": 11.0, "keep=11": 9.0, "keep=9": 8.0}

    def fake_run_point(table, spec, args, **fields):
        launched.append(spec)
        keep = spec.rsplit(":", 1)[1]
        return {"spec": spec, "family": bench_fair.family_of(spec), **fields,
                "status": "oom" if keep == "keep=13" else "ok", "tokens_per_s": speed.get(keep),
                "alloc_retries_timed": retries.get(keep, 0)}

    monkeypatch.setattr(bench_fair, "run_point", fake_run_point)
    record = {"sweep": [], "invocations": [], "device": "cpu", "commit": "x"}
    bench_fair.sweep(T40, ["layer-major"], _args(), record, tmp_path / "r.json")
    keeps = [s.split(":", 1)[1] for s in launched]
    at = ":root=device:dev=1:adamw=pool:"
    assert keeps == [f"1x8{at}keep=53", f"1x8{at}keep=45", f"2x4{at}keep=26",
                     f"4x2{at}keep=13", f"4x2{at}keep=11", f"4x2{at}keep=9"]
    assert bench_fair.best_specs(record, T40, ["layer-major"]) == {"layer-major": f"speedloader-overlap:1x8{at}keep=45"}
    assert bench_fair.retried({"alloc_retries_timed": 1}) and not bench_fair.retried({"alloc_retries": 9})


def test_the_eager_row_beside_deepspeed_is_swept_to_its_own_best(tmp_path, monkeypatch):
    # At the 24 GiB map point the compiled best (2x4, keep=11) ran out of memory eager: eager activations take more.
    # So sweeping DeepSpeed sweeps layer-major's ladders eager too, and the repeat runs the best eager point that fit.
    m24 = bench_fair.TABLES["map_7b_L8_b8_cap24"]
    assert bench_fair.with_eager(m24, ["deepspeed-offload"]) == ["deepspeed-offload", "layer-major-eager"]
    assert bench_fair.with_eager(m24, ["layer-major", "fsdp2-offload"]) == ["layer-major", "fsdp2-offload"]
    shape = bench_fair.Shape.of(m24)
    eager = bench_fair.train_ladders(m24, "layer-major-eager", shape)
    compiled = bench_fair.train_ladders(m24, "layer-major", shape)
    assert eager == [[[spec + ":eager" for spec in tier] for tier in ladder] for ladder in compiled]
    assert all(bench_fair.family_of(spec) == "layer-major-eager" for ladder in eager for tier in ladder for spec in tier)

    def fake_run_point(table, spec, args, **fields):  # eager fits from keep=7 down, DeepSpeed everywhere; 2x4 wins
        keep = int(spec.split("keep=")[1].split(":")[0]) if "keep=" in spec else 0
        oom = spec.endswith(":eager") and keep > 7
        return {"spec": spec, "family": bench_fair.family_of(spec), **fields, "status": "oom" if oom else "ok",
                "tokens_per_s": None if oom else 100.0 + keep + 50.0 * (":2x4" in spec)}

    monkeypatch.setattr(bench_fair, "run_point", fake_run_point)
    record = {"sweep": [], "invocations": [], "device": "cpu", "commit": "x"}
    bench_fair.sweep(m24, bench_fair.with_eager(m24, ["layer-major", "deepspeed-offload"]), _args(), record,
                     tmp_path / "r.json")
    best = bench_fair.best_specs(record, m24, ["layer-major", "deepspeed-offload"])
    at = "speedloader-overlap:2x4:root=device:dev=1:adamw=pool:"
    assert best["layer-major"] == f"{at}keep=11"
    assert best["layer-major-eager"] == f"{at}keep=7:eager"  # the compiled best's keep=11 was out of memory eager
    # A record made before the eager sweep: the compiled best point, eager. An eager sweep where nothing fit: no row.
    old = {"sweep": [r for r in record["sweep"] if r["family"] != "layer-major-eager"]}
    assert bench_fair.best_specs(old, m24, ["layer-major", "deepspeed-offload"])["layer-major-eager"] == \
        f"{at}keep=11:eager"
    none_fit = {"sweep": old["sweep"] + [{"spec": f"{at}keep=11:eager", "family": "layer-major-eager",
                                          "status": "oom"}]}
    assert "layer-major-eager" not in bench_fair.best_specs(none_fit, m24, ["layer-major", "deepspeed-offload"])


def test_the_eager_ratio_beside_deepspeed():
    lm, eager, ds = ("speedloader-overlap:2x4:keep=11", "speedloader-overlap:2x4:keep=7:eager", "deepspeed-offload:8x1")
    invocations = [{"index": i, "rows": [_row(lm, 360.0, 2), _row(eager, 300.0 + i, 2), _row(ds, 150.0, 8)]}
                   for i in range(3)]
    r = bench_fair.summarize({"invocations": invocations}, T40)["ratios"]
    assert r["layer-major/deepspeed-offload"]["ratio"] == pytest.approx(2.4)  # compiled over eager
    assert r["layer-major-eager/deepspeed-offload"]["ratio"] == pytest.approx(301.0 / 150.0)  # eager over eager
    assert r["best_peer"] == "deepspeed-offload"


def _row(spec, value, n=None, status="ok"):
    row = {"spec": spec, "status": status, "tokens_per_s": value, "mfu": (value or 0) / 1e5, "peak_hbm_gib": 30.0}
    if not spec.startswith("speedloader"):  # bench_train's rows of the peers and the ceiling since e2a292b
        row["head_loss_chunk_tokens"] = 4096
    if n:
        row.update(sub_batch_size=n, num_sub_batches=8 // n)
    return row


def test_summary_ratios_medians_overlap_and_binding_caps():
    lm, fs, ds = ("speedloader-overlap:1x8:root=device:dev=1:keep=53", "fsdp2-offload:4x2:root=device:dev=1",
                  "deepspeed-offload:8x1")
    invocations = [{"index": i, "rows": [_row(lm, a, 1), _row(fs, b, 4), _row(ds, c, 8)]}
                   for i, (a, b, c) in enumerate([(300.0, 200.0, 100.0), (310.0, 150.0, 120.0), (290.0, 210.0, 90.0)])]
    invocations.append({"index": 3, "rows": [_row(fs, None, 4, status="oom")]})
    s = bench_fair.summarize({"invocations": invocations}, T40)
    fam = s["families"]
    assert (fam["layer-major"]["median"], fam["layer-major"]["min"], fam["layer-major"]["max"]) == (300.0, 290.0, 310.0)
    assert fam["fsdp2-offload"]["n"] == 3 and fam["fsdp2-offload"]["not_ok"] == ["oom"]
    r = s["ratios"]["layer-major/fsdp2-offload"]
    assert r["ratio"] == pytest.approx(1.5) and not r["overlap"]
    assert r["binds"] and not r["eighth_or_less"]  # its best n = 4 < 8, but not <= 1
    assert s["ratios"]["layer-major/deepspeed-offload"]["ratio"] == pytest.approx(3.0)
    assert not s["ratios"]["layer-major/deepspeed-offload"]["binds"]  # its best runs the whole batch at once
    assert s["ratios"]["best_peer"] == "fsdp2-offload"
    assert "bound" not in r  # no ceiling in this table: no bound


def test_auto_is_one_point_with_the_tables_allowances_and_its_ratio_over_each_peer():
    """--family auto: the trainer with schedule=auto given the batch alone (tools/bench_auto.py), the same GPU-resident
    modules as the others; the summary divides its median by each canonical peer's over the invocations both ran in."""
    import bench_train

    assert bench_fair.train_ladders(T40, "auto", bench_fair.Shape.of(T40)) == [[["auto:8:root=device:dev=1"]]]
    assert bench_fair.family_of("auto:8:root=device:dev=1") == "auto"
    for bad in ("auto:2x4", "auto:8:keep=3", "auto:8:recompute=off"):
        with pytest.raises(ValueError):
            bench_train.parse_contender(bad, None)
    lm, fs, auto = "speedloader-overlap:1x8:root=device:dev=1:keep=53", "fsdp2-offload:4x2:root=device:dev=1", \
        "auto:8:root=device:dev=1"
    invocations = [{"index": i, "rows": [_row(lm, a, 1), _row(fs, b, 4), {**_row(auto, c), "schedule": "canonical"}]}
                   for i, (a, b, c) in enumerate([(300.0, 200.0, 210.0), (310.0, 150.0, 190.0), (290.0, 210.0, 205.0)])]
    ratios = bench_fair.summarize({"invocations": invocations}, T40)["ratios"]
    assert ratios["auto/fsdp2-offload"]["ratio"] == pytest.approx(205.0 / 200.0)
    assert ratios["best_peer"] == "fsdp2-offload"  # auto is no peer
    assert "auto/deepspeed-offload" not in ratios  # not in the table's invocations
    point = regime_map.map_point({"table": dataclasses.asdict(T40), "device": "cpu", "sweep": [],
                                  "invocations": invocations})
    assert point["auto"]["ratio"] == pytest.approx(205.0 / 200.0) and point["auto"]["schedule"] == "canonical"
    assert "schedule=auto 1.02x (canonical, 205 (190-210, n=3))" in regime_map.markdown([point])


def test_the_bound_from_the_fastest_forward_backward_and_the_targets():
    """A peer's ratio carries the issue's target for its case and the bound: the fastest forward+backward rate of the
    table's contenders (median over its invocations; here the ceiling's, then a peer's) over the peer's median; a
    target above the bound is flagged out of reach."""
    lm, fs, ds, ce = ("speedloader-overlap:4x2", "fsdp2-offload:1x8", "deepspeed-offload:2x4", "ondevice:1x8")
    invocations = [{"index": i, "rows": [_row(lm, 350.0, 4), _row(fs, 250.0, 1), _row(ds, 100.0, 2),
                                         {**_row(ce, 400.0, 1), "tokens_per_s_fwd_bwd": rate}]}
                   for i, rate in enumerate((420.0, 440.0, 400.0))]
    r = bench_fair.summarize({"invocations": invocations}, T40)["ratios"]
    fsdp, ds_ = r["layer-major/fsdp2-offload"], r["layer-major/deepspeed-offload"]
    assert fsdp["eighth_or_less"] and fsdp["target"] == 2.0
    assert fsdp["bound"] == pytest.approx(420.0 / 250.0) and fsdp["target_within_bound"] is False
    assert ds_["binds"] and not ds_["eighth_or_less"] and ds_["target"] == 1.3
    assert ds_["bound"] == pytest.approx(4.2) and ds_["target_within_bound"] is True
    assert bench_fair.peer_target(False, False) == 1.0
    # the ceiling's allocator retrying under the cap: a peer's forward+backward faster than its is the bound
    for inv in invocations:
        inv["rows"][1]["tokens_per_s_fwd_bwd"] = 500.0
    r = bench_fair.summarize({"invocations": invocations}, T40)["ratios"]
    assert r["layer-major/fsdp2-offload"]["bound"] == pytest.approx(2.0)
    assert r["layer-major/deepspeed-offload"]["bound"] == pytest.approx(5.0)
    assert bench_fair.fastest_fwd_bwd({"fsdp2-offload": {"tokens_per_s_fwd_bwd_median": 500.0}}) is None  # no ceiling


def test_another_setting_has_its_own_summary_row_with_its_phases():
    """--also: a second layer-major setting (a lever's A/B) is summarized under its spec, the sweep's best under the
    family; the step phases' medians are in both; ratios stay those of the families' best points."""
    lm, alt, fs = ("speedloader-overlap:1x8:root=device:dev=1:keep=53",
                   "speedloader-overlap:1x8:root=device:dev=1:keep=53:threads=12", "fsdp2-offload:4x2:root=device:dev=1")
    sweep = [{**_row(lm, 300.0, 1), "family": "layer-major"}, {**_row(fs, 200.0, 4), "family": "fsdp2-offload"}]
    invocations = [{"index": i, "rows": [{**_row(lm, 300.0 + i, 1), "fwd_bwd_s": 1.0 + i, "host_thread_cpu_s": 0.5},
                                         {**_row(alt, 330.0, 1), "fwd_bwd_s": 0.9},
                                         _row(fs, 200.0, 4)]} for i in range(3)]
    fam = bench_fair.summarize({"sweep": sweep, "invocations": invocations}, T40)
    assert fam["families"]["layer-major"]["spec"] == lm and fam["families"][alt]["median"] == 330.0
    assert fam["families"]["layer-major"]["fwd_bwd_s_median"] == 2.0
    assert fam["families"]["layer-major"]["host_thread_cpu_s_median"] == 0.5
    assert "host_thread_cpu_s_median" not in fam["families"][alt]
    assert fam["ratios"]["layer-major/fsdp2-offload"]["ratio"] == pytest.approx(301.0 / 200.0)
    assert f"layer-major/{alt}" in fam["ratios"]  # shown, but never a peer: best_peer stays a canonical peer
    assert fam["ratios"]["best_peer"] == "fsdp2-offload"


def test_a_record_of_another_gpu_model_is_not_extended(tmp_path):
    """The rows of one table come from one GPU model: resuming a record measured elsewhere is refused."""
    table = bench_fair.TABLES["cpu_check"]
    path = tmp_path / "fair_cpu_check.json"
    args = _args(quick=True, invocations=3)
    record = bench_fair.load_record(table, args, path)
    path.write_text(json.dumps({**record, "device": "NVIDIA H200"}))
    with pytest.raises(SystemExit, match="measured on NVIDIA H200"):
        bench_fair.load_record(table, args, path)
    path.write_text(json.dumps(record))
    assert len(bench_fair.load_record(table, args, path)["commands"]) == 2  # same machine: appended


def test_rows_of_peers_that_held_every_logit_do_not_mix_with_chunked_ones(tmp_path, monkeypatch):
    """Records from before the peers' chunked head (their rows lack head_loss_chunk_tokens) are not extended, and
    their peers' points are not taken; layer-major's points of such a record still are."""
    table = bench_fair.TABLES["cpu_check"]
    path = tmp_path / "fair_cpu_check.json"
    args = _args(quick=True, invocations=3)
    record = bench_fair.load_record(table, args, path)
    before = ("head_loss_chunk_tokens",)  # rows from before e2a292b lack the field
    old_peer = {k: v for k, v in _row("fsdp2-offload:2x1", 2.0).items() if k not in before} | {"family": "fsdp2-offload"}
    lm = {**_row("speedloader-overlap:1x2", 3.0), "family": "layer-major"}
    path.write_text(json.dumps({**record, "sweep": [lm, old_peer]}))
    with pytest.raises(SystemExit, match="every logit of a micro-batch at once"):
        bench_fair.load_record(table, args, path)
    ceiling = {**old_peer, "spec": "ondevice:2x1", "family": "ceiling"}  # the ceiling's own head counts too
    path.write_text(json.dumps({**record, "sweep": [lm, ceiling]}))
    with pytest.raises(SystemExit, match="use another --out-dir"):
        bench_fair.load_record(table, args, path)
    path.write_text(json.dumps({**record, "sweep": [lm, {**old_peer, "head_loss_chunk_tokens": 4096}]}))
    assert len(bench_fair.load_record(table, args, path)["commands"]) == 2  # chunked peers: appended
    source = {"table": bench_fair.dataclasses.asdict(table), "device": "NVIDIA H200", "commit": "abc",
              "sweep": [lm, old_peer]}
    (tmp_path / "src.json").write_text(json.dumps(source))
    fresh = {"sweep": []}
    bench_fair.take_points(fresh, table, ["layer-major"], tmp_path / "src.json")
    assert [r["family"] for r in fresh["sweep"]] == ["layer-major"]
    with pytest.raises(SystemExit, match="every logit"):
        bench_fair.take_points({"sweep": []}, table, ["fsdp2-offload"], tmp_path / "src.json")


def test_points_from_another_record_are_marked_and_repeated(tmp_path, monkeypatch):
    """--points-from: the other record's sweep rows of the chosen families, marked with their source; the repeat
    runs their best points; a record of another table is refused."""
    lm, fs = "speedloader-overlap:1x2", "fsdp2-offload:2x1"
    table = bench_fair.TABLES["cpu_check"]
    source = {"table": bench_fair.dataclasses.asdict(table), "device": "NVIDIA H200", "commit": "abc",
              "sweep": [{**_row(lm, 3.0), "family": "layer-major"}, {**_row(fs, 2.0), "family": "fsdp2-offload"}]}
    (tmp_path / "src.json").write_text(json.dumps(source))
    ran = []
    monkeypatch.setattr(bench_fair, "run_point", lambda t, spec, a, **f: ran.append(spec) or _row(spec, 1.0))
    assert bench_fair.main(["cpu_check", "--out-dir", str(tmp_path / "out"), "--device", "cpu", "--part", "repeat",
                            "--family", "layer-major", "--points-from", str(tmp_path / "src.json")]) == 0
    record = json.loads((tmp_path / "out" / "fair_cpu_check.json").read_text())
    assert [r["spec"] for r in record["sweep"]] == [lm] and record["sweep"][0]["from_record"]["device"] == "NVIDIA H200"
    assert ran == [lm] * 3 and record["points_from"][0]["device"] == "NVIDIA H200"
    del source["table"]["levers"]  # a record from before Table had the field: its default
    (tmp_path / "src.json").write_text(json.dumps(source))
    assert bench_fair.main(["cpu_check", "--out-dir", str(tmp_path / "o1"), "--device", "cpu", "--part", "repeat",
                            "--family", "layer-major", "--points-from", str(tmp_path / "src.json")]) == 0
    source["table"]["batch"] = 4
    (tmp_path / "src.json").write_text(json.dumps(source))
    with pytest.raises(SystemExit, match="another definition"):
        bench_fair.main(["cpu_check", "--out-dir", str(tmp_path / "o2"), "--device", "cpu", "--part", "repeat",
                         "--points-from", str(tmp_path / "src.json")])


def test_points_from_another_record_bring_the_eager_sweep_beside_deepspeed(tmp_path, monkeypatch):
    lm, eager, ds = ("speedloader-overlap:2x4:keep=11", "speedloader-overlap:2x4:keep=7:eager", "deepspeed-offload:8x1")
    source = {"table": bench_fair.dataclasses.asdict(T40), "device": "NVIDIA H200", "commit": "abc",
              "sweep": [{**_row(lm, 3.0), "family": "layer-major"}, {**_row(eager, 2.5), "family": "layer-major-eager"},
                        {**_row(eager.replace("keep=7", "keep=11"), None, status="oom"), "family": "layer-major-eager"},
                        {**_row(ds, 1.0), "family": "deepspeed-offload"}]}
    (tmp_path / "src.json").write_text(json.dumps(source))
    ran = []
    monkeypatch.setattr(bench_fair, "run_point", lambda t, spec, a, **f: ran.append(spec) or _row(spec, 1.0))
    assert bench_fair.main([T40.name, "--out-dir", str(tmp_path / "out"), "--device", "cpu", "--part", "repeat",
                            "--family", "layer-major", "--family", "deepspeed-offload",
                            "--points-from", str(tmp_path / "src.json")]) == 0
    assert sorted(set(ran)) == sorted([lm, eager, ds]) and len(ran) == 9


def test_points_from_two_records_a_family_from_the_first_that_has_it(tmp_path, monkeypatch):
    """--points-from twice (a new sweep of one family beside an older record of the others): each family's points
    come from the first record that has any, so the older record's rows of a re-swept family are not mixed in."""
    table = bench_fair.TABLES["cpu_check"]
    new_lm, old_lm, fs = "speedloader-overlap:1x2:keep=1", "speedloader-overlap:1x2:keep=2", "fsdp2-offload:2x1"
    header = {"table": bench_fair.dataclasses.asdict(table), "device": "NVIDIA H200"}
    new = {**header, "commit": "new", "sweep": [{**_row(new_lm, 3.0), "family": "layer-major"}]}
    old = {**header, "commit": "old", "sweep": [{**_row(old_lm, 9.0), "family": "layer-major"},
                                                {**_row(fs, 2.0), "family": "fsdp2-offload"}]}
    for name, rec in (("new", new), ("old", old)):
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    ran = []
    monkeypatch.setattr(bench_fair, "run_point", lambda t, spec, a, **f: ran.append(spec) or _row(spec, 1.0))
    assert bench_fair.main(["cpu_check", "--out-dir", str(tmp_path / "out"), "--device", "cpu", "--part", "repeat",
                            "--family", "layer-major", "--family", "fsdp2-offload", "--invocations", "1", "--quick",
                            "--points-from", str(tmp_path / "new.json"),
                            "--points-from", str(tmp_path / "old.json")]) == 0
    record = json.loads((tmp_path / "out" / "fair_cpu_check.json").read_text())
    assert {(r["spec"], r["from_record"]["commit"]) for r in record["sweep"]} == {(new_lm, "new"), (fs, "old")}
    assert sorted(ran) == sorted([new_lm, fs])  # the old, faster layer-major row is not the best point: not taken
    assert [p["path"] for p in record["points_from"]] == [str(tmp_path / "new.json"), str(tmp_path / "old.json")]


def test_family_of_every_spec():
    assert bench_fair.family_of("speedloader-overlap:1x8:keep=3") == "layer-major"
    assert bench_fair.family_of("speedloader-overlap:1x8:keep=3:eager") == "layer-major-eager"
    assert bench_fair.family_of("ondevice:1x8:sync=last") == "ceiling"
    assert bench_fair.family_of("flexgen:32x2:c4") == "flexgen-c4" and bench_fair.family_of("flexgen:32x2") == "flexgen-fp16"
    assert bench_fair.family_of("flexgen:64x4:kc4:w=0:attn=gpu") == "flexgen-c4"
    assert bench_fair.family_of("flexgen:32x8:c4:w=100:attn=gpu") == "flexgen-c4"
    assert bench_fair.family_of("speedloader:56x8:device:w=int4:kvq=int8") == "speedloader-int4"


def test_below_the_protocol_is_refused_unless_quick(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_fair.main(["cpu_check", "--out-dir", str(tmp_path), "--steps", "2", "--device", "cpu"])
    assert e.value.code == 2 and "steps=2 (at least 5)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_fair.main(["nonsuch", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench_fair.main(["cpu_check", "--family", "deepspeed-offload", "--out-dir", str(tmp_path)])


def test_a_repeat_continues_a_record_toward_the_minimum_and_counts_machine_starts(tmp_path, monkeypatch, capsys):
    """The protocol's 3 invocations may come from several commands (separate starts of the GPU machine): a repeat
    below the minimum is refused on its own, accepted with --partial (the summary says how many are missing) or
    where the record's invocations make up the rest; the summary counts the machine starts (boot ids)."""
    lm = "speedloader-overlap:1x2"
    out = tmp_path / "out"
    out.mkdir()
    table = bench_fair.TABLES["cpu_check"]
    seed = {**bench_fair.load_record(table, _args(quick=False, out_dir=str(out)), out / "fair_cpu_check.json"),
            "sweep": [{**_row(lm, 3.0), "family": "layer-major"}]}
    (out / "fair_cpu_check.json").write_text(json.dumps(seed))
    monkeypatch.setattr(bench_fair, "run_point", lambda t, spec, a, **f: _row(spec, 1.0))
    argv = ["cpu_check", "--out-dir", str(out), "--device", "cpu", "--part", "repeat", "--family", "layer-major"]
    with pytest.raises(SystemExit) as e:
        bench_fair.main(argv + ["--invocations", "1"])  # 0 done + 1 < 3
    assert e.value.code == 2 and "invocations=1 (at least 3)" in capsys.readouterr().err
    start = ["start-a"]
    monkeypatch.setattr(bench_fair.harness, "boot_id", lambda: start[0])
    assert bench_fair.main(argv + ["--invocations", "2", "--partial"]) == 0  # the first start: 2, 1 to come
    record = json.loads((out / "fair_cpu_check.json").read_text())
    assert record["protocol"] and record["summary"]["invocations_missing"] == 1
    start[0] = "start-b"
    assert bench_fair.main(argv + ["--invocations", "1"]) == 0  # the second start: 2 done + 1
    record = json.loads((out / "fair_cpu_check.json").read_text())
    assert record["protocol"] and record["summary"]["invocations_missing"] == 0
    assert [inv["boot_id"] for inv in record["invocations"]] == ["start-a", "start-a", "start-b"]
    assert record["summary"]["machine_starts"] == 2 and record["summary"]["families"]["layer-major"]["n"] == 3
    assert [c["boot_id"] for c in record["commands"]] == [record["boot_id"], "start-a", "start-b"]


def test_a_repeat_without_a_sweep_runs_the_named_settings_only(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(bench_fair, "run_point", lambda t, spec, a, **f: ran.append(spec) or _row(spec, 1.0))
    argv = ["cpu_check", "--out-dir", str(tmp_path), "--device", "cpu", "--part", "repeat", "--family", "layer-major"]
    with pytest.raises(SystemExit, match="--also"):
        bench_fair.main(argv)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert bench_fair.main(argv + ["--also", "speedloader-overlap:1x2:cap=none:keep=2"]) == 0
    assert ran == ["speedloader-overlap:1x2:cap=none:keep=2"] * 3
    record = json.loads((tmp_path / "fair_cpu_check.json").read_text())
    assert record["summary"]["families"]["layer-major"]["n"] == 3 and record["sweep"] == []
    assert record["pytorch_cuda_alloc_conf"] == os.environ["PYTORCH_CUDA_ALLOC_CONF"]  # what the workers ran with


def test_host_load_runs_and_stops():
    import time

    with HostLoad(busy=1, copy=1) as load:
        time.sleep(3.0)  # the copy process imports numpy and fills its buffers first
    s = load.summary()
    assert s["busy_processes"] == 1 and s["copy_processes"] == 1 and s["seconds"] >= 3.0
    assert s["busy_iterations"] > 0 and s["copy_bytes"] > 0
    with pytest.raises(ValueError):
        HostLoad(busy=-1)


@pytest.mark.slow
def test_a_whole_table_on_the_cpu(tmp_path, capsys):
    """cpu_check through real worker processes (tools/bench_train.py --worker): the sweep, two repeat invocations in
    alternating order, the record's summary; a second part appends to the same record. Under --budget-s a command
    starts no worker that would not end in time and says to run it again; --invocations is then the record's total,
    so the same command on a complete table runs nothing more."""
    argv = ["cpu_check", "--out-dir", str(tmp_path), "--device", "cpu", "--quick", "--steps", "2", "--warmup", "1",
            "--invocations", "2", "--timeout", "120"]
    path = tmp_path / "fair_cpu_check.json"
    assert bench_fair.main([*argv, "--part", "sweep", "--budget-s", "1"]) == 0  # no worker fits: none starts
    assert "run the same command again to go on" in capsys.readouterr().out
    assert json.loads(path.read_text())["sweep"] == []
    assert bench_fair.main([*argv, "--part", "sweep"]) == 0
    record = json.loads(path.read_text())
    assert record["protocol"] is False and record["table"]["name"] == "cpu_check"
    specs = [r["spec"] for r in record["sweep"]]
    assert specs[0].startswith("speedloader-overlap:1x2") and any(s.startswith("fsdp2-offload:2x1") for s in specs)
    assert all(r["status"] == "ok" for r in record["sweep"]), [r.get("error") for r in record["sweep"]]
    best = bench_fair.best_specs(record, bench_fair.TABLES["cpu_check"], ["layer-major"])["layer-major"]
    repeat = [*argv, "--part", "repeat", "--also", best + ":threads=1", "--budget-s", "900"]
    assert bench_fair.main(repeat) == 0
    record = json.loads(path.read_text())
    assert len(record["commands"]) == 3 and len(record["invocations"]) == 2
    assert bench_fair.main(repeat) == 0  # the table is complete: nothing more runs
    assert json.loads(path.read_text())["invocations"] == record["invocations"]
    with pytest.raises(SystemExit):
        bench_fair.main([*repeat, "--partial"])
    assert "drop --partial" in capsys.readouterr().err
    first, second = (inv["order"] for inv in record["invocations"])
    assert second == list(reversed(first)) and len(first) == 3
    fam = record["summary"]["families"]
    assert fam["layer-major"]["n"] == 2 and fam["fsdp2-offload"]["n"] == 2 and fam[best + ":threads=1"]["n"] == 2
    assert fam["layer-major"]["host_thread_cpu_s_median"] > 0
    assert fam["layer-major"]["alloc_retries_timed_median"] == 0  # no caching allocator on the CPU
    assert "layer-major/fsdp2-offload" in record["summary"]["ratios"]
    row = record["invocations"][0]["rows"][0]
    assert len(row["step_times_s"]) == 2 and row["tokens_per_s"] > 0
    phases = row["worker_phases_s"]  # where the worker's wall time went: its parts fit inside the harness's wall_s
    assert all(v is not None and v >= 0 for v in phases.values()), phases
    assert phases["timed_steps"] <= phases["steps_total"] and phases["before_worker"] > 0
    parts = sum(v for k, v in phases.items() if k not in ("first_step", "other_warmup_steps", "timed_steps"))
    assert parts <= row["wall_s"]


def test_auto_through_its_worker_on_the_cpu(tmp_path):
    """--family auto through a real worker: the trainer tunes (schedule=auto), trains, and its row says what it chose
    (the batch, split by the tuner; the table's GPU-resident unit) and its timed steps; the tuning is not timed."""
    argv = ["cpu_check", "--family", "auto", "--out-dir", str(tmp_path), "--device", "cpu", "--quick", "--steps", "2",
            "--warmup", "1", "--invocations", "1", "--timeout", "180"]
    assert bench_fair.main(argv) == 0
    record = json.loads((tmp_path / "fair_cpu_check.json").read_text())
    rows = [*record["sweep"], *record["invocations"][0]["rows"]]
    assert [r["spec"] for r in rows] == ["auto:2:root=device:dev=1"] * 2
    for row in rows:
        assert row["status"] == "ok", row.get("output_tail")
        assert row["schedule"] in ("speedloader", "canonical") and row["sub_batch_size"] * row["num_sub_batches"] == 2
        assert row["device_units"] == 1 and row["root_on_device"] and row["tune_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(2 * 64 / row["step_s"]) and row["tune_plan"].startswith("plan:")
    assert len(record["invocations"][0]["rows"][0]["step_times_s"]) == 2
    assert record["summary"]["families"]["auto"]["n"] == 1


def test_every_tables_points_are_well_formed_worker_specs():
    """Every point of every table parses as its worker's contender (tools/bench_train.py's parse_contender,
    tools/bench_infer.py's contender names): a table cannot send a GPU machine a spec its worker refuses."""
    import bench_infer
    import bench_train

    for table in bench_fair.TABLES.values():
        shape = bench_fair.Shape.of(table) if table.kind == "train" else None
        extra = [bench_fair.AUTO] if table.kind == "train" else []
        for family in bench_fair.with_eager(table, table.families) + extra:
            ladders = (bench_fair.train_ladders(table, family, shape) if table.kind == "train"
                       else bench_fair.infer_ladders(table, family))
            specs = [spec for ladder in ladders for tier in ladder for spec in tier]
            assert specs, (table.name, family)
            for spec in specs:
                assert bench_fair.family_of(spec) == family, (table.name, spec)
                if table.kind == "train":
                    contender = bench_train.parse_contender(spec, None, table.compiled)
                    n, num = (int(v) for v in contender.shape.split("x")) if family != "auto" else (
                        int(contender.shape), 1)  # auto: the batch alone, the tuner splits it
                    assert n * num == table.batch, spec
                    if family in ("layer-major", "layer-major-eager", "fsdp2-offload", "auto"):
                        assert contender.root_on_device and contender.dev >= 1, spec  # the same allowances
                    assert contender.compiled == (table.compiled and family not in ("layer-major-eager",
                                                                                   "deepspeed-offload")), spec
                else:
                    assert spec.split(":")[0] in bench_infer.CONTENDERS, spec


def test_slots_split_the_hosts_cores_among_the_gpus(monkeypatch):
    monkeypatch.setattr(bench_fair.os, "sched_getaffinity", lambda pid: set(range(2, 12)))  # 10 cores: 4 + 3 + 3
    got = bench_fair.slots(3)
    assert [s.gpu for s in got] == [0, 1, 2]
    assert [s.cpus for s in got] == [(2, 3, 4, 5), (6, 7, 8), (9, 10, 11)]
    env = got[1].env({"KEEP": "1"})
    assert env == {"KEEP": "1", "CUDA_VISIBLE_DEVICES": "1", "FSL_WORKER_CPUS": "6,7,8", "OMP_NUM_THREADS": "3"}
    with pytest.raises(ValueError, match="at most 10"):
        bench_fair.slots(11)


def test_a_worker_takes_its_slots_cores_before_loading_anything():
    import subprocess

    cpu = min(os.sched_getaffinity(0))
    code = (f"import sys; sys.path.insert(0, {str(Path(bench_fair.__file__).parent)!r}); import bench_train, os; "
            "print(sorted(os.sched_getaffinity(0)))")
    env = {**os.environ, "FSL_WORKER_CPUS": str(cpu)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{cpu}]"


@pytest.mark.parametrize("extra, message", [(["--gpus", "0"], "use 1 or more"),
                                            (["--gpus", "2", "--host-busy", "1"], "its own host load"),
                                            (["--gpus", "4096"], "cores for the workers"),
                                            (["--sweep-steps", "1"], "--sweep-steps 1: at least 2"),
                                            (["--sweep-warmup", "0"], "--sweep-warmup 0: at least 1")])
def test_bad_gpus_settings_fail_before_any_worker(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        bench_fair.main(["cpu_check", "--out-dir", str(tmp_path), "--device", "cpu", "--quick", *extra])
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no record begun


@pytest.mark.slow
def test_families_sweep_side_by_side_on_their_own_slots(tmp_path):
    """--gpus 2 on the CPU: both families' sweeps run at once through real workers, each family's points on one slot
    (half the cores), the same points as one at a time."""
    argv = ["cpu_check", "--out-dir", str(tmp_path), "--device", "cpu", "--quick", "--steps", "1", "--warmup", "1",
            "--timeout", "120", "--sweep-steps", "2", "--part", "sweep"]
    assert bench_fair.main([*argv, "--gpus", "2"]) == 0
    record = json.loads((tmp_path / "fair_cpu_check.json").read_text())
    ran = [r for r in record["sweep"] if r["status"] != "skipped"]
    assert all(r["status"] == "ok" for r in ran), [r.get("error") for r in ran]
    # --sweep-steps: every sweep point timed 2 steps and says so (the repeat below times --steps, 1)
    assert all(r["steps"] == 2 and r["warmup"] == 1 and len(r["step_times_s"]) == 2 for r in ran)
    by_family = {f: {r["gpu_slot"] for r in ran if r["family"] == f} for f in ("layer-major", "fsdp2-offload")}
    assert all(len(s) == 1 for s in by_family.values()) and set.union(*by_family.values()) <= {0, 1}, by_family
    sizes = {s.gpu: len(s.cpus) for s in bench_fair.slots(2)}
    assert all(r["worker_cpus"] == sizes[r["gpu_slot"]] for r in ran)
    table = bench_fair.TABLES["cpu_check"]
    shape = bench_fair.Shape.of(table)
    first_tiers = {ladder[0][0] for f in table.families for ladder in bench_fair.train_ladders(table, f, shape)}
    assert first_tiers <= {r["spec"] for r in record["sweep"]}  # every ladder's first point was tried
    # the repeat under --gpus 2: one worker at a time, each on the first slot (the share a sweep point had)
    assert bench_fair.main([*argv[:-1], "repeat", "--invocations", "1", "--gpus", "2"]) == 0
    rows = json.loads((tmp_path / "fair_cpu_check.json").read_text())["invocations"][0]["rows"]
    assert {r["family"] for r in rows} == set(table.families)
    assert all(r["status"] == "ok" and r["gpu_slot"] == 0 and r["worker_cpus"] == sizes[0] for r in rows), rows
    assert all("steps" not in r and len(r["step_times_s"]) == 1 for r in rows)


def test_sweep_points_may_run_fewer_steps_than_the_repeat(tmp_path, capsys):
    """--sweep-steps / --sweep-warmup: the sweep's workers time fewer steps (their rows say how many), the repeat's
    keep --steps / --warmup."""
    argv = [T40.name, "--out-dir", str(tmp_path), "--family", "fsdp2-offload", "--dry-run"]
    assert bench_fair.main([*argv, "--part", "sweep", "--sweep-steps", "2", "--sweep-warmup", "1"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "bench_train.py" in line]
    assert commands and all(line.endswith("--steps 2 --warmup 1 --device cuda --compile") for line in commands)
    args = argparse.Namespace(steps=5, warmup=2, sweep_steps=2, sweep_warmup=None, device="cuda", profile=False)
    repeat_cmd = bench_fair.worker_command(T40, "fsdp2-offload:4x2", args)
    assert repeat_cmd[repeat_cmd.index("--steps") + 1] == "5" and repeat_cmd[repeat_cmd.index("--warmup") + 1] == "2"
    sweep_cmd = bench_fair.worker_command(T40, "fsdp2-offload:4x2", args, sweep=True)
    assert sweep_cmd[sweep_cmd.index("--steps") + 1] == "2" and sweep_cmd[sweep_cmd.index("--warmup") + 1] == "2"


def test_a_budget_starts_a_worker_only_where_its_expected_wall_time_fits():
    lm, fs = "speedloader-overlap:4x2", "fsdp2-offload:4x2"
    record = {"sweep": [{"spec": lm, "family": "layer-major", "wall_s": 30.0},
                        {"spec": "speedloader-overlap:2x4", "family": "layer-major", "wall_s": 50.0}],
              "invocations": [{"rows": [{"spec": lm, "family": "layer-major", "wall_s": 40.0}]}]}
    assert bench_fair.expected_wall_s(record, lm) == pytest.approx(44.0)  # its own longest run, a tenth more
    assert bench_fair.expected_wall_s(record, "speedloader-overlap:1x8") == pytest.approx(55.0)  # its family's
    assert bench_fair.expected_wall_s(record, fs) == pytest.approx(55.0)  # any worker's
    assert bench_fair.expected_wall_s({}, fs) == pytest.approx(1.1 * bench_fair.DEFAULT_WALL_S)
    budget = bench_fair.Budget(95.0)
    assert budget.allows(record, [lm, lm]) and not budget.stopped_before  # 88 s
    assert not budget.allows(record, [lm, fs]) and budget.stopped_before == [lm]  # 99 s
    assert bench_fair.Budget(None).allows(record, [fs] * 100)


def test_a_family_whose_package_is_missing_stops_before_its_first_worker(tmp_path):
    """DeepSpeed not installed: the first DeepSpeed point stops the command with what to install, before a worker
    starts (each would fail after its start); the points that ran before it stay in the record."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed here")
    args = argparse.Namespace(steps=5, warmup=2, sweep_steps=None, sweep_warmup=None, device="cpu", profile=False,
                              dry_run=False, host_busy=0, host_copy=0, timeout=10)
    with pytest.raises(SystemExit, match="deepspeed-offload: its workers import deepspeed, which is not installed"):
        bench_fair.run_point(T40, "deepspeed-offload:8x1", args, sweep=True)
    bench_fair.check_installed("fsdp2-offload")  # the project's own dependencies: nothing to check


def test_a_ratio_of_rows_from_separate_invocations_is_flagged():
    """Families repeated by separate commands (DeepSpeed's rows after the others'): their ratio says it divides rows
    of separate invocations, which the protocol never does; rows of the same invocations are not flagged."""
    lm, fs, ds = "speedloader-overlap:4x2", "fsdp2-offload:4x2", "deepspeed-offload:8x1"
    invocations = [{"index": i, "order": [lm, fs], "rows": [_row(lm, 300.0, 4), _row(fs, 200.0, 4)]}
                   for i in range(3)]
    invocations += [{"index": i, "order": [ds], "rows": [_row(ds, 100.0, 8)]} for i in range(3, 6)]
    s = bench_fair.summarize({"invocations": invocations}, T40)
    assert s["families"]["deepspeed-offload"]["invocations"] == [3, 4, 5]
    assert s["ratios"]["layer-major/deepspeed-offload"]["separate_invocations"] is True
    assert s["ratios"]["layer-major/fsdp2-offload"]["separate_invocations"] is False
    record = {"invocations": invocations, "summary": s, "device": "cpu", "commit": "x", "sweep": []}
    text = bench_fair.markdown(record, T40)
    assert "layer-major/deepspeed-offload: **3.00x** (rows of separate invocations" in text
    assert "layer-major/fsdp2-offload: **1.50x**\n" in text


def test_a_ratio_divides_medians_over_the_invocations_both_rows_ran_in():
    """Layer-major repeated again beside DeepSpeed by a later command (invocations 3-5, a faster start): its ratio
    over DeepSpeed takes layer-major's median over 3-5 only, not over all six; over FSDP2 offload, over 0-2."""
    lm, fs, ds = "speedloader-overlap:4x2", "fsdp2-offload:4x2", "deepspeed-offload:8x1"
    invocations = [{"index": i, "order": [lm, fs], "rows": [_row(lm, 300.0, 4), _row(fs, 200.0, 4)]}
                   for i in range(3)]
    invocations += [{"index": i, "order": [lm, ds], "rows": [_row(lm, 400.0, 4), _row(ds, 100.0, 8)]}
                    for i in range(3, 6)]
    s = bench_fair.summarize({"invocations": invocations}, T40)
    assert s["families"]["layer-major"]["invocations"] == [0, 1, 2, 3, 4, 5]
    over_ds, over_fs = s["ratios"]["layer-major/deepspeed-offload"], s["ratios"]["layer-major/fsdp2-offload"]
    assert over_ds["ratio"] == pytest.approx(4.0) and over_ds["invocations"] == [3, 4, 5]
    assert over_fs["ratio"] == pytest.approx(1.5) and over_fs["invocations"] == [0, 1, 2]
    assert not over_ds["separate_invocations"] and not over_fs["separate_invocations"]
    record = {"invocations": invocations, "summary": s, "device": "cpu", "commit": "x", "sweep": []}
    assert "layer-major/deepspeed-offload: **4.00x** (over the invocations both ran in: 3, 4, 5)" in (
        bench_fair.markdown(record, T40))
