"""Choice problems: multiple_choice (an option named by its letter or its text),
choice_text (the option's text only, as R1-AQA scores audio QA), choice_words (MMAU's
official rule) and boolean.

How an answer names an option (``parse_choice``), in the order tried:

1. a letter alone: "B", "(B)", "[B]", "B.", "B)", "**B**", "'B'", "Answer: B", "Option (B)";
2. an option's text alone ("a dog jumps into the pool", "J.D. Salinger", "B:maj7/1"),
   case, spacing and outer punctuation aside; periods, apostrophes and separators too
   when that still names one option ("J. D. Salinger"), symbols never ("C#" is not "C");
3. a letter leading the answer, then its option's text or an explanation: "B. A dog
   jumps into the pool.", "(B) C major", "B, because ...", "B" and a new line,
   "B is the correct answer.", "C (up)" (its own text in the brackets). Refused when
   what follows is another option's text, lists other options ("A. left B. right",
   "A, B"), states another letter, or denies it ("A is incorrect", "D) down is
   wrong": then rule 4 reads the rest, "A is incorrect; the answer is B");
4. one letter stated as the answer anywhere: "..., so the answer is C", "the best
   option is (C)", "The answer is \"C\".", "Answer:" and C on the next line, "I think
   it's B.", "I'd go with C", "C is correct", "Therefore, C.",
   or an answer phrase followed by an option's text ("the answer is a dog"). Two
   different options stated ("the answer is A or B", "the answer is left or right",
   "the answer is A ... the answer is C") are no answer.

The article and the pronoun are not letters: "A person walks ..." and "a dog barks"
never name option A, nor "I think ..." option I. Options repeating one text are one
answer: naming either is right. Everything here runs in time linear in the answer.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from omni_rl.rewards.base import Target, register
from omni_rl.rewards.parsing import normalize_text

LETTERS = "ABCDEFGHIJ"

# Answers are cleaned first (markdown emphasis dropped, runs of spaces made one), so
# every " ?" below stands for any run of spaces and no two quantifiers compete.
MARKDOWN = re.compile(r"\*\*|__|`")
SPACES = re.compile(r"[^\S\n]+")
NEWLINES = re.compile(r" ?\n\s*")
OUTER = " \n.,;:!?\"'“”‘’*_"
LOOSE = str.maketrans(dict.fromkeys(".,;:!?'’\"“”()[]{}", " "))

# "B", "(B)", "[B]", "B.", "B)", "B:", "'B'", "\"B\"."
LONE = re.compile(r"[(\[\"'“‘]? ?([A-Ja-j]) ?[)\]\"'”’]? ?[.):：]?")
# "Answer: B", "the answer is (B).", "Option B", "correct choice: C", "letter D"
SHORT = re.compile(
    r"(?:the |my )?(?:correct |final |best |right )?(?:answer|option|choice|letter)(?: is)? ?[:：]? ?"
    r"[(\[]? ?([A-Ja-j]) ?[)\]]? ?[.)]?",
    re.IGNORECASE,
)
# a letter leading a longer answer: "(B) ...", "B. ...", "B: ...", "B\n...", "B, ...",
# "B - ...", "B is ...", "B because ...", "B (its text)"; a leading "I" is a pronoun
# unless labelled
CONTINUATION = ("is", "was", "because", "since", "as", "would", "should", "seems", "appears", "looks")
LEAD = re.compile(
    r"[(\[] ?([A-J]) ?[)\]] ?[.:：]?"
    r"|([A-J]) ?[.):：]"
    r"|([A-HJ])(?=\n| ?,| [-–—] | (?:" + "|".join(CONTINUATION) + r")\b)"
    r"|([A-HJ]) (?=[(\[])"
)
# what denies a leading letter (and its option's text): "A is incorrect", "D) down is wrong"
DENIED = re.compile(
    r" ?(?:(?:is|was|seems|appears|looks|would be)(?: to be)? (?:not|incorrect|wrong|false|unlikely|impossible)"
    r"|isn't|isn’t|wasn't|wasn’t)\b",
    re.IGNORECASE,
)
# what may follow a leading letter and makes it a list: "A, B", "A/B", "(A)(B)", "A or B"
LIST_START = re.compile(r" ?(?:(?:or|and|&|/|,) ?)?[(\[]?([A-J])[)\]]? ?(?:$|[,/&;(\[]|(?:or|and)\b)")
# another option's label inside an answer: "A. left B. right", "(C)"; not "J.D."
LABEL = re.compile(r"(?<![A-Za-z0-9.'’])(?:[(\[]([A-J])[)\]]|([A-J])[.)](?= |\n|$))")
# phrases that state the answer; the letter (or option text) follows
STATED = re.compile(
    r"\b(?:answer|option|choice|pick|selection)(?: (?:is|was|would be|will be|should be|must be))(?: ?[:：])?"
    r"|\b(?:answer|option|choice) ?[:：=]"
    r"|\bi(?: would| will|'d|’d|'ll|’ll)? (?:choose|select|pick|go with)"
    r"|\bi (?:think|believe|guess|reckon)(?: that)?(?: (?:it's|it’s|it is|it would be|the answer is))?"
    r"|(?P<so>\b(?:so|therefore|thus|hence)(?: ?,)?(?: (?:it's|it’s|it is))?)"
    r"|答案(?:是|为|[:：])|选择?",
    re.IGNORECASE,
)
# the letter after an answer phrase, on its line or the next ("Answer:\nB"), in brackets or quotes
STATED_LETTER = re.compile(
    r"[ \n]?[:：]?[ \n]?(?:(?:option|choice|letter) ?)?([(\[\"'“‘] ?)?([A-Ja-j])(?: ?[)\]\"'”’])?", re.IGNORECASE
)
# a word after an "A" or "I" that makes it a letter, not the article or the pronoun
AFTER_WORD = re.compile(r" ([A-Za-z]+)")
# what may follow "so"/"therefore" and a letter: the end of a sentence
SO_END = re.compile(r" ?(?:$|[.!,;)\n])")
# "B, C", "B or C", "B/C" after a stated letter
LIST_NEXT = re.compile(
    r" ?(?:,|/|&|or|and|, or|, and) ?(?:(?:option|choice) ?)?([(\[] ?)?([A-Ja-j])(?: ?[)\]])?(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# "B is correct", "(C) is the best", "D would be the answer"
IS_CORRECT = re.compile(
    r"(?<![A-Za-z0-9'’])[(\[]?([A-J])[)\]]? (?:is|seems|appears|would be) (?:to be )?(?:the )?"
    r"(?:correct|right|best|most likely|answer)\b"
)
# a bracketed letter closing the answer: "... jumps into the pool (B)."
CLOSING = re.compile(r"[(\[]([A-J])[)\]][ .!]*$")
TEXT_CHECKS = 16  # answer phrases whose following text is compared with the options
LABELLED_OPTION = re.compile(r"\s*[(\[]?\s*([A-J])\s*[)\]]?\s*[.):：]\s*")


# ------------------------------------------------------------------------- options


def option_texts(options) -> list[str]:
    """The options' texts: labels ("A. chair", "(B) table") are dropped only when every
    option carries its own, A, B, C... in order, so that options that merely look
    labelled ("B:maj7/1", "F. Scott Fitzgerald") keep their text."""
    texts = [str(o) for o in options or []]
    labels = [LABELLED_OPTION.match(t) for t in texts]
    if texts and len(texts) <= len(LETTERS) and all(m and m.group(1) == LETTERS[i] for i, m in enumerate(labels)):
        return [t[m.end() :] for t, m in zip(texts, labels, strict=True)]
    return texts


def _clean(text: str) -> str:
    """Markdown emphasis dropped, spaces collapsed, one newline between lines."""
    text = unicodedata.normalize("NFKC", MARKDOWN.sub("", str(text)))
    return NEWLINES.sub("\n", SPACES.sub(" ", text)).strip()


def _key(text: str) -> str:
    """The text as compared exactly: case folded, spaces collapsed, outer punctuation
    dropped (inner punctuation kept: "C#" is not "C")."""
    return " ".join(_clean(text).casefold().split()).strip(OUTER)


def _loose(text: str) -> str:
    """The text as compared loosely: periods, apostrophes, brackets and separators as
    spaces ("J. D. Salinger", "left,right"); symbols that tell options apart stay
    ("A#", "-5", "4/4")."""
    return " ".join(_clean(text).casefold().translate(LOOSE).split())


@dataclass(frozen=True)
class Choices:
    """A question's options, ready to be compared with answers (indices, not letters)."""

    texts: list[str]
    keys: list[str]
    loose: list[str]

    @classmethod
    def of(cls, options) -> Choices:
        texts = option_texts(options)
        return cls(texts, [_key(t) for t in texts], [_loose(t) for t in texts])

    def __len__(self) -> int:
        return len(self.texts)

    def named(self, text: str) -> int | None:
        """The option ``text`` is: equal up to case, spacing and outer punctuation, else
        up to periods, apostrophes, brackets and separators (``_loose``) when that
        leaves one option's text (the first of repeats)."""
        if not self.texts or len(text) > 4 * max(map(len, self.texts)) + 64:
            return None
        key = _key(text)
        if key in self.keys:
            return self.keys.index(key)
        norm = _loose(text)
        found = {self.keys[i] for i, n in enumerate(self.loose) if n and n == norm}
        return self.loose.index(norm) if len(found) == 1 else None

    def leading(self, text: str) -> int | None:
        """The option whose text ``text`` starts with (the longest; whole words; compared
        loosely)."""
        norm = _loose(text[: max(map(len, self.texts), default=0) + 40])
        best = None
        for i, n in enumerate(self.loose):
            if n and (norm == n or norm.startswith(n + " ")) and (best is None or len(n) > len(self.loose[best])):
                best = i
        return best

    def goes_on_to_another(self, text: str, i: int) -> bool:
        """Whether ``text``, which starts with option ``i``'s text, names another option
        after it ("left or right", "left, right")."""
        words = _loose(text[: 2 * max(map(len, self.texts)) + 40])[len(self.loose[i]) :].split()
        while words and words[0] in ("or", "and", "/", "&"):
            words = words[1:]
        other = self.leading(" ".join(words))
        return other is not None and not self.same(other, i)

    def same(self, i: int, j: int) -> bool:
        """Whether options ``i`` and ``j`` are one answer (one index, or one text)."""
        if i == j:
            return True
        return i < len(self) and j < len(self) and self.keys[i] == self.keys[j]

    def canonical(self, i: int) -> int:
        """The first option with option ``i``'s text."""
        return self.keys.index(self.keys[i]) if i < len(self) else i


