"""``make gpu-check``'s budget rules (tools/gpu_check.py), without a GPU: a section that needs more
time than the run has left waits for a call of its own, which its record names, and does not fail
the run; a call of some sections (``--only``) writes files of its own name."""

from tools.gpu_check import SECTION_MIN_S, Check, headline


def never(ck, cap):
    raise AssertionError("a deferred section must not start")


def test_a_section_short_of_its_minimum_is_deferred_to_its_own_call(tmp_path):
    ck = Check(tmp_path, dry=False, budget_s=SECTION_MIN_S["one_update"] - 10)
    ck.run("one_update", never)
    rec = ck.doc["sections"]["one_update"]
    assert rec["status"] == "deferred", rec
    assert 'GPU_CHECK_ARGS="--only one_update"' in rec["reason"], rec["reason"]
    assert headline(ck.doc)["all_ok"]  # deferred by design: the run's exit status stays 0
    ck.run("mismatch", lambda ck, cap: 1 / 0)
    assert not headline(ck.doc)["all_ok"]  # an error still fails it


def test_the_dry_run_has_no_minimum(tmp_path):
    ck = Check(tmp_path, dry=True, budget_s=30)
    ck.run("one_update", lambda ck, cap: {"cap": cap})
    assert ck.doc["sections"]["one_update"]["status"] == "ok"


def test_a_call_of_some_sections_names_its_files_by_them(tmp_path):
    whole = Check(tmp_path, dry=False, budget_s=10)
    part = Check(tmp_path, dry=False, budget_s=10, only=["one_update"])
    assert part.json_path != whole.json_path
    assert part.json_path.name == whole.json_path.name.replace(
        "-" + whole.commit, "-one_update-" + whole.commit
    )
