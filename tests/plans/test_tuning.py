"""Tuned choices keyed by GPU name: a table written by ``scripts/sweep_decode.py
--write-table`` is read for that GPU model only; every other GPU (and every key the table
lacks) keeps the measured heuristic."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import pagedattn.launch.policy as L

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "_TUNED_DIR", tmp_path)
    L.tuned_table.cache_clear()
    yield tmp_path
    L.tuned_table.cache_clear()


def test_table_applies_to_its_gpu_only(tuned_dir):
    key = L.config_key(128, 4, torch.bfloat16, 16)
    L.tuned_table_path("NVIDIA H200").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "configs": {key: {"block_n": 32, "num_stages": 3,
                                                 "ctas_per_sm": 8, "unknown_field": 1}}}))
    assert L.tuned_table_path("NVIDIA H200") == tuned_dir / "NVIDIA_H200.json"
    heuristic = L.heuristic_config(128, 4, torch.bfloat16)
    tuned = L.choose_config(128, 4, torch.bfloat16, 16, False, "NVIDIA H200")
    assert tuned == replace(heuristic, block_n=32, num_stages=3, ctas_per_sm=8)
    # another GPU model, another key, no device name, the interpreter: the heuristic
    assert L.choose_config(128, 4, torch.bfloat16, 16, False, "NVIDIA H100 80GB HBM3") \
        == heuristic
    assert L.choose_config(128, 8, torch.bfloat16, 16, False, "NVIDIA H200") \
        == L.heuristic_config(128, 8, torch.bfloat16)
    assert L.choose_config(128, 4, torch.bfloat16, 16, False, None) == heuristic
    assert L.choose_config(128, 4, torch.bfloat16, 16, True, "NVIDIA H200").block_n <= 32


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep_decode",
                                                  ROOT / "scripts" / "sweep_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(key, shape, default_us, swept):
    rows = [dict(key=key, shape=shape, kind="default", eager_us=default_us),
            dict(key=key, shape=shape, kind="floor", eager_us=1.0)]  # a peer never counts
    rows += [dict(key=key, shape=shape, kind="sweep", eager_us=us, block_n=bn, num_stages=st,
                  ctas_per_sm=c) for (bn, st, c), us in swept.items()]
    return rows


def test_table_from_rows_keeps_measured_gains_only():
    table_from_rows = _sweep_module().table_from_rows
    a, b, c = (32, 3, 4), (64, 2, 4), (128, 3, 2)
    rows = (
        # key k1, two shapes: b is 10 % faster on one and 2 % slower on the other (geometric
        # mean sqrt(0.90 x 1.02) = 0.958); a is 5 % faster on both (0.95); c, 2x faster, was
        # timed on one shape only, so it cannot be chosen
        _rows("k1", "s1", 100.0, {a: 95.0, b: 90.0, c: 50.0})
        + _rows("k1", "s2", 200.0, {a: 190.0, b: 204.0})
        # key k2: the best swept config is only 1 % faster: the heuristic stays
        + _rows("k2", "s3", 100.0, {a: 99.0, b: 101.0})
    )
    table = table_from_rows(rows)
    assert set(table) == {"k1"}
    assert table["k1"] == {"block_n": 32, "num_stages": 3, "ctas_per_sm": 4}
    assert table_from_rows(rows, min_gain=0.06) == {}


def test_the_package_data_holds_the_tables_the_launcher_reads():
    """pyproject's package-data patterns match the path ``launch/policy.py`` reads a GPU's
    table from (``launch/tuned/<name>.json``), so a table written there ships in the wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["pagedattn"]
    package = ROOT / "src" / "pagedattn"
    table = L.tuned_table_path("NVIDIA H200").relative_to(package)
    assert table.as_posix() == "launch/tuned/NVIDIA_H200.json"
    matching = [p for p in patterns if table.match(p) and len(Path(p).parts) == len(table.parts)]
    assert matching, f"no package-data pattern in {patterns} matches {table}"