# ------------------------------------------------------------------------ letters


def _letter_index(letter: str) -> int:
    return LETTERS.index(letter.upper())


def _is_letter_here(text: str, end: int, letter: str, bracketed: bool) -> bool:
    """Whether a letter ending at ``end`` is a letter and not part of a word, the
    article ("a dog") or the pronoun ("I think")."""
    if end < len(text) and text[end].isascii() and text[end].isalnum():
        return False
    if letter in "AaIi" and not bracketed and (m := AFTER_WORD.match(text, end)):
        return m.group(1).lower() in CONTINUATION
    return True


def _stated(text: str, choices: Choices, letters: bool = True) -> tuple[set[int], bool]:
    """The options that ``text`` states as its answer (by letter or, after an answer
    phrase, by text), as canonical indices, and whether one statement lists several
    ("the answer is A or B")."""
    found: set[int] = set()
    listed = False
    for n, m in enumerate(STATED.finditer(text)):
        # an option's text first ("the answer is C major"), but a lone letter stays a
        # letter when the options are letters ("the answer is D" among "C", "D", "G")
        if choices.texts and n < TEXT_CHECKS and not m.group("so"):
            after = text[m.end() :].lstrip(" :")
            named = choices.leading(after)
            if named is not None and not (letters and LONE.fullmatch(choices.texts[named].strip())):
                found.add(choices.canonical(named))
                listed = listed or choices.goes_on_to_another(after, named)
                continue
        if not letters:
            continue
        after = STATED_LETTER.match(text, m.end())
        if after is None or not _is_letter_here(text, after.end(), after.group(2), bool(after.group(1))):
            continue
        if m.group("so") and not SO_END.match(text, after.end()):
            continue
        found.add(choices.canonical(_letter_index(after.group(2))))
        more = LIST_NEXT.match(text, after.end())
        if more and _is_letter_here(text, more.end(), more.group(2), bool(more.group(1))):
            listed = True
    if letters:
        found |= {choices.canonical(_letter_index(m.group(1))) for m in IS_CORRECT.finditer(text)}
        if m := CLOSING.search(text[-8:]):
            found.add(choices.canonical(_letter_index(m.group(1))))
    return found, listed


