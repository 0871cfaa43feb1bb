"""The decode benchmark report (bench/records.py, bench/criteria.py, bench/report.py,
``benchmarks/bench_decode.py report``) on synthetic records with known values: derived columns,
the sparda / sparse-offload pairing, issue #20's verdicts (each criterion passing and
failing), the merge of several runs, and the plots."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from pathlib import Path

import pytest

from sparda.bench import report
from sparda.bench.criteria import FAIL, ISSUE20, NOT_MEASURED, PASS, check_issue20
from sparda.bench.records import dedup, derived, load_runs, speedups
from sparda.errors import SpardaError

ROOT = Path(__file__).resolve().parents[1]
CTX = 131072
LAYERS = 32  # minicpm-8b in bench/models.py


def _rec(method, batch, tok_s, *, kv=None, source=None, h=None, cap=None, roof_x=1.25, kernels=630.0,
         exposed_frac=0.01, overlap=(0.95, 0.5), **extra) -> dict:
    """A decode record whose TPOT follows from ``tok_s``; roofline, exposed wait and the
    compute/transfer-alone times are fractions of that TPOT."""
    kv = kv or ("host" if method in ("sparda", "sparse-offload", "sparda-no-prefetch") else "device")
    if source is None:
        source = (f"synthetic:hit_rate={h}" if h is not None else f"trace:{method.split('-')[0]}") \
            if kv == "host" else "native"
    tpot = batch / tok_s * 1e3
    rec = {"model": "minicpm-8b", "method": method, "context": CTX, "batch": batch, "status": "ok",
           "decode_tok_s": tok_s, "tpot_ms": tpot, "roofline_tpot_ms": tpot / roof_x, "roofline_bound": "hbm",
           "gpu_kernel_ms": tpot * 1.1, "kernels_per_step": kernels, "kv": kv, "selection_source": source,
           "target_hit_rate": h, "cuda_graph": True, "dtype": "bfloat16", "device": "NVIDIA H200",
           "hit_rate": 0.9 if kv == "host" else None, "exposed_wait_ms": exposed_frac * tpot if kv == "host" else 0.0,
           "copy_ms": 0.4 * tpot if kv == "host" else 0.0, "missed_bytes_per_step": 4e7 * batch if kv == "host" else 0.0,
           "slot_factor": 1.5 if kv == "host" else None}
    if cap is not None:
        rec["gpu_mem_cap_gb"] = cap
    if kv == "host" and overlap is not None:
        rec["compute_alone_ms"], rec["transfer_alone_ms"] = overlap[0] * tpot, overlap[1] * tpot
    rec.update(extra)
    return rec


def _passing() -> list[dict]:
    """Records that meet every criterion of issue #20."""
    return [
        _rec("sparda", 4, 400.0), _rec("sparse-offload", 4, 300.0),
        _rec("sparda", 8, 700.0), _rec("sparse-offload", 8, 600.0),
        _rec("sparda", 16, 1000.0), _rec("sparse-offload", 16, 700.0),
        _rec("sparda", 4, 450.0, h=0.7), _rec("sparse-offload", 4, 290.0, h=0.7),
        _rec("sparda", 16, 1100.0, h=0.7), _rec("sparse-offload", 16, 700.0, h=0.7),
        _rec("sparda", 4, 420.0, h=0.5), _rec("sparse-offload", 4, 250.0, h=0.5),
        _rec("dense", 4, 350.0, roof_x=1.3), _rec("dense", 1, 100.0, roof_x=3.0),  # B1 is outside the criterion
        _rec("sparda", 1, 120.0, roof_x=2.5),  # sparda B1: outside the roofline criterion too
        _rec("sparda", 24, 900.0, cap=80.0), _rec("sparda", 8, 650.0, cap=80.0),
        _rec("sparse", 8, 500.0, cap=80.0, kernels=1100.0),
    ]


def _find(recs, method, batch, h=None, cap=None):
    (r,) = [r for r in recs if r["method"] == method and r["batch"] == batch and r.get("target_hit_rate") == h
            and r.get("gpu_mem_cap_gb") == cap]
    return r


