"""Near-duplicate statements (against an exact all-pairs search), eval-set overlap, CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.coding.tasks import CodingTask, RowError, read_jsonl
from harnessrl.coding.taskset import load_shipped
from harnessrl.curate.clean import main, parse_args
from harnessrl.curate.dedup import (
    NUM_PERM,
    RECALL,
    band_rows,
    contamination,
    cutoff_time,
    id_key,
    jaccard,
    near_duplicates,
    read_eval_set,
    repo_name,
    shingles,
)


def exact_keep_first(texts: list[str], threshold: float, words: int) -> dict[int, int]:
    """The definition, by brute force: a text duplicates the most similar earlier kept text."""
    kept: list[int] = []
    dups: dict[int, int] = {}
    sets = [shingles(t, words) for t in texts]
    for i, s in enumerate(sets):
        if not s:
            continue
        best = max(kept, key=lambda j: (jaccard(s, sets[j]), -j), default=None)
        if best is not None and jaccard(s, sets[best]) >= threshold:
            dups[i] = best
        else:
            kept.append(i)
    return dups


WORDS = st.lists(st.sampled_from("abcdefgh"), min_size=0, max_size=14)


@st.composite
def statements(draw: st.DrawFn) -> list[str]:
    """Texts and edited copies of them (a word dropped, swapped or added), so duplicates occur."""
    texts = [" ".join(w) for w in draw(st.lists(WORDS, min_size=1, max_size=6))]
    for _ in range(draw(st.integers(0, 8))):
        words = draw(st.sampled_from(texts)).split()
        i = draw(st.integers(0, len(words)))
        op = draw(st.sampled_from(["drop", "swap", "add"]))
        if op == "add" or not words[i:]:
            words.insert(i, draw(st.sampled_from("abcdefgh")))
        elif op == "drop":
            del words[i]
        else:
            words[i] = draw(st.sampled_from("abcdefgh"))
        texts.append(" ".join(words).upper() if draw(st.booleans()) else " ".join(words))
    return texts


@settings(max_examples=150, deadline=None)
@given(statements(), st.sampled_from([0.5, 0.7, 0.8, 0.9, 1.0]), st.integers(1, 3))
def test_near_duplicates_match_the_exact_keep_first_search(texts, threshold, words):
    # LSH misses a pair at the threshold with chance < 1 - RECALL (far less above it): over
    # these examples the expected number of misses is < 1e-3.
    assert near_duplicates(texts, threshold, words) == exact_keep_first(texts, threshold, words)


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.8, 0.9, 0.95, 1.0])
def test_band_rows_meet_the_recall_at_the_threshold_with_the_most_rows(threshold):
    r = band_rows(threshold)
    assert NUM_PERM % r == 0
    assert 1 - (1 - threshold**r) ** (NUM_PERM // r) >= RECALL
    if r < 32:  # the next size up would miss the recall
        assert 1 - (1 - threshold ** (2 * r)) ** (NUM_PERM // (2 * r)) < RECALL


def test_the_shipped_sets_one_near_duplicate_pair_is_humanevals_two_bracket_problems():
    tasks = load_shipped()
    texts = [t.problem_statement for t in tasks]
    dups = near_duplicates(texts, 0.8, 5)
    assert dups == exact_keep_first(texts, 0.8, 5)
    pairs = {(tasks[i].meta["source"], tasks[j].meta["source"]) for i, j in dups.items()}
    assert pairs == {("HumanEval/61", "HumanEval/56")}  # correct_bracketing, "()" and "<>"


@pytest.mark.parametrize(
    ("instance_id", "key"),
    [
        ("astropy__astropy-12907", ("astropy/astropy", 12907)),
        ("scikit-learn__scikit-learn-25570", ("scikit-learn/scikit-learn", 25570)),
        ("pallets__flask-5014", ("pallets/flask", 5014)),
        ("pandas-dev__pandas.95280573.pr_53652", ("pandas-dev/pandas", 53652)),
        ("pylint-dev__astroid.b114f6b5.func_basic__abc123", ("pylint-dev/astroid", None)),
        ("pallets__flask.bc098406.combine_file__0dk1ozv4", ("pallets/flask", None)),
        ("humaneval-056-swap-boolean", None),
    ],
)
def test_instance_ids_name_their_repository_and_pr(instance_id, key):
    assert id_key(instance_id) == key


def test_repo_fields_of_both_formats_name_owner_and_repository():
    assert repo_name("pallets/flask") == repo_name("swesmith/pallets__flask.bc098406")


def smith_task(instance_id: str, **meta: object) -> CodingTask:
    repo = "swesmith/" + instance_id.rsplit(".", 1)[0]
    return CodingTask(instance_id=instance_id, problem_statement="x", patch="", repo=repo,
                      branch=instance_id, meta=dict(meta))  # fmt: skip


def test_contamination_by_instance_pr_repository_and_date(tmp_path):
    path = tmp_path / "verified.jsonl"
    rows = [{"instance_id": "pallets__flask-5014", "repo": "pallets/flask"},
            {"instance_id": "sympy__sympy-20590"}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    evals = read_eval_set(path)
    assert evals.repos == {"pallets/flask", "sympy/sympy"}

    def why(task: CodingTask, same_repo: bool = False, cutoff: datetime | None = None) -> str:
        return contamination(task, evals, same_repo=same_repo, cutoff=cutoff) or ""

    flask_bug = smith_task("pallets__flask.bc098406.func_pm_op_swap__x1")
    assert why(flask_bug) == ""  # another bug in the same repository
    assert "'pallets/flask' is in the eval set" in why(flask_bug, same_repo=True)
    assert "eval instance 'pallets__flask-5014'" in why(
        smith_task("pallets__flask.bc098406.pr_5014")
    )
    # A PR mirror whose id says nothing still names the instance it mirrors in its metadata.
    mirror = smith_task("sympy__sympy.2ab64562.lm_rewrite__q", instance_ref={"instance_id": "sympy__sympy-20590"})  # fmt: skip
    assert "'sympy__sympy-20590'" in why(mirror)
    cutoff = cutoff_time("2023-12-31")  # a bare date: that whole day is allowed

    def created(when: str) -> str:
        return why(smith_task("a__b.12345678.x", created_at=when), cutoff=cutoff)

    assert created("2023-12-31T23:59:00Z") == created("2023-12-31") == ""
    assert "after the cut-off" in created("2024-01-01")
    assert "after the cut-off" in created("2023-12-31T23:00:00-05:00")  # 04:00 UTC next day
    assert created("2023-12-31T23:00:00+05:00") == ""
    assert contamination(smith_task("a__b.12345678.x", created_at="2024-01-01"), None,
                         same_repo=False, cutoff=cutoff_time("2024-01-01T00:00:00")) is None  # fmt: skip
    assert why(smith_task("a__b.12345678.x"), cutoff=cutoff) == ""  # no created_at: kept
    assert "not an ISO 8601 date" in why(
        smith_task("a__b.12345678.x", created_at="last May"), cutoff=cutoff
    )


def test_eval_set_rows_without_an_instance_id_are_named(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"instance_id": "a__b-1"}\n{"repo": "a/b"}\n')
    with pytest.raises(RowError, match=r"eval.jsonl:2: each row needs a string 'instance_id'"):
        read_eval_set(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["in.jsonl"], "--output is required"),
        (["in.jsonl", "out.jsonl", "--steps=gold,golden"], "steps must be distinct names from"),
        (["in.jsonl", "out.jsonl", "steps=gold,gold"], "steps must be distinct names"),
        (["in.jsonl", "out.jsonl", "--created-after=May"], "--created-after must be an ISO 8601"),
        (["in.jsonl", "in.jsonl"], "--output must not be the input file"),
        (["in.jsonl", "out.jsonl", "--threshold=0"], "--threshold must be in (0, 1]"),
        (["in.jsonl", "out.jsonl", "--min-char=3"], "did you mean 'statement.min_chars'"),
        (["in.jsonl", "out.jsonl", "--kind=swebench"], "--kind must be 'auto' or one of"),
    ],
)
def test_bad_command_lines_exit_2_naming_the_key(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(args)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_repository_rows_without_mirrors_stop_before_any_step_with_what_to_set(tmp_path, capsys):
    row = {"instance_id": "acme__calc.1234abcd.x", "repo": "swesmith/acme__calc.1234abcd",
           "patch": "", "FAIL_TO_PASS": ["t.py::t"], "problem_statement": "p" * 50}  # fmt: skip
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")])
    assert exit.value.code == 2
    assert "set grade.sandbox.mirrors" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()  # nothing half-written
    # Steps that check nothing out run without mirrors.
    assert (
        main([str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--steps=tests,dedup"]) == 0
    )
    assert (tmp_path / "out.jsonl").read_text() == json.dumps(row) + "\n"


def test_rows_are_split_at_newlines_only_and_kept_byte_for_byte(tmp_path):
    task = load_shipped()[0]
    row = dict(task.to_row(), problem_statement=task.problem_statement + "\u2028\u0085 end")
    text = json.dumps(row, ensure_ascii=False)  # raw separators inside a JSON string
    (tmp_path / "in.jsonl").write_text(text + "\r\n\n")
    assert main([str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--steps=statement"]) == 0
    assert (tmp_path / "out.jsonl").read_text() == text + "\n"
    # and the trainer reads the cleaned file back as the same task
    assert read_jsonl(tmp_path / "out.jsonl")[0].problem_statement == row["problem_statement"]


def test_the_module_runs_as_a_command_and_names_what_is_missing() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "harnessrl.curate"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "python -m harnessrl.curate: error: --input is required" in proc.stderr