def _foreign_label(rest: str, index: int, choices: Choices) -> bool:
    """Whether ``rest`` labels another option: with options, a label followed by that
    option's text ("... B. right"); without, any label."""
    for m in LABEL.finditer(rest):
        other = _letter_index(m.group(1) or m.group(2))
        if choices.same(other, index):
            continue
        if not choices.texts:
            return True
        if other < len(choices) and choices.leading(rest[m.end() :].lstrip()) == choices.canonical(other):
            return True
    return False


def _lead(index: int, rest: str, choices: Choices) -> int | None:
    """The letter ``index`` that leads an answer, or None when ``rest``, what follows
    it, contradicts it: another option's text, a list, another label or statement."""
    rest = rest.strip(" \n")
    if not rest:
        return index
    named = choices.named(rest)
    if named is not None:
        return index if choices.same(named, index) else None
    if (m := LONE.fullmatch(rest) or LIST_START.match(rest)) and not choices.same(_letter_index(m.group(1)), index):
        return None
    if index < len(choices) and choices.keys[index]:  # its own text may hold anything ("J.D. Salinger")
        own, low = _clean(choices.texts[index]).lower(), rest.lower()
        at = low.find(own) if len(low) == len(rest) else -1
        rest = rest if at < 0 else rest[:at] + " " + rest[at + len(own) :]
    if _foreign_label(rest, index, choices):
        return None
    stated, listed = _stated(rest, choices)
    if listed or any(not choices.same(s, index) for s in stated):
        return None
    return index


