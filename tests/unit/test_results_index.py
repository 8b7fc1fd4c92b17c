"""benchmarks/results/INDEX.md (issue 33, item 8) is what ``python -m tools.index`` writes:
every result file listed, the current one of each series the newest commit's."""

from tools import index


def test_the_index_is_current():
    assert index.INDEX.read_text() == index.render(), (
        "benchmarks/results/INDEX.md is stale: run python -m tools.index"
    )


def test_the_current_result_of_a_series_is_its_newest_commits(monkeypatch, tmp_path):
    for name in ("b-m-p-aaaaaaa.json", "b-m-p-bbbbbbb.json", "b-m-p-bbbbbbb.png", "b-m-p-ccccccc-dirty.json",
                 "other-m-p-aaaaaaa-pytest.log", "plan-preregistration.json"):  # fmt: skip
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(index, "RESULTS", tmp_path)
    monkeypatch.setattr(index, "INDEX", tmp_path / "INDEX.md")
    monkeypatch.setattr(index, "history", lambda: {"bbbbbbb": 0, "aaaaaaa": 3})
    series, loose = index.classify()
    status = {f["name"]: f["status"] for files in series.values() for f in files}
    assert status == {
        "b-m-p-bbbbbbb.json": "current",
        "b-m-p-bbbbbbb.png": "current",
        "b-m-p-aaaaaaa.json": "superseded",
        "b-m-p-ccccccc-dirty.json": "not in history",
        "other-m-p-aaaaaaa-pytest.log": "current",
    }
    assert loose == ["plan-preregistration.json"]
