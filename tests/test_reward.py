"""Reward function: extraction rules, equivalence cases, time bound, threads and the batch helper."""

import threading
import time

import pytest
from math_verify import parse, verify

from stapo.tools.reward import (
    compute_score,
    dapo_score,
    extract_answer,
    extract_boxed,
    grade_many,
    normalize_answer,
    parse_answer,
)

HANGS = "\\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate 9^(9^(9^9)) when comparing: never finishes
BOUND_SLACK_S = 1.5  # process kill and scheduling on a loaded 2-core machine


def score(solution, ground_truth, **kwargs):
    return compute_score("test", solution, ground_truth, **kwargs)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{a}{\\sqrt{b}}}", "\\frac{a}{\\sqrt{b}}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("so \\boxed 5$.", "5"),
        ("\\fbox{7}", "7"),
        ("\\boxed{}", ""),
        ("\\boxed{1} and then \\boxed{2", None),
        ("no box here", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("work\n\\boxed{3}\nAnswer: 4", "3"),  # a box wins over an Answer: line
        ("work\nAnswer: 12\nmore\nAnswer: $\\frac{1}{2}$", "$\\frac{1}{2}$"),
        ("**Answer:** 42.", "42"),
        ("truncated \\boxed{12", ""),
        ("", ""),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("4.5e33", "4.5 \\times 10^{33}"),
        ("-1./3", "-1/3"),
        ("np.arcsin(10/13)", "\\arcsin(10/13)"),
        (" 5. ", "5"),
        ("27.0", "27.0"),  # math-verify reads these itself
        ("$69$,$84$", "$69$,$84$"),
        ("\\boxed{204}", "\\boxed{204}"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def boxed_equal(gold, pred):
    return verify(parse(f"\\boxed{{{gold}}}", parsing_timeout=None), parse(f"\\boxed{{{pred}}}", parsing_timeout=None),
                  timeout_seconds=None)  # fmt: skip


@pytest.mark.parametrize(
    "gold, pred",
    [
        ("4.5e33", "4.5 \\times 10^{33}"),  # read as 4.5 * e * 33
        ("-1./3", "-\\frac{1}{3}"),
        ("np.arcsin(10/13)", "\\arcsin(10/13)"),
        ("5", "5."),  # a full stop after a boxed answer
        ("50", "50\\%"),  # \% in a box is read as text
        ("n^{2}-n-1", "m_{\\max }=n^{2}-n-1"),  # a command as a subscript label is not parsed
    ],
)
def test_each_rewrite_is_one_math_verify_misses(gold, pred):
    """Every rewrite kept in normalize_answer / parse_answer: math-verify alone gets the pair wrong, with them right."""
    assert not boxed_equal(gold, pred)
    assert score(f"so \\boxed{{{pred}}}", gold, fast_path=False)["score"] == 1.0


def test_extraction_is_one_math_verify_does_differently():
    """math-verify on a whole response collects every answer it finds and credits unmarked ones; the recipe takes
    the last box (or Answer: line) only."""
    assert verify(parse("\\boxed{4}"), parse("first \\boxed{3}, finally \\boxed{4}")) is False
    assert score("first \\boxed{3}, finally \\boxed{4}", "4", fast_path=False)["score"] == 1.0
    assert verify(parse("\\boxed{42}"), parse("the result is 42")) is True
    assert score("the result is 42", "42", fast_path=False)["score"] == 0.0


@pytest.mark.parametrize(
    "response, gold, expected, pred",
    [
        ("work \\boxed{42}.", "42", 1.0, "42"),
        ("work\nAnswer: 42", "42", 1.0, "42"),
        ("\\boxed{3}\nAnswer: 4", "3", -1.0, "4"),  # DAPO's checker: an Answer: line beats a box
        ("work \\boxed{\\frac{1}{2}}", "0.5", -1.0, "\\frac{1}{2}"),  # string match, no equivalence
        ("no answer at all", "7", -1.0, "[INVALID]"),
        ("", None, -1.0, "[INVALID]"),
    ],
)
def test_dapo_score_is_verls_math_dapo_checker(response, gold, expected, pred):
    result = dapo_score("dapo_math_boxed", response, gold)
    assert result == {"score": expected, "acc": expected == 1.0, "pred": pred}


def test_parse_answer_drops_percent_and_subscript_commands():
    assert boxed_equal("50", "50") and parse_answer("50\\%") == parse_answer("50")


# (response, ground truth, expected score); every case is checked with and without the fast path,
# so math-verify alone must agree with the cheap in-process check.
CASES = [
    ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),
    ("first \\boxed{4}, finally \\boxed{3}", "4", 0.0),
    ("\\boxed{\\frac{\\frac{1}{2}}{3}}", "\\frac{1}{6}", 1.0),
    ("\\boxed{\\dfrac{1}{6}}", "\\frac{1}{6}", 1.0),
    ("\\boxed{\\frac{1}{7}}", "\\frac{1}{6}", 0.0),
    ("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2,3\\}", 0.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{(2, 1)}", "(1,2)", 0.0),
    ("\\boxed{[2, 5)}", "[2,5)", 1.0),
    ("\\boxed{(2, 5)}", "[2,5)", 0.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{62.5}", "62.5%", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("Let me think.\nAnswer: 42", "42", 1.0),
    ("Answer: $\\frac{3}{4}$", "0.75", 1.0),
    ("Answer: 41", "42", 0.0),
    ("\\boxed{27}", "27.0", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{204}", "204", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{4.5 \\times 10^{33}}", "4.5e33", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("", "5", 0.0),
    ("I don't know.", "5", 0.0),
]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "math-verify"])
@pytest.mark.parametrize("response, ground_truth, expected", CASES)
def test_equivalence(response, ground_truth, expected, fast_path):
    result = score(response, ground_truth, fast_path=fast_path)
    assert result["score"] == expected
    assert result["acc"] is (expected == 1.0)
    assert set(result) == {"score", "acc", "pred"}


def test_pred_is_reported():
    assert score("\\boxed{7}", "7")["pred"] == "7"
    assert score("nothing", "7")["pred"] == ""


@pytest.mark.parametrize("ground_truth", [None, 7, 7.0, ["7"], {"x": 1}])
def test_odd_inputs_never_raise(ground_truth):
    result = score("\\boxed{7}", ground_truth)
    assert result["score"] in (0.0, 1.0)
    assert score(None, "7")["score"] == 0.0


@pytest.mark.parametrize(
    "response",
    [
        HANGS,
        "\\boxed{" + "{" * 50_000 + "1" + "}" * 50_000 + "}",
        "\\boxed{" + "1" * 100_000 + "}",
        "\\boxed{" + "\\frac{1}{" * 20_000 + "2" + "}" * 20_000 + "}",
        "\\boxed{" * 100_000,
        "Answer: " + "x+" * 50_000 + "1",
    ],
    ids=["huge-power", "deep-braces", "100k-digits", "deep-fractions", "unclosed-boxes", "long-answer-line"],
)
def test_pathological_inputs_respect_the_bound(response):
    start = time.monotonic()
    result = score(response, "1", timeout_s=2.0)
    assert result["score"] == 0.0
    assert time.monotonic() - start < 2.0 + BOUND_SLACK_S


def test_worker_recovers_after_a_timeout():
    assert score(HANGS, "1", timeout_s=1.0)["score"] == 0.0
    assert score("\\boxed{\\frac{2}{4}}", "0.5", timeout_s=5.0, fast_path=False)["score"] == 1.0


def test_non_main_thread_works_and_respects_the_bound():
    results = {}

    def run(key, response, ground_truth):
        start = time.monotonic()
        results[key] = (score(response, ground_truth, timeout_s=3.0, fast_path=False), time.monotonic() - start)

    threads = [
        threading.Thread(target=run, args=("correct", "\\boxed{\\frac{1}{2}}", "0.5")),
        threading.Thread(target=run, args=("hang", HANGS, "1")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert results["correct"][0]["score"] == 1.0
    assert results["hang"][0]["score"] == 0.0
    assert max(elapsed for _, elapsed in results.values()) < 3.0 + BOUND_SLACK_S


def test_grade_many_keeps_order_and_accepts_pairs_and_dicts():
    items = [
        ("\\boxed{1}", "1"),
        {"solution_str": "\\boxed{2}", "ground_truth": "3"},
        (HANGS, "1"),
        ("Answer: \\frac{1}{2}", "0.5"),
    ]
    start = time.monotonic()
    # 4 s: a comparison may have to start a fresh math-verify child (about 2 s on a loaded 2-core machine)
    results = grade_many(items, num_workers=2, timeout_s=4.0)
    assert [r["score"] for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - start < 4.0 + BOUND_SLACK_S