def _denied(index: int, rest: str, choices: Choices) -> bool:
    """Whether ``rest``, what follows a leading letter ``index`` (and perhaps its
    option's text), denies it: "A is incorrect", "D) down is wrong"."""
    rest = rest.lstrip(" \n")
    if index < len(choices) and choices.keys[index]:
        own, low = _clean(choices.texts[index]).lower(), rest.lower()
        if len(low) == len(rest) and low.startswith(own):
            rest = rest[len(own) :]
    return DENIED.match(rest) is not None


def _opening_option(text: str, choices: Choices) -> tuple[int, str] | None:
    """(the option, the rest) when the answer opens with the whole text of an option
    that itself looks labelled ("B:maj7/1 is the chord" among "B:maj7/1", "A#:hdim7")."""
    low, best = text.casefold(), None
    if len(low) != len(text):
        return None
    for i, option in enumerate(choices.texts):
        own = _clean(option).casefold()
        whole = own and low.startswith(own) and (len(low) == len(own) or not low[len(own)].isalnum())
        if whole and LEAD.match(_clean(option)) and (best is None or len(own) > len(best[1])):
            best = (i, own)
    return None if best is None else (best[0], text[len(best[1]) :])


def _choice_index(text: str, choices: Choices) -> int | None:
    """The option ``text`` (cleaned) names, as an index, or None (rules 1-4)."""
    if m := LONE.fullmatch(text):
        if m.group(1).islower() and m.group(1) in choices.texts:
            return choices.texts.index(m.group(1))  # the option "a" ("which word is unstressed?")
        return _letter_index(m.group(1))
    if m := SHORT.fullmatch(text):
        return _letter_index(m.group(1))
    named = choices.named(text)
    if named is not None:
        return named
    if m := LEAD.match(text):
        opening = _opening_option(text, choices)
        letter = m.group(1) or m.group(2) or m.group(3) or m.group(4)
        index, rest = opening or (_letter_index(letter), text[m.end() :])
        if index < (len(choices) or len(LETTERS)):
            if opening is None and m.group(4):  # "C (up)": the brackets hold its option's text
                named = choices.named(rest)
                if named is not None and choices.same(named, index):
                    return index
            elif not _denied(index, rest, choices):
                return _lead(index, rest, choices)
    # no leading letter, or one denied ("A is incorrect; the answer is B")
    stated, listed = _stated(text, choices)
    return stated.pop() if len(stated) == 1 and not listed else None


