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


def test_a_partial_report_is_superseded_by_its_stages_full_report(monkeypatch, tmp_path):
    """One rule for partials (studies/README.md): a ``<stage>-partial`` report belongs to its stage's
    series (``<stage>``, else the one ``<stage>-<suffix>``), where the full report is current even
    beside a newer partial; a partial whose sweep never finished stays current."""
    for name in ("n-m-a-partial-aaaaaaa.json", "n-m-a-partial-ccccccc.json", "n-m-a-bbbbbbb.json",
                 "n-m-a-partial-ddddddd.json", "p-m-screen-partial-aaaaaaa.json", "p-m-screen-deciding-bbbbbbb.json",
                 "p-m-confirm-partial-ccccccc.json", "p-m-confirm-partial-ddddddd.json"):  # fmt: skip
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(index, "history", lambda: {"ddddddd": 0, "ccccccc": 1, "bbbbbbb": 2, "aaaaaaa": 3})
    series, _ = index.classify(tmp_path)
    status = {s: {f["name"]: f["status"] for f in files} for s, files in series.items()}
    assert status == {
        "n-m-a": {
            "n-m-a-bbbbbbb.json": "current",
            "n-m-a-partial-ddddddd.json": "superseded",
            "n-m-a-partial-ccccccc.json": "superseded",
            "n-m-a-partial-aaaaaaa.json": "superseded",
        },
        "p-m-screen-deciding": {
            "p-m-screen-deciding-bbbbbbb.json": "current",
            "p-m-screen-partial-aaaaaaa.json": "superseded",
        },
        "p-m-confirm-partial": {
            "p-m-confirm-partial-ddddddd.json": "current",
            "p-m-confirm-partial-ccccccc.json": "superseded",
        },
    }
    monkeypatch.setattr(index, "folders", lambda: [tmp_path])
    monkeypatch.setattr(index, "cited", lambda: {"n-m-a-partial-ccccccc.json": ["docs/x.md"]})
    assert sorted(p.name for p in index.prunable()) == [
        "n-m-a-partial-aaaaaaa.json", "n-m-a-partial-ddddddd.json", "p-m-confirm-partial-ccccccc.json",
        "p-m-screen-partial-aaaaaaa.json",
    ]  # fmt: skip
