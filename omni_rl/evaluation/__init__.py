"""Evaluation, in one place: answers from a model, scores by the reward parsers (or a
benchmark preset's parser and metric), and summaries.

One path serves ``omni-rl eval`` on rows (``pipeline.evaluate_rows``), ``omni-rl eval
--benchmark`` on a preset (``benchmark.prepare``, ``pipeline.answer_benchmark`` and
``pipeline.evaluate_benchmark``) and the ``data.eval`` sets evaluated during GRPO and
SFT training (``during_training.HeldOut``), so a row scores the same wherever it is
evaluated.

Modules: ``answer`` (completions for rows, every rank in step), ``score`` (a row's best
completion), ``summary`` (accuracy per problem type and source, tables), ``benchmark``
(a preset's rows, media and lmms-eval's results layout), ``pipeline`` (answer, score,
summarize), ``during_training`` (the eval sets of a training run).
"""