def parse_choice(prediction: str, options: list[str] | None = None) -> str | None:
    """The single option letter a prediction names, or None (the rules are in the
    module's docstring). A letter beyond the options is no answer."""
    choices = Choices.of(options)
    index = _choice_index(_clean(prediction), choices)
    return LETTERS[index] if index is not None and index < (len(choices) or len(LETTERS)) else None


def gold_letter(target: Target) -> str:
    """The gold answer as a letter: given as a letter, or as an option's text (a lone
    capital is read as a letter first, even among options such as "C", "D", "G")."""
    answer = str(target.answer).strip()
    letter = parse_choice(answer, target.options) if answer else None
    if letter is None:
        raise ValueError(f"multiple_choice answer {answer!r} is not an option letter or an option's text")
    return letter


def _validate_choice(target: Target) -> None:
    count = len(target.options or [])
    if count > len(LETTERS):
        raise ValueError(
            f"multiple_choice reads the option letters A to {LETTERS[-1]}: {count} options are more than {len(LETTERS)}"
        )
    gold_letter(target)


@register(
    "multiple_choice",
    aliases=("multiple-choice", "mcq", "choice"),
    fits=lambda p, target: parse_choice(p, target.options) is not None,
    validate=_validate_choice,
)
def multiple_choice(prediction: str, target: Target) -> tuple[float, dict]:
    """Right when the answer names the gold option, by its letter or its text (or
    another option with the same text)."""
    letter = parse_choice(prediction, target.options)
    gold = gold_letter(target)
    right = letter is not None and Choices.of(target.options).same(_letter_index(letter), _letter_index(gold))
    return float(right), {"predicted": letter, "gold": gold}


# ------------------------------------------------------------------- choice_text


def _gold_index(target: Target, choices: Choices) -> int:
    """The gold option of a text-scored row: the answer as an option's text, else as a
    letter."""
    if not choices.texts:
        raise ValueError("this problem type needs the row's options")
    named = choices.named(str(target.answer))
    if named is not None:
        return named
    index = _letter_index(gold_letter(target))
    return index


def gold_text(target: Target) -> str:
    """The gold option's text: the answer given as an option's text or as a letter."""
    choices = Choices.of(target.options)
    return choices.texts[_gold_index(target, choices)]


def parse_choice_text(prediction: str, options: list[str]) -> str | None:
    """The option a prediction names by its text, or None: the text alone, the text
    after its own label ("B. Woman"; another option's label is a contradiction), or
    the text after an answer phrase ("The answer is Woman."; not "The answer is Man or
    Woman."). A letter alone is not an answer."""
    choices = Choices.of(options)
    text = _clean(prediction)
    index = choices.named(text)
    if index is None and (m := LEAD.match(text)) and (m.group(1) or m.group(2)):
        label, named = _letter_index(m.group(1) or m.group(2)), choices.named(text[m.end() :])
        index = named if named is not None and choices.same(named, label) else None
    if index is None and not LONE.fullmatch(text):
        stated, listed = _stated(text, choices, letters=False)
        index = stated.pop() if len(stated) == 1 and not listed else None
    return None if index is None else choices.texts[index]


def _validate_text(target: Target) -> None:
    gold_text(target)


@register("choice_text", fits=lambda p, _: bool(p.strip()), validate=_validate_text)
def choice_text(prediction: str, target: Target) -> tuple[float, dict]:
    """Right when the answer is the gold option's text (case, punctuation and spacing
    aside; see ``parse_choice_text``); a letter is not an answer here."""
    predicted = parse_choice_text(prediction, target.options)
    gold = gold_text(target)
    return float(predicted is not None and _key(predicted) == _key(gold)), {"predicted": predicted, "gold": gold}


# ------------------------------------------------------------------ choice_words

WORDS = re.compile(r"\w+")


def _words(text: str) -> set[str]:
    return set(WORDS.findall(str(text).lower()))


