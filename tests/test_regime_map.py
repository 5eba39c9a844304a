"""tools/regime_map.py: one point per table, layer-major over the faster canonical peer, from records written by
hand: repeat medians where a repeat ran, else the best sweep point, the status, target and bound, the choice among
records, and the refusals."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_fair  # noqa: E402  (tools/ is not a package)
import regime_map  # noqa: E402

LM24, FSDP24, DS24 = "speedloader-overlap:2x4:root=device:dev=1:keep=11", "fsdp2-offload:1x8:root=device:dev=1", \
    "deepspeed-offload:8x1"


def _row(spec: str, tokens_per_s: float, n: int, status: str = "ok", **fields) -> dict:
    family = bench_fair.family_of(spec)
    head = {} if family == "layer-major" else {"head_loss_chunk_tokens": 4096}  # the peers' chunked head (e2a292b on)
    return {"spec": spec, "family": family, "status": status, "tokens_per_s": tokens_per_s,
            "sub_batch_size": n, "num_sub_batches": 8 // n, "mfu": 0.4, **head, **fields}


def _record(table: str, sweep: list, invocations: list, *, device: str = "NVIDIA H200", busy: int = 0) -> dict:
    return {"table": dataclasses.asdict(bench_fair.TABLES[table]), "device": device, "commit": "x",
            "host_load": {"busy": busy, "copy": 0}, "sweep": sweep,
            "invocations": [{"index": i, "boot_id": "a", "rows": rows} for i, rows in enumerate(invocations)]}


SWEEP24 = [_row(LM24, 37_000.0, 2), _row(LM24.replace("2x4", "1x8").replace("11", "23"), 34_000.0, 1),
           _row(FSDP24, 28_000.0, 1), _row("fsdp2-offload:2x4:root=device:dev=1", None, 2, status="oom"),
           _row(DS24, 18_000.0, 8)]


def test_a_point_takes_repeat_medians_and_names_the_faster_peer():
    rep = [[_row(LM24, v, 2), _row(FSDP24, w, 1), _row(DS24, 17_000.0, 8)]
           for v, w in ((36_000.0, 26_000.0), (35_000.0, 27_000.0), (37_000.0, 26_500.0))]
    point = regime_map.map_point(_record("map_7b_L8_b8_cap24", SWEEP24, rep))
    assert point["best_peer"] == "fsdp2-offload"
    assert point["families"]["layer-major"]["tokens_per_s"] == 36_000.0
    assert point["families"]["fsdp2-offload"] == {"spec": FSDP24, "tokens_per_s": 26_500.0, "min": 26_000.0,
                                                  "max": 27_000.0, "n": 3, "sub_batch_size": 1, "source": "repeat"}
    assert point["ratio"] == pytest.approx(36_000.0 / 26_500.0)
    assert point["status"] == "protocol" and point["overlap"] is False
    assert point["target"] == 2.0  # the peer's micro-batch (1) is an eighth of the batch (8)
    assert "bound" not in point and point["not_run"] == []


def test_without_a_repeat_the_best_sweep_points_stand_and_the_status_says_so():
    sweep = SWEEP24 + [_row("ondevice:1x8:sync=last", 40_000.0, 1)]
    point = regime_map.map_point(_record("map_7b_L8_b8_cap24", sweep, []))
    assert point["status"] == "sweep only"
    assert point["families"]["layer-major"] == {"spec": LM24, "tokens_per_s": 37_000.0, "n": 0, "sub_batch_size": 2,
                                                "source": "sweep"}
    assert point["ratio"] == pytest.approx(37_000.0 / 28_000.0) and "overlap" not in point
    # one repeat invocation with the ceiling in it: 'repeat 1/3', the bound from the ceiling's forward+backward rate
    ceiling = _row("ondevice:1x8:sync=last", 40_000.0, 1, tokens_per_s_fwd_bwd=42_000.0)
    one = [[_row(LM24, 36_000.0, 2), _row(FSDP24, 24_000.0, 1), _row(DS24, 20_000.0, 8), ceiling]]
    point = regime_map.map_point(_record("map_7b_L8_b8_cap24", sweep, one))
    assert point["status"] == "repeat 1/3" and point["best_peer"] == "fsdp2-offload"
    assert point["ratio"] == pytest.approx(36_000.0 / 24_000.0)
    assert point["bound"] == pytest.approx(42_000.0 / 24_000.0)
    # a peer repeated and one only swept: the faster figure is the best peer, and the weaker evidence the status
    point = regime_map.map_point(_record("map_7b_L8_b8_cap24", sweep, [[_row(LM24, 36_000.0, 2),
                                                                        _row(DS24, 20_000.0, 8), ceiling]]))
    assert point["best_peer"] == "fsdp2-offload" and point["families"]["fsdp2-offload"]["source"] == "sweep"
    assert point["status"] == "sweep only" and point["ratio"] == pytest.approx(36_000.0 / 28_000.0)
    # where the best peer's micro-batch is the whole batch the cap does not bind it: not slower is the target
    point = regime_map.map_point(_record("map_7b_L8_b8_cap24", [r for r in sweep if r["family"] != "fsdp2-offload"],
                                         []))
    assert point["best_peer"] == "deepspeed-offload" and point["target"] == 1.0


def test_a_point_says_whether_its_peers_held_every_logit_at_once():
    # rows without head_loss_chunk_tokens predate the peers' chunked head: the point and its table line say so
    before = [{k: v for k, v in r.items() if k != "head_loss_chunk_tokens"} for r in SWEEP24]
    old = regime_map.map_point(_record("map_7b_L8_b8_cap24", before, []))
    assert old["peer_head"] == "own" and "every logit at once" in regime_map.markdown([old])
    assert regime_map._cell(old)[1].endswith("peers: every logit at once")  # the plot's cell says it too
    new = regime_map.map_point(_record("map_7b_L8_b8_cap24", SWEEP24, []))
    assert new["peer_head"] == "chunked" and "logit" not in regime_map.markdown([new])
    both = regime_map.map_point(_record("map_7b_L8_b8_cap24", before, [[_row(FSDP24, 26_000.0, 1)]]))
    assert both["peer_head"] == "mixed"
    hf = regime_map.map_point(_record("map_7b_L8_b8_cap24", [dict(r, head_loss_chunk_tokens=0) for r in SWEEP24], []))
    assert hf["peer_head"] == "own"  # ':loss=hf' rows: the model's own loss again


def test_a_point_without_a_peer_is_incomplete_and_says_who_did_not_run():
    point = regime_map.map_point(_record("map_13b_L8_b32_cap24", [_row(LM24, 10_000.0, 2)], []))
    assert point["status"] == "incomplete" and point["not_run"] == ["fsdp2-offload", "deepspeed-offload"]
    assert "ratio" not in point
    assert regime_map.markdown([point]).endswith("| not run | - | - | incomplete; not run: fsdp2-offload, "
                                                 "deepspeed-offload; layer-major's sweep partial (5 micro-batches "
                                                 "to run) |")  # 1, 2, 4, 8 and 16 of 32: its 2 x 4 is not this table's


def test_a_peer_whose_sweep_stopped_part_way_is_named_with_the_micro_batches_left():
    """A sweep part stopped by its time budget (DeepSpeed at 13B width ran 1 x 32 and 2 x 16): the point takes the
    peer's best point so far and says its sweep is partial, in the table, the JSON and the plot's cell."""
    lm, fs = "speedloader-overlap:4x8:root=device:dev=1:adamw=pool:keep=0", "fsdp2-offload:2x16:root=device:dev=1"
    sweep = [_row(lm.replace("4x8", s), 25_000.0, int(s.split("x")[0])) for s in ("1x32", "2x16", "4x8", "8x4")]
    sweep += [_row(lm.replace("4x8", "16x2"), None, 16, status="oom"), _row(fs, 12_000.0, 2),
              _row(fs.replace("2x16", "1x32"), 8_000.0, 1), _row(fs.replace("2x16", "4x8"), None, 4, status="oom")]
    sweep += [_row(f"fsdp2-offload:{s}:root=device:dev=1", None, 8, status="skipped") for s in ("8x4", "16x2", "32x1")]
    sweep += [_row("deepspeed-offload:1x32", 8_500.0, 1), _row("deepspeed-offload:2x16", 13_000.0, 2)]
    point = regime_map.map_point(_record("map_13b_L8_b32_cap24", sweep, []))
    assert point["sweep_pending"] == {"deepspeed-offload": [f"deepspeed-offload:{s}" for s in
                                                            ("4x8", "8x4", "16x2", "32x1")]}
    assert point["best_peer"] == "deepspeed-offload" and point["ratio"] == pytest.approx(25_000.0 / 13_000.0)
    assert regime_map.markdown([point]).endswith("| sweep only; deepspeed-offload's sweep partial (4 micro-batches "
                                                 "to run) |")
    assert regime_map._cell(point)[1].endswith("peer sweep partial")
    # the rest of DeepSpeed's sweep: nothing left, and the cell says no more than the status
    sweep += [_row(f"deepspeed-offload:{s}", 9_000.0, int(s.split("x")[0])) for s in ("4x8", "8x4", "16x2", "32x1")]
    point = regime_map.map_point(_record("map_13b_L8_b32_cap24", sweep, []))
    assert point["sweep_pending"] == {} and regime_map._cell(point)[1] == "1.92x\nsweep only"


def test_records_one_per_table_quiet_hosts_one_gpu_model(tmp_path):
    few = ("a.json", _record("map_7b_L8_b8_cap24", SWEEP24, []))
    more = ("b.json", _record("map_7b_L8_b8_cap24", SWEEP24, [[_row(LM24, 1.0, 2)]]))
    other = ("c.json", _record("train_7b_L8_b8_cap40", SWEEP24, []))
    chosen = regime_map.choose_records([few, more, other])
    assert [path for path, _ in chosen] == ["b.json", "c.json"]  # 24 GiB before 40 GiB; the record with a repeat
    with pytest.raises(SystemExit, match="host load"):
        regime_map.choose_records([("d.json", _record("map_7b_L8_b8_cap24", SWEEP24, [], busy=4))])
    with pytest.raises(SystemExit, match="one GPU model"):
        regime_map.choose_records([few, ("e.json", _record("map_7b_L8_b8_cap24", [], [], device="NVIDIA H100"))])
    changed = _record("map_7b_L8_b8_cap24", SWEEP24, [])
    changed["table"]["cap_gib"] = 20
    with pytest.raises(SystemExit, match="another definition"):
        regime_map.choose_records([("g.json", changed)])
    with pytest.raises(SystemExit, match="not a training table"):
        regime_map.choose_records([("f.json", _record("infer_opt30b_24g", [], []))])


def test_the_command_prints_the_table_and_writes_the_points_and_the_map(tmp_path, capsys):
    path = tmp_path / "fair_map_7b_L8_b8_cap24.json"
    path.write_text(json.dumps(_record("map_7b_L8_b8_cap24", SWEEP24, [])))
    assert regime_map.main([str(path), "--json", str(tmp_path / "map.json"), "--plot", str(tmp_path / "map.png")]) == 0
    out = capsys.readouterr().out
    assert "| 7B width, 8 layers, 8 x 4k, 24 GiB | 37,000 (sweep) | fsdp2-offload 28,000 (sweep) | 1.32x | 2x | " \
           "sweep only; layer-major's sweep partial (1 micro-batch to run); fsdp2-offload's sweep partial (2 " \
           "micro-batches to run); deepspeed-offload's sweep partial (3 micro-batches to run) |" in out
    points = json.loads((tmp_path / "map.json").read_text())["points"]
    assert points[0]["record"] == str(path) and points[0]["best_peer"] == "fsdp2-offload"
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_point_divides_medians_over_the_invocations_both_ran_in_and_flags_separate_ones():
    """Layer-major repeated in six invocations, the faster peer in the last three only: the point's ratio takes
    layer-major's median over those three; a peer that never ran beside it leaves the point flagged, not 'protocol'."""
    first = [[_row(LM24, 30_000.0, 2), _row(FSDP24, 20_000.0, 1)] for _ in range(3)]
    beside = [[_row(LM24, 36_000.0, 2), _row(DS24, 24_000.0, 8)] for _ in range(3)]
    point = regime_map.map_point(_record("map_7b_L8_b8_cap24", SWEEP24, first + beside))
    assert point["best_peer"] == "deepspeed-offload" and point["invocations"] == [3, 4, 5]
    assert point["ratio"] == pytest.approx(1.5) and point["status"] == "protocol"
    record = _record("map_7b_L8_b8_cap24", SWEEP24, first + [[_row(DS24, 24_000.0, 8)] for _ in range(3)])
    point = regime_map.map_point(record)
    assert point["separate_invocations"] is True and point["status"] == "separate invocations"