def _set_tok_s(r, tok_s):
    """Change a record's throughput keeping its roofline ratio, exposed and overlap fractions."""
    scale = r["decode_tok_s"] / tok_s
    for k in ("tpot_ms", "roofline_tpot_ms", "gpu_kernel_ms", "exposed_wait_ms", "copy_ms", "compute_alone_ms",
              "transfer_alone_ms"):
        if r.get(k) is not None:
            r[k] *= scale
    r["decode_tok_s"] = tok_s


def _fail_floor_b4(recs):
    _set_tok_s(_find(recs, "sparda", 4), 330.0)


def _fail_floor_b16(recs):
    _set_tok_s(_find(recs, "sparda", 16), 980.0)


def _fail_never_slower(recs):
    _set_tok_s(_find(recs, "sparda", 8), 580.0)


def _fail_speedup(recs):
    _set_tok_s(_find(recs, "sparse-offload", 16, h=0.7), 800.0)


def _fail_sparda_roofline(recs):
    r = _find(recs, "sparda", 8)
    r["roofline_tpot_ms"] = r["tpot_ms"] / 2.2


def _fail_dense_roofline(recs):
    r = _find(recs, "dense", 4)
    r["roofline_tpot_ms"] = r["tpot_ms"] / 1.6


def _fail_launches(recs):
    _find(recs, "sparda", 16)["kernels_per_step"] = 21 * LAYERS


def _fail_exposed(recs):
    r = _find(recs, "sparda", 8)
    r["exposed_wait_ms"] = 0.15 * r["tpot_ms"]


def _fail_overlap(recs):
    r = _find(recs, "sparda", 4)
    r["transfer_alone_ms"] = r["tpot_ms"] / 6  # (0.95 + 1/6 - 1) / (1/6) = 0.7


def _fail_capped(recs):
    _set_tok_s(_find(recs, "sparse", 8, cap=80.0), 950.0)


FAILS = {"floor_b4": _fail_floor_b4, "floor_b16": _fail_floor_b16, "never_slower": _fail_never_slower,
         "speedup_h07": _fail_speedup, "sparda_roofline": _fail_sparda_roofline,
         "dense_roofline": _fail_dense_roofline, "launches": _fail_launches, "exposed": _fail_exposed,
         "overlap": _fail_overlap, "capped": _fail_capped}


def _verdicts(recs):
    return {v.key: v for v in check_issue20(recs)}


def test_every_criterion_passes_on_records_that_meet_it():
    got = _verdicts(_passing())
    assert set(got) == set(ISSUE20) == set(FAILS)
    assert {k: v.verdict for k, v in got.items()} == {k: PASS for k in ISSUE20}
    assert "400.0 tok/s" in got["floor_b4"].measured and "bound: hbm" in got["floor_b4"].measured
    assert f"{1100 / 700:.2f}×" in got["speedup_h07"].measured and f"{450 / 290:.2f}×" in got["speedup_h07"].measured
    assert f"lowest {700 / 600:.2f}×" in got["never_slower"].measured
    assert "900.0 tok/s at B24" in got["capped"].measured and "500.0 at B8" in got["capped"].measured


@pytest.mark.parametrize("key", sorted(FAILS))
def test_each_criterion_fails_alone_when_its_threshold_is_missed(key):
    recs = copy.deepcopy(_passing())
    FAILS[key](recs)
    got = {k: v.verdict for k, v in _verdicts(recs).items()}
    assert got == {k: FAIL if k == key else PASS for k in ISSUE20}


def test_exposed_criterion_reads_the_transfer_part_of_the_wait():
    """A stall spent on the selection chain (exposed wait 15 %) with the copy's own part at 5 %
    passes the exposed-transfer criterion; the copy's part at 15 % fails it."""
    recs = copy.deepcopy(_passing())
    r = _find(recs, "sparda", 8)
    r["exposed_wait_ms"], r["exposed_transfer_ms"] = 0.15 * r["tpot_ms"], 0.05 * r["tpot_ms"]
    assert _verdicts(recs)["exposed"].verdict == PASS
    r["exposed_transfer_ms"] = 0.15 * r["tpot_ms"]
    assert _verdicts(recs)["exposed"].verdict == FAIL


