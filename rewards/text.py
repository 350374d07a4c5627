"""Text answers: ocr (word or character error rate) and open_ended (exact or ROUGE)."""

from __future__ import annotations

import re
import unicodedata

import jiwer
from rouge_score import rouge_scorer

from omni_rl.rewards.base import Target, register
from omni_rl.rewards.parsing import normalize_text

# Scripts written without spaces between words: scored per character.
NO_SPACE_SCRIPTS = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u0e00-\u0e7f\u0e80-\u0eff\u1000-\u109f\u1780-\u17ff]"
)
SHORT_ANSWER_CHARS = 10
MAX_TEXT_CHARS = 5_000  # bounds ROUGE-L's quadratic LCS on runaway completions


def _ocr_normalize(text: str, fields: dict) -> str:
    return normalize_text(
        text,
        lower=not fields.get("ocr_case_sensitive", False),
        punctuation=not fields.get("ocr_keep_punctuation", False),
    )


def _validate_text(target: Target) -> None:
    if not str(target.answer).strip():
        raise ValueError("the answer is empty")


@register("ocr", aliases=("text_recognition",), validate=_validate_text)
def ocr(prediction: str, target: Target) -> tuple[float, dict]:
    """1 - min(1, WER); CER for scripts without spaces. Row fields ``ocr_case_sensitive``
    and ``ocr_keep_punctuation`` turn off those normalizations."""
    gold = _ocr_normalize(str(target.answer), target.fields)
    predicted = _ocr_normalize(prediction[:MAX_TEXT_CHARS], target.fields)
    if not gold:
        return float(not predicted), {}
    if not predicted:
        return 0.0, {"metric": "empty"}
    if NO_SPACE_SCRIPTS.search(gold):
        metric, error = "cer", jiwer.cer(gold.replace(" ", ""), predicted.replace(" ", ""))
    else:
        metric, error = "wer", jiwer.wer(gold, predicted)
    return 1.0 - min(1.0, error), {"metric": metric, "error_rate": error}


class _UnicodeTokenizer:
    """ROUGE tokens for any script: each CJK/Thai/... character is a token, other runs
    of letters and digits are words (rouge-score's default drops non-ASCII)."""

    WORD = re.compile(r"\w+", re.UNICODE)

    def tokenize(self, text: str) -> list[str]:
        tokens = []
        for word in self.WORD.findall(unicodedata.normalize("NFKC", text).casefold()):
            if NO_SPACE_SCRIPTS.search(word):
                run = ""
                for ch in word:
                    if NO_SPACE_SCRIPTS.match(ch):
                        if run:
                            tokens.append(run)
                            run = ""
                        tokens.append(ch)
                    else:
                        run += ch
                if run:
                    tokens.append(run)
            else:
                tokens.append(word)
        return tokens


_TOKENIZER = _UnicodeTokenizer()
_ROUGE = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], tokenizer=_TOKENIZER)


def rouge_f1(prediction: str, gold: str) -> float:
    """Mean of ROUGE-1, ROUGE-2 and ROUGE-L F1; ROUGE-2 only where the gold has a
    bigram (a one-word gold such as "refrigerator" has none, and its ROUGE-2 of 0 would
    hold the gold itself to 2/3, as Video-R1's free-form reward does)."""
    scores = _ROUGE.score(gold, prediction)
    if len(_TOKENIZER.tokenize(gold)) < 2:
        scores.pop("rouge2")
    return sum(s.fmeasure for s in scores.values()) / len(scores)


@register("open_ended", aliases=("free_form", "open", "short_answer"), validate=_validate_text)
def open_ended(prediction: str, target: Target) -> tuple[float, dict]:
    """A short gold answer (<= 10 characters) needs a normalized exact match; a longer
    one scores the mean ROUGE-1/2/L F1 (``rouge_f1``)."""
    gold = str(target.answer).strip()
    if len(gold) <= SHORT_ANSWER_CHARS:
        return float(normalize_text(prediction) == normalize_text(gold)), {"metric": "exact"}
    return rouge_f1(prediction[:MAX_TEXT_CHARS], gold), {"metric": "rouge"}
