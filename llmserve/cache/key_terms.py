"""The lexical check a semantic-cache hit must pass beside the cosine threshold.

An embedding model scores "the capital of France" and "the capital of Germany" as near-identical
questions (cosine 0.9 and up), and "convert a string to an integer" against its reverse at 0.996.
No cosine threshold separates those from true paraphrases, so a candidate is accepted only when
both questions name the same things:

    key_terms(text): the content words of the text, lowercased, stemmed and mapped onto a small
    table of synonyms; words about the *form* of a question ("what", "how", "way", "command",
    "explain", ...) and function words are dropped. First, a few question idioms are put in one
    form ("what makes X" is "why X", "what year" is "when", "which artist painted" is "who
    painted", "how fast does X travel" is "the speed of X", "how many people live in X" is "the
    population of X"), and ordinals and Roman numerals become one token ("Second", "II": "#2").
    Beside the terms: the kind of answer asked for (who, when, where, why); the `targets`, the key
    term after each directional word ("convert miles to km" -> to: km; "faster than Java" -> than:
    java); and the numbers in the order they come, each with the key term after it ("10 divided
    by 2" is not "2 divided by 10", "10 km" is not "10 miles").
    same_question(a, b): all of those equal (targets where both have one; two synonyms in one text
    count twice), and at least one key term (a text with none, such as one in a script this
    table does not read, never matches).

English only; for other languages the check degrades to "the same words", which is stricter, not
looser. It errs towards misses: a paraphrase that swaps a content word for one the table does not
know is a miss. What it cannot see is word order beyond the directional words: "Who killed
Brutus?" and "Who did Brutus kill?" have the same key terms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Function words, and words that shape a question without naming its subject.
STOP_WORDS = frozenset("""
a an the of in on at to for from by with about into onto over under than then and or but as between
is are was were be been being am do does did doing done have has had having can could should would
will shall may might must i me my mine you your yours we our us they their them he she his her it
its this that these those there here what which who whom whose when where why how whats hows
way ways command commands steps step method syntax best simple explain define tell meaning mean
means please some any one ones much many go most used people number known call called city
happen happens happened
""".split())
# Each line: a canonical word, then words that mean the same in a question.
SYNONYMS = """
largest biggest
tallest highest
world earth
integer int
dictionary dict
javascript js
delete remove erase
exit quit
merge combine
show check find see display view
write wrote written author writer
start begin
clear clean
mac macos
directory folder
image picture
resize scale
open load
undo revert
last recent latest
length long
stand short
speak spoken
point temperature degree
convert turn change
autumn fall
distance far
stop halt
standard normal regular typical
substance material
"""
# Question idioms put in one form before the words are read: (pattern, replacement), in order.
IDIOMS = [(re.compile(p, re.IGNORECASE), r) for p, r in (
    (r"\bwhat (?:makes|made|causes|caused)\b", "why"),
    (r"\b(?:in )?(?:what|which) year\b", "when"),
    # only before a past-tense verb: "which artist painted X" asks who; "which painter is most
    # famous" is not "which composer is most famous"
    (r"\b(?:which|what) (?:artist|painter|person|scientist|author|writer|composer|inventor) "
     r"(?=(?:\w+ed|wrote|drew|built|made|found|sang|won|led|gave|took|became)\b)", "who "),
    # "why does the sky look blue" asks "why is the sky blue" (only after why: "what does a cat
    # look like" keeps its verb)
    (r"(\bwhy\b(?:\W+\w+){0,6}?\W+)(?:look|looks|appear|appears|seem|seems)\b", r"\1"),
    (r"\bhow fast (?:does|do|did|is|are|can) ((?:\w+ ){1,4}?)(?:travel|travels|go|move|run)\b", r"speed of \1"),
    (r"\bhow many people (?:live|lived|are living) (?:in|on)\b", "population of"),
)]
# Question words that name the kind of answer: "Who invented the telephone?" is not "When was the
# telephone invented?", though both have the key terms {invent, telephone}. (what, which and how
# ask for anything, and paraphrases trade them freely.)
ANSWER_KINDS = {"who": "who", "whom": "who", "whose": "who", "when": "when", "where": "where", "why": "why"}
# Ordinals and Roman numerals (II and up, not VI, the editor; "I" is told apart in _words) -> "#n".
ORDINALS = {w: f"#{n}" for n, words in enumerate((
    "first 1st", "second 2nd ii", "third 3rd iii", "fourth 4th iv", "fifth 5th", "sixth 6th",
    "seventh 7th vii", "eighth 8th viii", "ninth 9th ix", "tenth 10th"), start=1) for w in words.split()}
SUFFIXES = ("ing", "ers", "er", "ors", "or", "ed", "es", "s", "e")
VOWELS = re.compile("[aeiouy]")
DIRECTIONAL = ("to", "into", "than", "by", "from", "per", "versus", "vs")


def stem(word: str) -> str:
    """A light suffix stripper: "boiling"/"boil", "inventor"/"invented", "dictionaries"/"dictionary".
    What is left must have a vowel, so an acronym keeps its last letter ("https" is not "http")."""
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    for suffix in SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and VOWELS.search(word[: -len(suffix)]):
            return word[: -len(suffix)]
    return word


_CANONICAL = {stem(w): stem(line.split()[0]) for line in SYNONYMS.split("\n") if line for w in line.split()}


@dataclass(frozen=True, slots=True)
class KeyTerms:
    terms: tuple[str, ...]  # sorted; synonyms both count: "standard normal" is not "normal"
    targets: dict[str, str]  # directional word -> the key term after its last occurrence
    numbers: tuple[str, ...]  # in order, each with the key term after it: "10 km" -> "10 km"
    asks: frozenset[str]  # what kind of answer: who, when, where, why


def _words(text: str) -> list[str]:
    """Lowercased words, idioms rewritten; a capital "I" after a capitalised word inside a sentence
    is a numeral ("World War I"), and ordinals are "#n"."""
    text = text.replace("'s", "").replace("\u2019s", "")
    for pattern, replacement in IDIOMS:
        text = pattern.sub(replacement, text)
    out, numeral_may_follow, end = [], False, -1
    for m in re.finditer(r"[A-Za-z0-9]+", text):
        w = m.group()
        word = "#1" if w == "I" and numeral_may_follow else w.lower()
        out.append(ORDINALS.get(word, word))
        # "World War I", but not "Should I" or "Thanks. Can I": the word before the numeral is
        # capitalised and does not start a sentence
        starts_sentence = end < 0 or any(c in ".!?:;" for c in text[end : m.start()])
        numeral_may_follow, end = w[:1].isupper() and not starts_sentence, m.end()
    return out


def _term(word: str) -> str:
    s = stem(word)
    return _CANONICAL.get(s, s)


def key_terms(text: str) -> KeyTerms:
    """One pass backwards (linear in the text), so the next key term after each word is known."""
    words = _words(text)
    targets: dict[str, str] = {}
    numbers: list[str] = []  # last first
    following: str | None = None  # the next key term after position i
    for i in range(len(words) - 1, -1, -1):
        w = words[i]
        # "to" after a content word is directional ("string to integer"); after a stop word it
        # is an infinitive ("the way to sort")
        if w in DIRECTIONAL and i and words[i - 1] not in STOP_WORDS and following is not None:
            targets.setdefault(w, following)
        if w.isdigit():  # a number and the key term after it ("10 km")
            numbers.append(f"{w} {following}")
        if w not in STOP_WORDS:
            following = _term(w)
    # one term per distinct stem: a repeated word counts once, two synonyms count twice
    terms = tuple(sorted(_CANONICAL.get(s, s) for s in {stem(w) for w in words if w not in STOP_WORDS}))
    asks = frozenset(ANSWER_KINDS[w] for w in words if w in ANSWER_KINDS)
    return KeyTerms(terms, targets, tuple(reversed(numbers)), asks)


def same_question(a: KeyTerms, b: KeyTerms) -> bool:
    if not a.terms or a.terms != b.terms or a.numbers != b.numbers or a.asks != b.asks:
        return False
    return all(b.targets.get(word, target) == target for word, target in a.targets.items())