def test_exposed_criterion_skips_a_copy_timing_of_other_steps():
    """A copy timing that copied 3x the TPOT's bytes per step (it timed other steps) says
    nothing about the TPOT's wait: its point has no exposed share, the verdict counts it as a
    point without a copy timing, and a timing within 10 % of the TPOT's bytes counts again."""
    recs = copy.deepcopy(_passing())
    r = _find(recs, "sparda", 8)
    r["exposed_transfer_ms"] = r["exposed_wait_ms"] = 0.5 * r["tpot_ms"]
    r["missed_bytes_per_step"] = 1e8
    r["timed_missed_bytes_per_step"] = 3e8
    assert derived(r)["exposed_transfer_pct"] is None and derived(r)["exposed_pct"] is None
    got = _verdicts(recs)["exposed"]
    assert got.verdict == PASS and "1 points without a copy timing" in got.measured, got
    r["timed_missed_bytes_per_step"] = 1.05e8
    assert derived(r)["exposed_transfer_pct"] == pytest.approx(50.0)
    assert _verdicts(recs)["exposed"].verdict == FAIL


@pytest.mark.parametrize("key", sorted(FAILS))
def test_offloaded_records_at_another_slot_factor_do_not_count(key):
    """A failing offloaded point at slot factor 1 (an ablation, or a record from before spare slots:
    no field) is a point of its own and leaves every verdict as it was; with ``slot_factor=None`` it counts."""
    from sparda.bench.records import DEFAULT_SLOT_FACTOR, dedup, point_label
    from sparda.config import DEFAULT_SLOT_FACTOR as ENGINE_DEFAULT

    assert DEFAULT_SLOT_FACTOR == ENGINE_DEFAULT
    recs = copy.deepcopy(_passing())
    failing = copy.deepcopy(recs)
    FAILS[key](failing)
    before = {json.dumps(r, sort_keys=True) for r in recs}
    changed = [r for r in failing if json.dumps(r, sort_keys=True) not in before]
    assert changed
    if all(r["kv"] != "host" for r in changed):
        pytest.skip("this criterion's failing record is on-device: slot factors do not apply")
    for old in (True, False):
        extra = [dict(r, slot_factor=1.0) for r in changed if r["kv"] == "host"]
        if old:
            extra = [{k: v for k, v in r.items() if k != "slot_factor"} for r in extra]
        kept, dropped = dedup([{"record": r, "rank": i} for i, r in enumerate(recs + extra)])
        assert dropped == 0 and len(kept) == len(recs) + len(extra)  # not the same point as the 1.5 record
        assert all("slots ×1" in point_label(r) for r in extra) and "slots" not in point_label(recs[0])
        assert {k: v.verdict for k, v in _verdicts(kept).items()} == {k: PASS for k in ISSUE20}
    # the same failing records, every offloaded one at slot factor 1: they count with slot_factor=None
    ones = [dict(r, slot_factor=1.0) if r["kv"] == "host" else r for r in failing]
    assert {v.key: v.verdict for v in check_issue20(ones, slot_factor=None)}[key] == FAIL
    assert {v.key: v.verdict for v in check_issue20(ones)}[key] != FAIL  # left out by default


@pytest.mark.parametrize("key", sorted(FAILS))
def test_records_with_early_attention_are_points_of_their_own(key):
    """A failing point run with early attention (decode_sweep_gpu part ``early`` writes the same
    points off and on) is not merged with the point run without it and leaves every verdict as
    it was; with ``early_attention=None`` it counts. A record without the field ran without it."""
    from sparda.bench.records import dedup, method_label, point_label

    recs = copy.deepcopy(_passing())
    failing = copy.deepcopy(recs)
    FAILS[key](failing)
    before = {json.dumps(r, sort_keys=True) for r in recs}
    extra = [dict(r, early_attention=True) for r in failing if json.dumps(r, sort_keys=True) not in before]
    assert extra
    kept, dropped = dedup([{"record": r, "rank": i} for i, r in enumerate(recs + extra)])
    assert dropped == 0 and len(kept) == len(recs) + len(extra)
    assert all("early attention" in point_label(r) and "early attention" in method_label(r) for r in extra)
    assert {k: v.verdict for k, v in _verdicts(kept).items()} == {k: PASS for k in ISSUE20}
    on = [dict(r, early_attention=True) for r in failing]
    assert {v.key: v.verdict for v in check_issue20(on, early_attention=None)}[key] == FAIL
    assert {v.key: v.verdict for v in check_issue20(on)}[key] == NOT_MEASURED  # all left out
    # an explicit "off" and a record from before the field are one point (the newer kept)
    kept, dropped = dedup([{"record": r, "rank": i} for i, r in enumerate(recs + [dict(r, early_attention=False)
                                                                                  for r in recs])])
    assert dropped == len(recs) and all(r.get("early_attention") is False for r in kept)


