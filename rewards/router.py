"""Routing by problem_type: single and batched scoring, load-time checks, plug-ins.

User scorers plug in without forking omni_rl: from a config mapping
``{problem_type: "package.module:function"}`` or from the entry-point group
``omni_rl.rewards`` (name = problem type, value = ``module:function``). A plug-in is a
function ``(response, target) -> RewardResult | float``; like the built-in scorers it
is never allowed to crash a run.

A plug-in's values are used as they are: any finite number, a penalty below 0 or a
bonus above 1 included (nothing is clipped; the ``rewards`` weights do not apply to
it). A float ``x`` is the result ``RewardResult(x, x, 0.0)``. A plug-in that raises or
returns something that is not a number scores 0 with the error in ``details``.

A nan or inf (in the score, accuracy or format) becomes 0 and the result carries
``details["nonfinite"]``, counted per step as ``reward/nonfinite``. The rule is 0,
rather than say the group's lowest reward, because a scorer sees one completion: the
same response then scores the same in training, evaluation and ``omni-rl rewards
score``, and 0 is the lowest score a built-in scorer gives.
Under a plug-in that also returns negative values such a completion outranks the
penalised ones: a ``reward/nonfinite`` above 0 is a plug-in bug to fix.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import entry_points

from omni_rl.errors import OmniRLError
from omni_rl.rewards.base import MAX_RESPONSE_CHARS, SCORERS, RewardResult, RewardSettings, Target
from omni_rl.rewards.mathematics import set_timeout, using_slot

ENTRY_POINT_GROUP = "omni_rl.rewards"


def get_scorer(problem_type: str):
    """The scorer of a problem type; unknown types list the known ones and the closest."""
    return SCORERS.get(problem_type)


def score(
    problem_type: str,
    response: str,
    answer,
    *,
    options: list[str] | None = None,
    settings: RewardSettings | None = None,
    **fields,
) -> RewardResult:
    """Score one response against its gold answer."""
    target = Target(answer, options, fields)
    if settings is not None:
        set_timeout(settings.math_timeout)
    return get_scorer(problem_type)(response, target, settings)


def score_batch(
    problem_types: Sequence[str],
    responses: Sequence[str],
    targets: Sequence[Target],
    settings: RewardSettings | None = None,
    workers: int = 2,
) -> list[RewardResult]:
    """Score many responses; slow types (math) run on ``workers`` threads, each driving
    its own long-lived verifier process, the rest in this thread."""
    if not len(problem_types) == len(responses) == len(targets):
        raise ValueError("problem_types, responses and targets must have the same length")
    scorers = [get_scorer(t) for t in problem_types]
    if settings is not None:
        set_timeout(settings.math_timeout)
    results: list[RewardResult | None] = [None] * len(responses)
    slow = [i for i, s in enumerate(scorers) if s.slow]
    for i, scorer in enumerate(scorers):
        if not scorer.slow:
            results[i] = scorer(responses[i], targets[i], settings)
    if slow:
        workers = max(1, min(workers, len(slow)))

        def run(k: int) -> None:
            with using_slot(k):
                for i in slow[k::workers]:
                    results[i] = scorers[i](responses[i], targets[i], settings)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, range(workers)))
    return results  # type: ignore[return-value]


@dataclass(frozen=True)
class PluginScorer:
    """A user function ``(response, target) -> RewardResult | float`` as a scorer."""

    name: str
    function: object
    slow: bool = False
    validate: object = None

    def __call__(self, response: str, target: Target, settings: RewardSettings | None = None) -> RewardResult:
        response = "" if response is None else str(response)[:MAX_RESPONSE_CHARS]
        try:
            result = self.function(response, target)
        except Exception as err:  # noqa: BLE001 - a plug-in must not crash the run either
            return RewardResult(0.0, 0.0, 0.0, {"error": f"{type(err).__name__}: {err}"[:300]})
        if isinstance(result, RewardResult):
            values, details = (result.score, result.accuracy, result.format), result.details
        else:
            values, details = (result, result, 0.0), {}
        try:
            values = tuple(float(v) for v in values)
        except (TypeError, ValueError, OverflowError):
            return RewardResult(0.0, 0.0, 0.0, {"error": f"plug-in returned {type(result).__name__}"})
        return _finite_result(*values, details)


def _finite_result(score: float, accuracy: float, format_: float, details: dict) -> RewardResult:
    """The result with each nan or inf value replaced by 0 and named in
    ``details["nonfinite"]`` (the rule and why: the module docstring)."""
    values = {"score": score, "accuracy": accuracy, "format": format_}
    nonfinite = {name: repr(v) for name, v in values.items() if not math.isfinite(v)}
    if not nonfinite:
        return RewardResult(score, accuracy, format_, details)
    settled = [0.0 if name in nonfinite else v for name, v in values.items()]
    return RewardResult(*settled, {**details, "nonfinite": nonfinite})


def _import(spec: str, problem_type: str):
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise OmniRLError(f"reward plug-in for '{problem_type}': expected 'module:function', got {spec!r}")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise OmniRLError(f"reward plug-in for '{problem_type}': cannot import {spec!r} ({err})") from None


def load_plugins(custom: dict[str, str] | None = None) -> list[str]:
    """Register plug-in scorers from ``custom`` and the ``omni_rl.rewards`` entry points;
    returns the names added. Re-registering the same function is a no-op."""
    added = []
    specs = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    specs.update(custom or {})
    for name, spec in specs.items():
        function = _import(spec, name)
        if name in SCORERS:
            existing = SCORERS.get(name)
            if isinstance(existing, PluginScorer) and existing.function is function:
                continue
            raise OmniRLError(f"reward plug-in '{name}' ({spec}) clashes with a registered problem type")
        SCORERS.register(name)(PluginScorer(name, function))
        added.append(name)
    return added


@dataclass(frozen=True)
class RowProblem:
    """A row that can never be scored: where and why; ``unknown_type`` is its
    problem type when no scorer has that name."""

    id: str
    path: str
    reason: str
    unknown_type: str | None = None


def check_targets(rows: Sequence) -> list[RowProblem]:
    """Load-time checks of dataset rows (``omni_rl.preprocess.rows.Row``): a RowProblem
    for every row whose problem_type is unknown (its reason lists the known types and
    the closest) or whose gold answer its scorer cannot read. Every row is checked."""
    problems = []
    for row in rows:
        try:
            scorer = get_scorer(row.problem_type)
        except OmniRLError as err:
            problems.append(RowProblem(row.id, row.source, str(err), row.problem_type))
            continue
        validate = getattr(scorer, "validate", None)
        if validate is None:
            continue
        target = Target(row.answer, row.fields.get("options"), row.fields)
        try:
            validate(target)
        except ValueError as err:
            problems.append(RowProblem(row.id, row.source, str(err)))
    return problems
