"""The Dual-Flow quality bench's summaries, verdict and tables, from a results document."""

from __future__ import annotations

import math

import pytest

from splitphase.training.quality_report import (
    TABLE_HEAD,
    compact_si,
    markdown_table,
    summarize,
    text_table,
    verdict,
    verdict_line,
)

COST = {"params": 1.5e7, "prefill_flops_per_token": 3.0e7, "decode_flops_per_token": 6.0e7,
        "decode_bytes_per_step": 3.1e7, "kv_bytes_per_token": 4096, "train_flops": 2.0e15}


def _doc(baseline: list[float], dual: list[float]) -> dict:
    rows = {}
    for name, losses in (("baseline", baseline), ("dual-flow", dual)):
        seeds = {str(i): {"loss": x, "continuation_loss": x + 0.1} for i, x in enumerate(losses)}
        rows[name] = {"name": name, "group": "1" if name == "baseline" else "2", "cost": COST,
                      "seeds": seeds, "summary": summarize(seeds)}
    doc = {"settings": {"matched": "deeper", "preset": "small", "steps": 100, "batch_size": 8,
                        "seq_len": 128, "context": 512}, "rows": rows}
    doc["verdict"] = verdict(doc)
    return doc


def test_summary_is_the_mean_and_sample_std_over_seeds() -> None:
    s = summarize({"0": {"loss": 3.0, "continuation_loss": None},
                   "1": {"loss": 3.2, "continuation_loss": 2.0}})
    assert s["n"] == 2 and s["loss_mean"] == pytest.approx(3.1)
    assert s["loss_std"] == pytest.approx(math.sqrt(0.02))
    assert s["continuation_loss_mean"] == 2.0 and s["continuation_loss_std"] is None


def test_verdict_counts_the_margin_in_sds_of_the_difference() -> None:
    doc = _doc([3.00, 3.02, 3.04], [2.90, 2.92, 2.94])
    v = doc["verdict"]["baseline"]
    assert v["margin"] == pytest.approx(0.10)
    assert v["sd"] == pytest.approx(math.hypot(0.02, 0.02))
    assert v["beats_by_2sd"] and "YES" in verdict_line(doc)
    close = _doc([3.00, 3.02, 3.04], [2.98, 3.00, 3.02])  # 0.02 below: under 2 sd
    assert not close["verdict"]["baseline"]["beats_by_2sd"] and "NO" in verdict_line(close)
    one_seed = _doc([3.0], [2.9])
    assert one_seed["verdict"] == {} and "undetermined" in verdict_line(one_seed)


def test_tables_show_every_row_with_its_delta_and_costs() -> None:
    doc = _doc([3.00, 3.02, 3.04], [2.90, 2.92, 2.94])
    md = markdown_table(doc).splitlines()
    assert md[2] == "| " + " | ".join(TABLE_HEAD) + " |"
    dual = next(line for line in md if line.startswith("| dual-flow"))
    assert "2.9200 ± 0.0200" in dual and "-0.1000" in dual and "60.00M" in dual
    text = text_table(doc).splitlines()
    assert len(text) == 3 and text[0].startswith("row")
    assert compact_si(1.5e15) == "1.50P" and compact_si(3.1e7, "B") == "31.00MB"
    assert compact_si(512) == "512"