def test_speedups_pair_early_attention_and_slot_factor_alike_and_tables_tell_them_apart():
    """sparda with early attention pairs with sparse-offload run with it, at the same slot factor;
    the decode and speed-up tables label each variant (two rows of one batch are told apart)."""
    g = random  # seeded by the fresh_seed fixture
    speeds = {(m, sf, early): g.uniform(100, 1000) for m in ("sparda", "sparse-offload")
              for sf in (1.0, 1.5) for early in (False, True)}
    recs = [_rec(m, 4, tok, slot_factor=sf, early_attention=early) for (m, sf, early), tok in speeds.items()]
    pairs = {(p["slot_factor"], p["early_attention"]): p["speedup"] for p in speedups(recs)}
    assert pairs == pytest.approx({(sf, early): speeds["sparda", sf, early] / speeds["sparse-offload", sf, early]
                                   for sf in (1.0, 1.5) for early in (False, True)})
    md = report.render_markdown(recs, {})
    labels = {(sf, early): ("sparda" + (" slots ×1" if sf == 1.0 else "") + (" early attention" if early else ""))
              for sf in (1.0, 1.5) for early in (False, True)}
    for (sf, early), label in labels.items():
        row = _row(md, "| method | B | tok/s", [label, "4"])
        assert float(row["tok/s"]) == pytest.approx(speeds["sparda", sf, early], abs=0.06)
        sel = "trace" + (", slots ×1" if sf == 1.0 else "") + (", early attention" if early else "")
        row = _row(md, "| selection | B | sparda tok/s", [sel, "4"])
        assert float(row["sparda tok/s"]) == pytest.approx(speeds["sparda", sf, early], abs=0.06)
    assert "(6 of the 8 measured points here are left out of the verdicts)" in md


@pytest.mark.parametrize("key", sorted(FAILS))
def test_quantised_records_do_not_count_for_the_bf16_criteria(key):
    """A failing point stored with an int8 KV cache leaves every verdict as it was."""
    recs = copy.deepcopy(_passing())
    failing = copy.deepcopy(recs)
    FAILS[key](failing)
    before = {json.dumps(r, sort_keys=True) for r in recs}
    extra = [dict(r, kv_dtype="int8") for r in failing if json.dumps(r, sort_keys=True) not in before]
    assert extra  # the mutation changed or added some record
    got = {k: v.verdict for k, v in _verdicts(recs + extra).items()}
    assert got == {k: PASS for k in ISSUE20}


def test_criteria_not_measured_without_records_or_with_part_of_them():
    assert {v.verdict for v in check_issue20([])} == {NOT_MEASURED}
    part = [r for r in _passing() if not (r["batch"] == 16 and r["target_hit_rate"] == 0.7)]
    v = _verdicts(part)["speedup_h07"]
    assert v.verdict == NOT_MEASURED and "B16: not measured" in v.measured
    no_overlap = [{k: x for k, x in r.items() if k not in ("compute_alone_ms", "transfer_alone_ms")}
                  for r in _passing()]
    assert _verdicts(no_overlap)["overlap"].verdict == NOT_MEASURED
    failed = [dict(r, status="oom") if r["method"] == "sparda" and r["batch"] == 4 else r for r in _passing()]
    assert _verdicts(failed)["floor_b4"].verdict == NOT_MEASURED  # an oom point measured nothing


def _row(md: str, header_start: str, first_cells: list[str]) -> dict:
    """The markdown table row whose first cells are ``first_cells``, as {header: cell}."""
    lines = md.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    headers = [c.strip() for c in lines[head].strip("|").split("|")]
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:len(first_cells)] == first_cells:
            return dict(zip(headers, cells))
    raise AssertionError(f"no row {first_cells} under {header_start!r}")


