"""Every results folder's INDEX.md (issue 33, item 8) is what ``python -m tools.index`` writes:
every result file listed, the current one of each series the newest commit's; every file in the
folder it belongs to (issue 46: a study's results beside the study, the rest in benchmarks/results)."""

from tools import index


def test_every_index_is_current_and_every_result_in_its_folder():
    cites = index.cited()
    assert index.RESULTS in index.folders() and len(index.folders()) > 1
    for folder in index.folders():
        rel = folder.relative_to(index.ROOT)
        assert (folder / "INDEX.md").read_text() == index.render(folder, cites), (
            f"{rel}/INDEX.md is stale: run python -m tools.index"
        )
        assert not index.misplaced(folder), (
            f"{rel} holds results of another folder: {index.misplaced(folder)}"
        )


def test_a_result_in_the_wrong_folder_is_found(monkeypatch, tmp_path):
    """A study driver's result among the benchmarks', and another's in a study: both reported."""
    studies, bench = tmp_path / "studies", tmp_path / "benchmarks" / "results"
    (studies / "alpha" / "results").mkdir(parents=True)
    bench.mkdir(parents=True)
    (studies / "alpha" / "drive.py").write_text("")
    for name in ("drive-m-p-aaaaaaa.json", "alpha-m-p-aaaaaaa.json", "throughput-m-p-aaaaaaa.json"):
        (studies / "alpha" / "results" / name).write_text("{}")
    for name in ("drive-m-p-bbbbbbb.json", "throughput-m-p-bbbbbbb.json"):
        (bench / name).write_text("{}")
    monkeypatch.setattr(index, "STUDIES", studies)
    monkeypatch.setattr(index, "RESULTS", bench)
    assert index.folders() == [bench, studies / "alpha" / "results"]
    assert index.misplaced(bench) == ["drive-m-p-bbbbbbb.json"]
    assert index.misplaced(studies / "alpha" / "results") == ["throughput-m-p-aaaaaaa.json"]


def test_the_current_result_of_a_series_is_its_newest_commits(monkeypatch, tmp_path):
    for name in ("b-m-p-aaaaaaa.json", "b-m-p-bbbbbbb.json", "b-m-p-bbbbbbb.png", "b-m-p-ccccccc-dirty.json",
                 "other-m-p-aaaaaaa-pytest.log", "plan-preregistration.json"):  # fmt: skip
        (tmp_path / name).write_text("{}")
    (tmp_path / "INDEX.md").write_text("not a result")
    monkeypatch.setattr(index, "history", lambda: {"bbbbbbb": 0, "aaaaaaa": 3})
    series, loose = index.classify(tmp_path)
    status = {f["name"]: f["status"] for files in series.values() for f in files}
    assert status == {
        "b-m-p-bbbbbbb.json": "current",
        "b-m-p-bbbbbbb.png": "current",
        "b-m-p-aaaaaaa.json": "superseded",
        "b-m-p-ccccccc-dirty.json": "not in history",
        "other-m-p-aaaaaaa-pytest.log": "current",
    }
    assert loose == ["plan-preregistration.json"]
