"""Math answer rewards for verl's custom reward function (``reward.custom_reward_function.path=pkg://stapo.tools.reward``):

* ``name=compute_score`` (the recipe's default): math-verify equivalence of the last ``\\boxed{}`` (or ``Answer:``
  line) with the ground truth, 1 / 0; what the evaluation grades with (:func:`compute_score`);
* ``name=dapo_score``: what the paper's hyper-parameter table names ("Reward Function: DAPO"), verl's own
  ``math_dapo`` rule checker, +1 / -1 (:func:`dapo_score`). It was written for DAPO's ``Answer:`` template; under
  the paper's boxed prompt it misses correct answers (see its docstring), hence not the default.

Why our own code beside math-verify's and verl's (each point has a test in tests/test_reward.py showing what the
library alone gets wrong):

* answer extraction: math-verify parses a whole response into every answer it finds (``\\boxed{3} ... \\boxed{4}``
  becomes the set {3, 4}) and also credits an unmarked final number; the recipe's prompt asks for a box, so the last
  box (or an ``Answer:`` line) is taken, and nothing else;
* :func:`normalize_answer` and :func:`parse_answer` keep only the rewrites math-verify needs: ``4.5e33`` (read as
  4.5·e·33), ``-1./3``, ``np.arcsin``, a trailing full stop after a boxed answer, percent signs, and commands used as
  subscript labels (``m_{\\max}``);
* the process pool: verl's ``math_verify.compute_score`` keeps a ``ProcessPoolExecutor`` whose overrunning children
  are never killed (four hanging comparisons make the next, correct answer time out), whose workers import verl and
  torch (about 0.5 GB and a 10 s cold start each), and which stays broken for good once a worker dies. Here each
  comparison runs in a small pool of persistent child interpreters: the caller waits at most until the call's
  deadline, and a child that overruns is killed and replaced, in any thread, Ray actor or asyncio executor (where
  math-verify's own ``signal.alarm`` timeouts cannot work).

A cheap in-process check decides identical answers and plain numbers first (``fast_path``: 0.02 ms against about
0.5 ms for math-verify, and the same verdicts on every test case).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
"""Hard wall-clock bound of one :func:`compute_score` call, in seconds."""

MAX_ANSWER_CHARS = 1000
"""Answers (or ground truths) longer than this are only compared as strings, never parsed."""

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_LINE = re.compile(r"answer\s*:[*\s]*([^\n]*)", re.IGNORECASE)
_PERCENT = re.compile(r"\\?%")
_SUBSCRIPT_COMMAND = re.compile(r"_\{\\([A-Za-z]+)\s*\}")
_NUMPY_PREFIX = re.compile(r"\bnp\.(?=[a-z])")
_POINT_SLASH = re.compile(r"(\d)\.(?=\s*/)")
_E_NOTATION = re.compile(r"([-+]?\d+(?:\.\d+)?)[eE]([-+]?\d+)")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\s+|\\left(?![a-z])|\\right(?![a-z])|\\[!,;: ]|\\displaystyle|\^\{?\\circ\}?|\\%")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces, or ``\\boxed 5``).

    Returns None when there is no box or the last one is never closed (e.g. a truncated response).
    """
    start = None
    for match in _BOX.finditer(text):
        start = match.end()
    if start is None:
        return None
    rest = text[start:].lstrip()
    if not rest.startswith("{"):
        token = re.match(r"[^\s$]+", rest)
        return token.group() if token else None
    depth, i = 0, 0
    while i < len(rest):
        char = rest[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
        i += 1
    return None


def extract_answer(solution_str: str) -> str:
    """The model's final answer: the last box, else the last ``Answer: ...`` line, else ""."""
    boxed = extract_boxed(solution_str)
    if boxed is not None:
        return normalize_answer(boxed)
    lines = _ANSWER_LINE.findall(solution_str)
    return normalize_answer(lines[-1].rstrip("*").strip()) if lines else ""


def normalize_answer(answer: str) -> str:
    """The rewrites of an answer or ground truth that math-verify needs (module docstring), used on both sides of
    every comparison: ``4.5e33`` to ``4.5 \\times 10^{33}``, ``-1./3`` to ``-1/3``, ``np.arcsin`` to ``\\arcsin``,
    and no surrounding spaces or trailing full stop."""
    answer = answer.strip().rstrip(".").strip()
    answer = _NUMPY_PREFIX.sub(r"\\", answer)
    answer = _POINT_SLASH.sub(r"\1", answer)
    number = _E_NOTATION.fullmatch(answer)
    if number:
        answer = f"{number[1]} \\times 10^{{{number[2]}}}"
    return answer


def _canonical(answer: str) -> str:
    """String form for the fast equality check: no spacing, sizing, ``\\text{}``, degree or % marks."""
    answer = _TEXT_WRAPPER.sub(r"\1", answer)
    return _LATEX_NOISE.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def _quick_verdict(gold: str, pred: str) -> bool | None:
    """Decide cheaply when possible: equal strings, or two plain numbers; None means "ask math-verify"."""
    if _canonical(gold) == _canonical(pred):
        return True
    if max(len(gold), len(pred)) <= MAX_ANSWER_CHARS and _NUMBER.fullmatch(gold) and _NUMBER.fullmatch(pred):
        if Fraction(gold) == Fraction(pred):
            return True
        if "." not in gold + pred:  # distinct integers; decimals may still match within tolerance
            return False
    return None


def parse_answer(answer: str) -> list:
    """math-verify parse of a normalised answer, wrapped in ``\\boxed{}`` so that it is read whole (as verl's
    scorer wraps ground truths). Percent signs are dropped (math-verify parses ``50\\%`` in a box as text, so
    ``50\\%`` and ``50`` never match) and commands used as subscript labels become plain names (``m_{\\max}``,
    ``L_{\\odot}``: math-verify cannot parse them)."""
    from math_verify import parse

    answer = _SUBSCRIPT_COMMAND.sub(r"_{\1}", _PERCENT.sub("", answer))
    return parse(f"\\boxed{{{answer}}}", parsing_timeout=None)


def math_verify_equal(gold: str, pred: str) -> bool:
    """math-verify equivalence of two normalised answers, without any time bound (worker side)."""
    from math_verify import verify

    try:
        return bool(verify(parse_answer(gold), parse_answer(pred), timeout_seconds=None))
    except Exception:  # noqa: BLE001 - anything math-verify or sympy raises means "not shown equal"
        return False


# Loads this file by path, so a worker imports neither the stapo package nor anything it pulls in.
_WORKER_CODE = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('stapo_reward_worker', sys.argv[1]); "
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
    "module._serve(int(sys.argv[2]), int(sys.argv[3]))"
)