def test_derived_columns_from_known_values():
    g = random  # seeded by the fresh_seed fixture
    tpot, roof, kernel = g.uniform(5, 20), g.uniform(2, 5), g.uniform(5, 20)
    kernels, exposed, copy_ms = g.randint(400, 900), g.uniform(0, 2), g.uniform(1, 8)
    compute, transfer, missed = g.uniform(4, 10), g.uniform(2, 8), g.uniform(1e7, 4e8)
    rec = {"model": "minicpm-8b", "method": "sparda", "context": CTX, "batch": 4, "status": "ok", "kv": "host",
           "decode_tok_s": 4e3 / tpot, "tpot_ms": tpot, "roofline_tpot_ms": roof, "gpu_kernel_ms": kernel,
           "kernels_per_step": kernels, "exposed_wait_ms": exposed, "copy_ms": copy_ms, "compute_alone_ms": compute,
           "transfer_alone_ms": transfer, "missed_bytes_per_step": missed, "slot_factor": 1.5}
    d = derived(rec)
    assert d["launches_per_layer"] == pytest.approx(kernels / 32)
    assert d["roof_x"] == pytest.approx(tpot / roof) and d["tpot_per_kernel"] == pytest.approx(tpot / kernel)
    assert d["exposed_pct"] == pytest.approx(100 * exposed / tpot)
    assert d["overlap_efficiency"] == pytest.approx((compute + transfer - tpot) / min(compute, transfer))
    assert d["pcie_gbps_overlapped"] == pytest.approx(missed / (copy_ms * 1e-3) / 1e9)
    # fields a record carries win over the computed ones; num_layers from the record
    given = derived({**rec, "num_layers": 40, "overlap_efficiency": 0.5, "pcie_gbps_overlapped": 33.0})
    assert (given["launches_per_layer"], given["overlap_efficiency"], given["pcie_gbps_overlapped"]) == \
        (pytest.approx(kernels / 40), 0.5, 33.0)
    bare = derived({"model": "unknown-shape", "method": "dense", "tpot_ms": tpot, "kernels_per_step": 5})
    assert bare == {"num_layers": None, "launches_per_layer": None, "roof_x": None, "tpot_per_kernel": None,
                    "exposed_pct": None, "exposed_transfer_pct": None, "overlap_efficiency": None,
                    "pcie_gbps_overlapped": None}
    # the exposed-transfer share: its own field when the record has it, else the whole stall (an upper bound)
    assert d["exposed_transfer_pct"] == pytest.approx(100 * exposed / tpot)
    part = g.uniform(0, 1) * exposed
    assert derived({**rec, "exposed_transfer_ms": part})["exposed_transfer_pct"] == pytest.approx(100 * part / tpot)

    md = report.render_markdown([rec, {**rec, "method": "dense", "kv": "device", "gpu_mem_cap_gb": 80.0,
                                       "compute_alone_ms": None, "transfer_alone_ms": None}], {})
    row = _row(md, "| method | B | tok/s", ["sparda", "4"])
    assert row["TPOT ms"] == f"{tpot:.2f}" and row["launches/layer"] == f"{kernels / 32:.1f}"
    assert row["roof ×"] == f"{tpot / roof:.2f}" and row["exposed % TPOT"] == f"{100 * exposed / tpot:.1f}"
    assert row["overlap eff."] == f"{(compute + transfer - tpot) / min(compute, transfer):.2f}"
    assert row["GPU cap GB"] == "-" and row["parity (steps)"] == "-" and row["target hit rate"] == "-"
    dense = _row(md, "| method | B | tok/s", ["dense", "4"])
    assert dense["GPU cap GB"] == "80" and dense["overlap eff."] == "-" and dense["copy ms"] == "-"


