"""tools/load_curve.py: a row's loss under host load, over the records and start by start, and beyond the ceiling's,
from records written by hand."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import load_curve  # noqa: E402  (tools/ is not a package)

LM, CEIL = "speedloader-overlap:4x2:keep=11", "ondevice:1x8:sync=last"


def _record(busy: int, invocations: list[tuple[str, dict]]) -> dict:
    """invocations: (boot id, {spec: tokens/s})."""
    return {"table": {"name": "t"}, "device": "GPU", "host_load": {"busy": busy, "copy": 0},
            "invocations": [{"index": i, "boot_id": boot,
                             "rows": [{"spec": s, "status": "ok", "tokens_per_s": v} for s, v in rows.items()]}
                            for i, (boot, rows) in enumerate(invocations)]}


QUIET = _record(0, [("a", {LM: 100.0, CEIL: 100.0}), ("a", {LM: 110.0, CEIL: 100.0}), ("b", {LM: 120.0, CEIL: 90.0})])
LOADED = _record(4, [("b", {LM: 108.0, CEIL: 99.0}), ("c", {LM: 95.0, CEIL: 95.0}),
                     ("b", {LM: 102.0, CEIL: 81.0, "ondevice:2x4": 1.0})])


def test_losses_over_the_records_and_start_by_start():
    got = load_curve.load_losses(QUIET, LOADED)
    lm, ceil = got["rows"][LM], got["rows"][CEIL]
    assert got["host_load"] == {"busy": 4, "copy": 0}
    assert set(got["rows"]) == {LM, CEIL}  # a spec only one record ran has no loss
    assert lm["loss"] == pytest.approx(1 - 102.0 / 110.0)  # median 110 quiet, 102 loaded
    assert ceil["loss"] == pytest.approx(1 - 95.0 / 100.0)
    # only start b ran both: LM 120 -> median(108, 102) = 105; the ceiling 90 -> median(99, 81) = 90
    assert lm["by_start"] == pytest.approx({"b": 1 - 105.0 / 120.0}) and ceil["by_start"] == pytest.approx({"b": 0.0})
    assert lm["beyond_ceiling"] == pytest.approx(lm["loss"] - ceil["loss"])
    assert lm["beyond_ceiling_by_start"] == pytest.approx({"b": 1 - 105.0 / 120.0})
    assert "beyond_ceiling" not in ceil and ceil["family"] == "ceiling"


def test_without_a_ceiling_no_row_is_compared_with_it():
    def drop(r: dict) -> dict:
        return {**r, "invocations": [{**inv, "rows": [x for x in inv["rows"] if x["spec"] != CEIL]}
                                     for inv in r["invocations"]]}

    got = load_curve.load_losses(drop(QUIET), drop(LOADED))
    assert list(got["rows"]) == [LM] and "beyond_ceiling" not in got["rows"][LM]


def test_the_command_prints_and_writes_the_curve(tmp_path, capsys):
    quiet, loaded, out = tmp_path / "q.json", tmp_path / "l.json", tmp_path / "curve.json"
    quiet.write_text(json.dumps(QUIET))
    loaded.write_text(json.dumps(LOADED))
    assert load_curve.main([str(quiet), str(loaded), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 4 busy | ondevice:1x8:sync=last | +5.0% | +0.0% (b) | - |" in table
    assert "+12.5% (b)" in table
    assert json.loads(out.read_text())["curve"][0]["rows"][LM]["loss"] == pytest.approx(1 - 102.0 / 110.0)


def test_records_of_another_table_or_gpu_are_refused(tmp_path):
    quiet, other = tmp_path / "q.json", tmp_path / "o.json"
    quiet.write_text(json.dumps(QUIET))
    other.write_text(json.dumps({**LOADED, "device": "another GPU"}))
    with pytest.raises(SystemExit):
        load_curve.main([str(quiet), str(other)])