def parse_choice_words(prediction: str, options: list[str]) -> str | None:
    """The first option that MMAU's official scorer (``evaluation.py``, Sakshi113/MMAU)
    would match: the answer's words hold all of the option's words and none of the
    words that only the other options have (options with the same words are one
    option). None when the answer has no words or matches no option."""
    said = _words(prediction)
    if not said:
        return None
    texts = option_texts(options)
    words = [_words(t) for t in texts]
    for i, own in enumerate(words):
        others = set().union(*(w for w in words if w != own)) - own
        if own <= said and not said & others:
            return texts[i]
    return None


@register("choice_words", fits=lambda p, _: bool(p.strip()), validate=_validate_text)
def choice_words(prediction: str, target: Target) -> tuple[float, dict]:
    """MMAU's official rule: right when the answer holds every word of the gold option
    and none of the words only the other options have ("B. Woman" and "the speaker
    is a woman" are right for gold Woman among Man, Woman, Child; "B" is not)."""
    predicted = parse_choice_words(prediction, target.options)
    gold = gold_text(target)
    return float(predicted is not None and _words(predicted) == _words(gold)), {"predicted": predicted, "gold": gold}


# ----------------------------------------------------------------------- boolean

TRUE = {"yes", "y", "true", "t", "1", "correct", "right", "yeah", "yep", "affirmative", "是", "对"}
FALSE = {"no", "n", "false", "f", "0", "incorrect", "wrong", "nope", "negative", "否", "不是", "错"}


STRONG = {"yes": True, "true": True, "no": False, "false": False}
# two answers joined: "yes or no", "true and false"
JOINED = re.compile(r"\b(yes|no|true|false) (?:and|or|nor|but|then) (yes|no|true|false)\b")
# a leading "no" that is no answer: "no idea", "No clue.", "no way to tell"
NO_HEDGE = re.compile(r"no (?:idea|clue|way (?:to|of)|one knows|comment)\b")
# an answer label, read after punctuation is dropped: "Correct answer: no", "The answer
# is yes", "Final answer: false" ("correct" there names the answer, it does not affirm)
ANSWER_LABEL = re.compile(r"(?:(?:the|my) )?(?:(?:correct|final|best|right) )?answer(?: is)?(?: |$)")


def _both(norm: str) -> bool:
    """Whether ``norm`` (normalized) answers both ways: the two joined ("yes or no") or
    alone ("Yes/No"); not a clause after a leading answer ("No, that's not true",
    "Yes, there is no doubt")."""
    words = norm.split()
    if words and all(w in STRONG for w in words):
        return len({STRONG[w] for w in words}) > 1
    return any(STRONG[m.group(1)] != STRONG[m.group(2)] for m in JOINED.finditer(norm))


def parse_bool(text) -> bool | None:
    """yes/no, true/false, 1/0 and their common forms, alone or leading a sentence
    ("Yes, it is.", "No, that's not true."), or after an answer label ("Correct answer:
    no"); a hedge naming both ("yes and no", "Yes/No") or opening with "no" ("no
    idea") is no answer."""
    if isinstance(text, bool):
        return text
    norm = normalize_text(str(text))
    if label := ANSWER_LABEL.match(norm):
        norm = norm[label.end() :]
    if norm in TRUE:
        return True
    if norm in FALSE:
        return False
    if _both(norm) or NO_HEDGE.match(norm):
        return None
    first = norm.split(" ", 1)[0] if norm else ""
    if first in TRUE - {"1", "t", "y"}:
        return True
    if first in FALSE - {"0", "f", "n"}:
        return False
    return None


def _validate_bool(target: Target) -> None:
    if parse_bool(target.answer) is None:
        raise ValueError(f"boolean answer {target.answer!r} is not yes/no or true/false")


@register(
    "boolean",
    aliases=("yes_no", "bool", "true_false"),
    fits=lambda p, _: parse_bool(p) is not None,
    validate=_validate_bool,
)
def boolean(prediction: str, target: Target) -> tuple[float, dict]:
    predicted = parse_bool(prediction)
    gold = parse_bool(target.answer)
    return float(predicted is not None and predicted == gold), {"predicted": predicted}