def test_speedups_pair_the_same_point_only():
    recs = _passing() + [
        _rec("sparda", 32, 1500.0),  # no sparse-offload partner
        _rec("sparse-offload", 4, 200.0, cap=80.0),  # capped: no uncapped partner
        _rec("sparda", 4, 100.0, cuda_graph=False),  # eager: its partner must be eager too
        dict(_rec("sparse-offload", 4, 1.0), status="oom"),
    ]
    got = {(p["batch"], p["target_hit_rate"], p["gpu_mem_cap_gb"], p["cuda_graph"]): p["speedup"]
           for p in speedups(recs)}
    assert got == {(4, None, None, True): pytest.approx(400 / 300), (8, None, None, True): pytest.approx(700 / 600),
                   (16, None, None, True): pytest.approx(1000 / 700), (4, 0.5, None, True): pytest.approx(420 / 250),
                   (4, 0.7, None, True): pytest.approx(450 / 290), (16, 0.7, None, True): pytest.approx(1100 / 700)}
    order = [(p["target_hit_rate"], p["batch"]) for p in speedups(recs)]
    assert order == [(None, 4), (None, 8), (None, 16), (0.5, 4), (0.7, 4), (0.7, 16)]


def _write(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


def _script():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merge_keeps_the_newest_record_of_each_point(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    _write(old / "env.json", {"date": "2026-12-01T10:00:00", "commit": "aaa", "device": "NVIDIA H200"})
    _write(new / "env.json", {"date": "2026-12-01T12:00:00", "commit": "bbb", "device": "NVIDIA H200"})
    _write(old / "results.json", [_rec("sparda", 4, 200.0), _rec("dense", 4, 300.0), _rec("sparda", 8, 10.0)])
    _write(old / "kernels.json", [{"kernel": "x", "rel_err": 0.0}])  # not records: skipped
    # the new run re-measured sparda B4; its own date on B8 is older than the old run's
    _write(new / "results.json", [_rec("sparda", 4, 500.0), _rec("sparda", 8, 20.0, date="2026-11-30T00:00:00")])
    later = _write(tmp_path / "later.json", [_rec("dense", 4, 310.0)])  # no env.json: date unknown, sorts oldest
    entries, runs = load_runs([new, old, later])
    recs, dropped = dedup(entries)
    tok = {(r["method"], r["batch"]): r["decode_tok_s"] for r in recs}
    assert tok == {("sparda", 4): 500.0, ("dense", 4): 300.0, ("sparda", 8): 10.0} and dropped == 3
    assert [Path(r["file"]).parent.name for r in runs] == ["new", "old", tmp_path.name]
    # a newer skipped point (time budget) keeps the older measurement; a newer oom replaces it
    skipped = _write(tmp_path / "skipped.json", [dict(_rec("dense", 4, 0.5), status="skipped"),
                                                 dict(_rec("dense", 8, 0.5), status="oom")])
    got = dedup(load_runs([_write(tmp_path / "first.json", [_rec("dense", 4, 9.0), _rec("dense", 8, 9.0)]),
                           skipped])[0])[0]
    assert [(r["batch"], r["status"]) for r in got] == [(4, "ok"), (8, "oom")]
    # same date (none): the later input wins
    a, b = _write(tmp_path / "a.json", [_rec("dense", 4, 1.0)]), _write(tmp_path / "b.json", [_rec("dense", 4, 2.0)])
    assert [r["decode_tok_s"] for r in dedup(load_runs([b, a])[0])[0]] == [1.0]
    assert [r["decode_tok_s"] for r in dedup(load_runs([a, b])[0])[0]] == [2.0]

    # a directory of part directories (bench_decode.py sweep OUT): each part's results.json and env.json
    parts = tmp_path / "parts"
    _write(parts / "a" / "env.json", {"date": "2026-12-02T09:00:00"})
    _write(parts / "a" / "results.json", [_rec("sparda", 4, 600.0)])
    _write(parts / "b" / "results.json", [_rec("sparda", 16, 1200.0)])
    _write(parts / "check.json", [{"method": "sparda", "tokens_equal": True}])  # not records
    got = dedup(load_runs([new, parts])[0])[0]
    assert {(r["batch"], r["decode_tok_s"]) for r in got} == {(4, 600.0), (8, 20.0), (16, 1200.0)}

    out = tmp_path / "report"
    path, kept, dropped = _script().build([str(old), str(new)], str(out))
    merged = json.loads((out / "results.json").read_text())
    assert kept == len(merged) == 3 and dropped == 2
    assert sorted(r["decode_tok_s"] for r in merged) == [10.0, 300.0, 500.0]
    md = path.read_text()
    assert "commit `aaa, bbb`" in md.replace("Commit", "commit") and "old/results.json" in md


@pytest.mark.parametrize("make, message", [
    (lambda d: [str(d / "missing")], "does not exist"),
    (lambda d: [str(_write(d / "kernels.json", [{"kernel": "x"}]))], "is not a list of bench records"),
    (lambda d: [str(_write(d / "bad.json", {}).with_name("bad.json"))], "is not a list of bench records"),
    (lambda d: [str((d / "run").mkdir() or d / "run")], "no bench records"),
])
def test_decode_report_refuses_bad_input_before_writing(tmp_path, make, message, capsys):
    (tmp_path / "broken.json").write_text("{not json")
    args = make(tmp_path) + ["--out", str(tmp_path / "out")]
    assert _script().main(["report", *args]) == 2
    printed = capsys.readouterr()
    assert message in printed.err and "Traceback" not in printed.err + printed.out
    assert not (tmp_path / "out").exists()
    with pytest.raises(SpardaError, match="no input given"):
        load_runs([])
    assert _script().main(["report", str(tmp_path / "broken.json"), "--out", str(tmp_path / "out")]) == 2
    assert "is not valid JSON" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_write_report_plots_and_sections(tmp_path, monkeypatch):
    figures = {}
    save = report._save

    def keep(fig, path):
        figures[path.name] = [[(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                               for line in ax.get_lines()] + [("bars", [p.get_height() for p in ax.patches],
                                                                [t.get_text() for t in ax.texts])]
                              for ax in fig.axes]
        save(fig, path)

    monkeypatch.setattr(report, "_save", keep)
    recs = _passing()
    path = report.write_report(recs, {"device": "NVIDIA H200", "date": "2026-12-01"}, tmp_path / "out")
    out = tmp_path / "out"
    for name in ("throughput.png", "speedup.png", "capped.png", "roofline.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not (out / "breakdown.png").exists()  # no record has a breakdown
    assert not list(out.glob(".*tmp*"))  # atomic writes leave no temporary file

    (panel,) = figures["throughput.png"]  # trace/native points only: no synthetic hit rate, no cap
    lines = {label: (x, y) for label, x, y in panel if label != "bars"}
    assert lines["sparda"] == ([1, 4, 8, 16], [120.0, 400.0, 700.0, 1000.0])
    assert lines["sparse-offload"] == ([4, 8, 16], [300.0, 600.0, 700.0]) and "sparse" not in lines
    (panel,) = figures["speedup.png"]
    lines = {label: (x, y) for label, x, y in panel if label.startswith("B")}
    assert lines["B4"][0] == [0.5, 0.7] and lines["B4"][1] == pytest.approx([420 / 250, 450 / 290])
    assert lines["B16"][0] == [0.7] and lines["B16"][1] == pytest.approx([1100 / 700])
    (panel,) = figures["capped.png"]
    heights, texts = panel[-1][1], panel[-1][2]
    assert heights == [900.0, 500.0] and texts == ["B24", "B8"]

    md = path.read_text()
    assert md.count("**PASS**") == len(ISSUE20) and "Plots: `throughput.png`, `speedup.png`, `capped.png`" in md
    paper = _row(md, "| batch | paper sparda", ["4"])
    assert paper["paper sparda × 1.4"] == f"{240.2 * 1.4:.1f}" and paper["our sparda"] == "400.0"
    assert paper["our sparda / (paper × 1.4)"] == f"{400 / (240.2 * 1.4):.2f}"
    capped = _row(md, "| model | context | GPU cap GB", ["minicpm-8b", f"{CTX:,}", "80", "sparda"])
    assert capped["best tok/s"] == "900.0" and capped["at batch"] == "24"


def test_committed_benchmark_records_load_and_report(tmp_path):
    """The committed H200 runs (docs/results/benchmarks) merge and report without error."""
    docs = ROOT / "docs" / "results" / "benchmarks"
    path, kept, dropped = _script().build([str(docs / "cuda-graphs-2026-12-01-h200"),
                                           str(docs / "fused-decode-2026-12-01-h200")], str(tmp_path / "r"))
    md = path.read_text()
    assert kept > 0 and dropped > 0 and "## Done when (issue #20)" in md and "| sparda slots ×1 | 4 |" in md  # before spare slots