class _Worker:
    """A child interpreter answering ``math_verify_equal`` requests over a pair of pipes."""

    def __init__(self) -> None:
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, __file__, str(request_r), str(reply_w)],
            pass_fds=(request_r, reply_w),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # keep terminal Ctrl-C away from the workers
        )
        os.close(request_r)
        os.close(reply_w)
        self.requests = Connection(request_w, readable=False)
        self.replies = Connection(reply_r, writable=False)

    def ask(self, gold: str, pred: str, timeout: float) -> bool | None:
        """The worker's verdict, or None if it did not answer within ``timeout`` seconds."""
        try:
            self.requests.send((gold, pred))
            if self.replies.poll(max(timeout, 0.0)):
                return self.replies.recv()
        except (EOFError, OSError):
            logger.warning("math-verify worker exited unexpectedly (code %s)", self.process.poll())
        return None

    def close(self) -> None:
        """Kill the child and release the pipes."""
        self.process.kill()
        self.process.wait()
        self.requests.close()
        self.replies.close()


def _serve(request_fd: int, reply_fd: int) -> None:
    """Worker main loop: answer (gold, pred) requests until the parent goes away."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    requests = Connection(request_fd, writable=False)
    replies = Connection(reply_fd, readable=False)
    while True:
        try:
            gold, pred = requests.recv()
        except EOFError:
            return
        replies.send(math_verify_equal(gold, pred))


_pool_lock = threading.Lock()
_idle: list[_Worker] = []


def _reset_pool_in_child() -> None:
    """After fork the workers belong to the parent: start from an empty pool."""
    global _pool_lock, _idle
    _pool_lock, _idle = threading.Lock(), []


os.register_at_fork(after_in_child=_reset_pool_in_child)


@atexit.register
def _close_idle_workers() -> None:
    """Stop the pooled workers when the interpreter exits (they would also exit on the closed pipe)."""
    with _pool_lock:
        while _idle:
            _idle.pop().close()


def _bounded_math_verify(gold: str, pred: str, deadline: float) -> bool:
    """``math_verify_equal`` in a pooled worker; False if it does not answer before ``deadline``.

    The pool grows to the number of concurrent callers and always keeps one warm spare, so a
    call never waits for another caller's worker.
    """
    with _pool_lock:
        worker = _idle.pop() if _idle else None
        if not _idle:
            _idle.append(_Worker())
    if worker is not None and worker.process.poll() is not None:
        worker.close()
        worker = None
    worker = worker or _Worker()
    verdict = worker.ask(gold, pred, deadline - time.monotonic())
    if verdict is None:
        worker.close()
        logger.warning("math-verify gave no verdict in time for pred %.80r (gold %.80r); scored 0", pred, gold)
        return False
    with _pool_lock:
        _idle.append(worker)
    return verdict


def compute_score(
    data_source: str | None,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    fast_path: bool = True,
    **kwargs: Any,
) -> dict:
    """verl reward: ``{"score": 1.0 | 0.0, "acc": bool, "pred": extracted answer or ""}``.

    ``data_source`` and ``extra_info`` are accepted for verl's calling convention and ignored.
    ``timeout_s`` bounds the whole call (slow comparisons count as wrong); ``fast_path=False``
    skips the in-process string/number check so that math-verify decides every case (used to
    test that math-verify itself accepts the ground truths). Never raises.
    """
    deadline = time.monotonic() + timeout_s
    pred = ""
    correct = False
    try:
        pred = extract_answer(solution_str or "")
        gold = normalize_answer("" if ground_truth is None else str(ground_truth))
        if pred and gold:
            verdict = _quick_verdict(gold, pred) if fast_path else None
            if verdict is None and max(len(gold), len(pred)) <= MAX_ANSWER_CHARS:
                verdict = _bounded_math_verify(gold, pred, deadline)
            correct = bool(verdict)
    except Exception:  # noqa: BLE001 - a reward function must not take down the trainer
        logger.exception("reward computation failed; scoring 0")
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": pred}


def dapo_score(
    data_source: str | None, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None, **kwargs: Any
) -> dict:
    """What the paper's table names as its training reward ("Reward Function: DAPO"): verl's ``math_dapo`` rule
    checker as the DAPO recipe calls it, +1 if right, -1 otherwise. On the last 300 characters of the response it
    takes the last ``Answer:`` line (compared with the ground truth after DAPO's normalisation), and only when there
    is none the last ``\\boxed{}`` of the last 100 characters (compared as an exact string). Made for DAPO's
    ``Answer:`` template: under a boxed prompt it scores ``**Final Answer:** \\boxed{42}``, ``\\boxed{ 42 }`` or a box
    followed by 100 characters as wrong, and never credits ``\\frac{1}{2}`` for 0.5. Returns ``{"score", "acc",
    "pred"}`` like :func:`compute_score`."""
    from verl.utils.reward_score import math_dapo

    result = math_dapo.compute_score(solution_str or "", "" if ground_truth is None else str(ground_truth))
    return {"score": float(result["score"]), "acc": bool(result["acc"]), "pred": result["pred"] or ""}


def grade_many(
    items: Iterable[tuple[str, Any] | Mapping[str, Any]],
    num_workers: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[dict]:
    """Grade many responses in parallel; returns :func:`compute_score` dicts in input order.

    ``items`` are ``(solution_str, ground_truth)`` pairs or mappings with those keys (other
    :func:`compute_score` arguments may be included). Up to ``num_workers`` (default: CPU count)
    comparisons run at once, each in its own math-verify process and each under ``timeout_s``;
    extra ``kwargs`` are passed to every :func:`compute_score` call.
    """

    def grade(item: tuple[str, Any] | Mapping[str, Any]) -> dict:
        arguments = (
            dict(item) if isinstance(item, Mapping) else dict(zip(("solution_str", "ground_truth"), item, strict=True))
        )
        arguments.setdefault("data_source", None)
        return compute_score(**arguments, timeout_s=timeout_s, **kwargs)

    with ThreadPoolExecutor(max_workers=num_workers or os.cpu_count() or 1) as pool:
        return list(pool.map(grade, items))
