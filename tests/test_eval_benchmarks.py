"""Benchmark loaders on locally written files in each benchmark's schema."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from epirl.data import DataError
from epirl.eval.benchmarks import load_benchmark, parse_benchmark_list


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


OLYMPIAD_ROWS = [
    {"id": 1606, "question": "Find x.", "final_answer": ["$\\frac{1}{2}$"], "is_multiple_answer": False, "unit": None},
    {"id": 1607, "question": "Find all n.", "final_answer": ["$3$", "$5$"], "is_multiple_answer": True, "unit": None},
]


def test_olympiadbench_jsonl_strips_dollars_and_joins_multiple_answers(tmp_path, caplog):
    path = write_jsonl(tmp_path / "ob.jsonl", OLYMPIAD_ROWS)
    with caplog.at_level(logging.WARNING):
        benchmark = load_benchmark("olympiadbench", path)
    first, second = benchmark.problems
    assert (first.id, first.problem, first.answers, first.benchmark) == ("1606", "Find x.", ("$\\frac{1}{2}$",), "olympiadbench")
    assert first.gold == "\\frac{1}{2}"
    assert second.gold == "3, 5"
    # 2 rows instead of the published 674: loaded, but flagged in the log and on the object
    assert benchmark.loaded_size == 2 and benchmark.published_size == 674 and not benchmark.size_matches
    assert "674" in caplog.text


def test_minerva_parquet_uses_row_index_as_id(tmp_path):
    table = pa.Table.from_pylist([{"question": "What is 2+2?", "answer": "4"}, {"question": "Speed of light?", "answer": "3 \\times 10^8"}])
    pq.write_table(table, tmp_path / "minerva.parquet")
    benchmark = load_benchmark("minerva", str(tmp_path / "minerva.parquet"))
    assert [p.id for p in benchmark.problems] == ["0", "1"]
    assert benchmark.problems[1].gold == "3 \\times 10^8"


def test_math500_published_size_passes_the_check_and_limit_applies_after_it(tmp_path, caplog):
    rows = [{"problem": f"What is {i}+1?", "answer": str(i + 1), "unique_id": f"test/algebra/{i}.json"} for i in range(500)]
    path = write_jsonl(tmp_path / "math500.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        benchmark = load_benchmark("math500", path, limit=7)
    assert benchmark.size_matches and caplog.text == ""
    assert len(benchmark.problems) == 7 and benchmark.problems[6].id == "test/algebra/6.json"


def test_missing_column_names_file_and_column(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "solution": "s"}])
    with pytest.raises(DataError, match=r"bad.jsonl lacks column\(s\) answer"):
        load_benchmark("minerva", path)


def test_missing_file_and_duplicate_ids_fail_clearly(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_benchmark("math500", str(tmp_path / "nope.jsonl"))
    path = write_jsonl(tmp_path / "dup.jsonl", [{"problem": "a", "answer": "1", "unique_id": "x"}] * 2)
    with pytest.raises(DataError, match="duplicate problem id 'x'"):
        load_benchmark("math500", path)


def test_parse_benchmark_list():
    assert parse_benchmark_list("olympiadbench, Minerva=data/m.jsonl,math500") == [
        ("olympiadbench", None), ("minerva", "data/m.jsonl"), ("math500", None)]
    with pytest.raises(DataError, match="unknown benchmark 'gsm8k'"):
        parse_benchmark_list("gsm8k")
    with pytest.raises(DataError, match="needs a file path"):
        parse_benchmark_list("minerva=")
    with pytest.raises(DataError, match="no benchmarks"):
        parse_benchmark_list(" , ")
