"""The vocabulary of synthetic tasks: a table of pipeline stages and the grammar that chains them.

A synthetic program is a pipeline of 1-4 stages. Each stage is one `Op`: a Python expression over the
previous value `{v}` with integer or character constants, two English wordings of the step, and the
realistic novice mistakes it admits as alternative expressions (an off-by-one, a wrong comparison);
a wrong constant and a missing step are derived from its constants and its place in the pipeline.
Values flow through five types:

    ints   list[int]     filters, maps, reorders, slices, then reducers to an int
    nat    int (input)   a non-negative number turned into a list of ints by a source
    text   str           case and character transforms, then measures to an int, or split into words
    words  list[str]     word filters and maps, then a join back to a string or a count
    int    int           a finished result

`structures()` enumerates every valid stage sequence; validity is the type chain, a phase order
(source, list body, list tail, words, finisher) and a few static rules that drop stages which could
never change the result (sorting before a sum, `abs` of squares). Constant choices that make a stage
moot on every input (doubling, then keeping the even numbers) are not ruled out here: the generator
detects them and records them as redundant stages.

This module holds data and the grammar only; it neither picks programs (synthetic_index.py) nor renders
files and chooses tests (synthetic.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ANNOTATION = {"ints": "list[int]", "nat": "int", "text": "str", "words": "list[str]", "int": "int"}
INPUT_TYPES = ("ints", "nat", "text")
PARAMETER_NAMES = {"ints": ("values", "numbers", "nums"), "nat": ("n", "num", "value"),
                   "text": ("text", "s", "line")}
INPUT_DESCRIPTION = {"ints": "a list of integers", "nat": "a non-negative integer", "text": "a string"}
RESULT_DESCRIPTION = {"ints": "list of integers", "words": "list of words", "text": "string", "int": "number"}
NAME_STYLES = ("{}", "get_{}", "compute_{}")
LAYOUTS = ("steps", "prose")
SEQUENCE_TYPES = {"ints", "text", "words"}

# At most this many stages of each phase, in this order, make one program.
PHASE_LIMITS = {"source": 1, "body": 2, "tail": 1, "split": 1, "words": 2, "finish": 1}
PHASE_ORDER = {phase: i for i, phase in enumerate(PHASE_LIMITS)}
MAX_DEPTH = 4


@dataclass(frozen=True)
class Op:
    key: str
    """kind:name, the unit of program structure ("filter:gt")."""
    phase: str
    takes: str
    gives: str
    code: str
    """Expression template: {v} is the input value, {k} etc. the constants, {k_plus} a constant plus one."""
    phrases: tuple[str, str]
    """Two wordings of the step; {k} renders a constant, {p} the function's parameter."""
    word: str
    """Its part of a function name."""
    params: tuple[tuple[str, tuple[int | str, ...]], ...] = ()
    off_by_one: str | None = None
    """The stage written with a novice's off-by-one (`>=` for `>`, one element too many)."""
    wrong_comparison: str | None = None
    """The stage written with the comparison (or min/max) the wrong way round."""
    missing_step: str | None = None
    """Half the stage, for stages that cannot simply be left out (a count that forgot to de-duplicate)."""
    wrong_constant: str | None = None
    """A wrong built-in constant, for stages without constants of their own (`split(" ")`)."""
    groups: tuple[str, ...] = ()
    """A program holds at most one op of each group (two thresholds or two case changes would clash)."""
    reorders: bool = False
    """Changes only the order of elements: moot unless something after it sees order."""
    sees_order: bool = False
    """Its result depends on the order of its input (a slice, a join, the first letter of words)."""
    ignores_duplicates: bool = False
    """A finisher whose result cannot change when repeated numbers are removed."""
    value_blind: bool = False
    """Works on positions or whitespace only (slices, reorders, split)."""
    blind_to: tuple[str, ...] = ()
    """Keys of stages this finisher cannot see when only value-blind stages lie between (a count after
    a map)."""
    sign: str = "keep"
    """What the stage does to the signs of the numbers: a key of SIGN_AFTER."""
    moot_on: tuple[str, ...] = ()
    """Signs of the input on which the stage changes nothing or keeps nothing."""
    removes_spaces: bool = False
    """Leaves one word: splitting after it is moot."""
    merges_values: bool = False
    """May turn different numbers into equal ones (so removing duplicates after it can matter)."""
    distinct_values: bool = False
    """A source whose numbers never repeat."""
    fixed_start: bool = False
    """A source whose first and smallest number is always the same."""

    @property
    def constant_combinations(self) -> int:
        return functools.reduce(lambda n, p: n * len(p[1]), self.params, 1)


def _range(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(range(lo, hi + 1))


LETTERS = ("d", "l", "n", "r", "s", "t")  # consonants: vowel removal cannot make them moot
WORD_STARTS = ("a", "b", "c", "d", "s", "t")
SYMBOLS = ("*", "-", "_", "!")
SEPARATORS = (" ", "-", ",", "", "_")
VOWELS = '"aeiou"'
# Stages that change values (or letters) but never how many there are, their lengths or the whitespace.
VALUE_MAPS = ("map:add", "map:sub", "map:mul", "map:square", "map:negate", "map:abs", "map:floordiv",
              "map:cap", "map:raise", "text:upper", "text:lower", "text:swapcase", "text:replace",
              "words:upper", "words:capitalize", "words:reverse_each")

_LIST_FILTER = "[x for x in {v} if %s]"
_LIST_MAP = "[%s for x in {v}]"
_WORD_FILTER = "[w for w in {v} if %s]"
_WORD_MAP = "[%s for w in {v}]"

OPS: tuple[Op, ...] = (
    # nat -> ints
    Op("source:range1", "source", "nat", "ints", "list(range(1, {v} + 1))",
       ("make the list of the whole numbers from 1 to {p}, inclusive",
        "start from the numbers 1, 2, ..., {p} (an empty list when {p} is 0)"),
       "one_to_n", off_by_one="list(range(1, {v}))", fixed_start=True, distinct_values=True, sign="pos"),
    Op("source:range0", "source", "nat", "ints", "list(range({v}))",
       ("make the list of the whole numbers from 0 up to but not including {p}",
        "start from the numbers 0, 1, ..., {p} - 1"),
       "below_n", off_by_one="list(range({v} + 1))", fixed_start=True, distinct_values=True, sign="nonneg"),
    Op("source:digits", "source", "nat", "ints", "[int(d) for d in str({v})]",
       ("make the list of the decimal digits of {p}, from left to right",
        "split {p} into its digits, most significant first"),
       "digits", sign="nonneg", off_by_one="[int(d) for d in str({v})[1:]]"),
    Op("source:divisors", "source", "nat", "ints", "[d for d in range(1, {v} + 1) if {v} % d == 0]",
       ("make the list of the positive divisors of {p}, in increasing order",
        "start from every d in 1, 2, ..., {p} that divides {p} exactly"),
       "divisors", off_by_one="[d for d in range(1, {v}) if {v} % d == 0]", fixed_start=True,
       distinct_values=True, sign="pos"),
    # ints -> ints: filters
    Op("filter:gt", "body", "ints", "ints", _LIST_FILTER % "x > {k}",
       ("keep only the numbers greater than {k}", "remove every number that is {k} or less"),
       "above", (("k", _range(1, 9)),), _LIST_FILTER % "x >= {k}", _LIST_FILTER % "x < {k}",
       groups=("threshold",), sign="pos", moot_on=("nonpos", "neg")),
    Op("filter:lt", "body", "ints", "ints", _LIST_FILTER % "x < {k}",
       ("keep only the numbers less than {k}", "remove every number that is {k} or more"),
       "below", (("k", _range(2, 12)),), _LIST_FILTER % "x <= {k}", _LIST_FILTER % "x > {k}",
       groups=("threshold",), moot_on=("nonpos", "neg")),
    Op("filter:between", "body", "ints", "ints", _LIST_FILTER % "{lo} <= x <= {hi}",
       ("keep only the numbers from {lo} to {hi}, both included",
        "keep the numbers that are at least {lo} and at most {hi}"),
       "in_range", (("lo", _range(-3, 3)), ("hi", _range(7, 14))), _LIST_FILTER % "{lo} < x <= {hi}",
       groups=("threshold",), moot_on=("neg", "nonpos")),
    Op("filter:positive", "body", "ints", "ints", _LIST_FILTER % "x > 0",
       ("keep only the positive numbers", "remove every number that is zero or negative"),
       "positives", off_by_one=_LIST_FILTER % "x >= 0", wrong_comparison=_LIST_FILTER % "x < 0",
       groups=("threshold",), sign="pos", moot_on=("pos", "nonpos", "neg")),
    Op("filter:negative", "body", "ints", "ints", _LIST_FILTER % "x < 0",
       ("keep only the negative numbers", "remove every number that is zero or positive"),
       "negatives", off_by_one=_LIST_FILTER % "x <= 0", wrong_comparison=_LIST_FILTER % "x > 0",
       groups=("threshold",), sign="neg", moot_on=("nonneg", "pos", "neg")),
    Op("filter:even", "body", "ints", "ints", _LIST_FILTER % "x % 2 == 0",
       ("keep only the even numbers", "remove every odd number"),
       "evens", wrong_comparison=_LIST_FILTER % "x % 2 != 0", groups=("parity",)),
    Op("filter:odd", "body", "ints", "ints", _LIST_FILTER % "x % 2 != 0",
       ("keep only the odd numbers", "remove every even number"),
       "odds", wrong_comparison=_LIST_FILTER % "x % 2 == 0", groups=("parity",)),
    Op("filter:divisible", "body", "ints", "ints", _LIST_FILTER % "x % {k} == 0",
       ("keep only the numbers divisible by {k}", "keep only the multiples of {k}"),
       "multiples", (("k", _range(3, 5)),), wrong_comparison=_LIST_FILTER % "x % {k} != 0",
       groups=("parity",)),
    Op("filter:not_divisible", "body", "ints", "ints", _LIST_FILTER % "x % {k} != 0",
       ("remove the numbers divisible by {k}", "keep only the numbers that are not multiples of {k}"),
       "non_multiples", (("k", _range(3, 7)),), wrong_comparison=_LIST_FILTER % "x % {k} == 0",
       groups=("parity",)),
    Op("filter:nonzero", "body", "ints", "ints", _LIST_FILTER % "x != 0",
       ("remove every zero", "keep only the numbers that are not 0"),
       "nonzero", wrong_comparison=_LIST_FILTER % "x == 0", sign="nonzero", moot_on=("pos", "neg")),
    # ints -> ints: maps
    Op("map:add", "body", "ints", "ints", _LIST_MAP % "x + {k}",
       ("add {k} to each number", "increase every number by {k}"), "shifted", (("k", _range(1, 9)),),
       groups=("shift",), sign="up"),
    Op("map:sub", "body", "ints", "ints", _LIST_MAP % "x - {k}",
       ("subtract {k} from each number", "decrease every number by {k}"), "lowered", (("k", _range(1, 9)),),
       groups=("shift",), sign="down"),
    Op("map:mul", "body", "ints", "ints", _LIST_MAP % "x * {k}",
       ("multiply each number by {k}", "scale every number by a factor of {k}"), "scaled",
       (("k", _range(2, 5)),)),
    Op("map:square", "body", "ints", "ints", _LIST_MAP % "x * x",
       ("square each number", "replace every number by its square"), "squares", sign="nonneg",
       merges_values=True),
    Op("map:negate", "body", "ints", "ints", _LIST_MAP % "-x",
       ("negate each number", "flip the sign of every number"), "negated", sign="flip"),
    Op("map:abs", "body", "ints", "ints", _LIST_MAP % "abs(x)",
       ("replace each number by its absolute value", "drop the sign of every number"), "absolute",
       sign="nonneg", moot_on=("pos", "nonneg"), merges_values=True),
    Op("map:floordiv", "body", "ints", "ints", _LIST_MAP % "x // {k}",
       ("divide each number by {k}, rounding down", "replace every number x by x // {k} (floor division)"),
       "divided", (("k", _range(2, 5)),), sign="floor", merges_values=True),
    Op("map:cap", "body", "ints", "ints", _LIST_MAP % "min(x, {k})",
       ("replace every number greater than {k} by {k}", "cap every number at {k}"),
       "capped", (("k", _range(1, 10)),), wrong_comparison=_LIST_MAP % "max(x, {k})", groups=("threshold",),
       merges_values=True),
    Op("map:raise", "body", "ints", "ints", _LIST_MAP % "max(x, {k})",
       ("replace every number less than {k} by {k}", "raise every number below {k} up to {k}"),
       "raised", (("k", _range(0, 6)),), wrong_comparison=_LIST_MAP % "min(x, {k})",
       groups=("threshold",), sign="nonneg", merges_values=True),
    # ints -> ints: reorders and slices
    Op("order:ascending", "tail", "ints", "ints", "sorted({v})",
       ("sort the numbers in ascending order", "arrange the numbers from smallest to largest"),
       "ascending", wrong_comparison="sorted({v}, reverse=True)", reorders=True, value_blind=True),
    Op("order:descending", "tail", "ints", "ints", "sorted({v}, reverse=True)",
       ("sort the numbers in descending order", "arrange the numbers from largest to smallest"),
       "descending", wrong_comparison="sorted({v})", reorders=True, value_blind=True),
    Op("order:reverse", "tail", "ints", "ints", "{v}[::-1]",
       ("reverse the order of the numbers", "put the numbers in reverse order"), "backwards", reorders=True,
       value_blind=True),
    Op("slice:take", "tail", "ints", "ints", "{v}[:{k}]",
       ("keep only the first {k} numbers", "take the first {k} numbers (all of them if there are fewer)"),
       "head", (("k", _range(2, 5)),), off_by_one="{v}[:{k_plus}]", sees_order=True, value_blind=True),
    Op("slice:drop", "tail", "ints", "ints", "{v}[{k}:]",
       ("drop the first {k} numbers", "skip the first {k} numbers and keep the rest"),
       "tail", (("k", _range(2, 4)),), off_by_one="{v}[{k_plus}:]", sees_order=True, value_blind=True),
    Op("slice:take_last", "tail", "ints", "ints", "{v}[-{k}:]",
       ("keep only the last {k} numbers", "take the last {k} numbers (all of them if there are fewer)"),
       "last_few", (("k", _range(2, 5)),), off_by_one="{v}[-{k_plus}:]", sees_order=True,
       value_blind=True),
    Op("slice:every_other", "tail", "ints", "ints", "{v}[::2]",
       ("keep every second number, starting with the first",
        "keep the numbers at positions 0, 2, 4, and so on"),
       "alternate", off_by_one="{v}[1::2]", sees_order=True, value_blind=True),
    Op("slice:unique", "tail", "ints", "ints", "list(dict.fromkeys({v}))",
       ("remove repeated numbers, keeping the first occurrence of each",
        "drop duplicates, keeping the numbers in the order they first appear"), "unique"),
    # ints -> int
    Op("reduce:sum", "finish", "ints", "int", "sum({v})",
       ("compute the sum of the numbers", "add up the numbers"), "total", off_by_one="sum({v}[1:])"),
    Op("reduce:count", "finish", "ints", "int", "len({v})",
       ("count the numbers", "compute how many numbers there are"), "count",
       blind_to=VALUE_MAPS, off_by_one="len({v}) - 1"),
    Op("reduce:max", "finish", "ints", "int", "max({v}, default=0)",
       ("find the largest number (0 if there are none)", "take the maximum of the numbers, or 0 for none"),
       "largest", wrong_comparison="min({v}, default=0)", ignores_duplicates=True),
    Op("reduce:min", "finish", "ints", "int", "min({v}, default=0)",
       ("find the smallest number (0 if there are none)", "take the minimum of the numbers, or 0 for none"),
       "smallest", wrong_comparison="max({v}, default=0)", ignores_duplicates=True),
    Op("reduce:distinct", "finish", "ints", "int", "len(set({v}))",
       ("count how many different values there are", "compute the number of distinct numbers"),
       "distinct_count", ignores_duplicates=True,
       blind_to=("map:add", "map:sub", "map:mul", "map:negate"),
       missing_step="len({v})"),
    Op("reduce:last", "finish", "ints", "int", "{v}[-1] if {v} else 0",
       ("take the last number (0 if there are none)", "take the number at the end, or 0 for none"),
       "last", off_by_one="{v}[-2] if {v} else 0", sees_order=True, ignores_duplicates=True),
    Op("reduce:spread", "finish", "ints", "int", "max({v}, default=0) - min({v}, default=0)",
       ("compute the largest number minus the smallest (0 if there are none)",
        "compute the spread: maximum minus minimum, or 0 for no numbers"),
       "spread", ignores_duplicates=True,
       blind_to=("map:add", "map:sub", "map:negate"),
       wrong_comparison="min({v}, default=0) - max({v}, default=0)"),
    Op("reduce:first", "finish", "ints", "int", "{v}[0] if {v} else 0",
       ("take the first number (0 if there are none)", "take the number at position 0, or 0 for none"),
       "first", off_by_one="{v}[1] if {v} else 0", sees_order=True, ignores_duplicates=True),
    # text -> text
    Op("text:upper", "body", "text", "text", "{v}.upper()",
       ("convert the text to upper case", "make every letter uppercase"), "uppercased", groups=("case",)),
    Op("text:lower", "body", "text", "text", "{v}.lower()",
       ("convert the text to lower case", "make every letter lowercase"), "lowercased", groups=("case",)),
    Op("text:swapcase", "body", "text", "text", "{v}.swapcase()",
       ("swap the case of every letter", "turn uppercase letters lowercase and lowercase letters uppercase"),
       "swapped", groups=("case",)),
    Op("text:reverse", "body", "text", "text", "{v}[::-1]",
       ("reverse the text", "write the characters in reverse order"), "mirrored", reorders=True,
       groups=("reorder",), value_blind=True),
    Op("text:remove", "body", "text", "text", '{v}.replace({c}, "")',
       ("remove every {c}", "delete each occurrence of the character {c}"),
       "without_char", (("c", LETTERS),), groups=("char", "case")),
    Op("text:replace", "body", "text", "text", "{v}.replace({a}, {b})",
       ("replace every {a} with {b}", "change each occurrence of {a} into {b}"),
       "replaced", (("a", LETTERS), ("b", SYMBOLS)), groups=("char", "case")),
    Op("text:prefix", "body", "text", "text", "{v}[:{k}]",
       ("keep only the first {k} characters", "cut the text after its first {k} characters"),
       "prefix", (("k", _range(5, 12)),), off_by_one="{v}[:{k_plus}]", sees_order=True, value_blind=True),
    Op("text:letters", "body", "text", "text", '"".join(ch for ch in {v} if ch.isalpha())',
       ("keep only the letters", "remove every character that is not a letter"),
       "letters_only", groups=("charclass",), removes_spaces=True),
    Op("text:digits", "body", "text", "text", '"".join(ch for ch in {v} if ch.isdigit())',
       ("keep only the digits", "remove every character that is not a digit"),
       "digits_only", groups=("charclass", "case", "vowel", "char"), removes_spaces=True),
    Op("text:no_vowels", "body", "text", "text", '"".join(ch for ch in {v} if ch not in "aeiouAEIOU")',
       ("remove every vowel (a, e, i, o, u, in either case)", "delete the vowels, uppercase or lowercase"),
       "no_vowels", groups=("vowel",)),
    # text -> int
    Op("measure:length", "finish", "text", "int", "len({v})",
       ("count the characters", "compute the length of the text"), "length",
       blind_to=VALUE_MAPS, off_by_one="len({v}) - 1"),
    Op("measure:count_char", "finish", "text", "int", "{v}.count({c})",
       ("count how many times {c} appears", "compute the number of occurrences of {c}"),
       "char_count", (("c", LETTERS),), groups=("char", "case"),
       blind_to=("text:no_vowels", "text:letters")),
    Op("measure:vowels", "finish", "text", "int", f"sum(1 for ch in {{v}} if ch in {VOWELS})",
       ("count the lowercase vowels (a, e, i, o, u)", "compute how many characters are one of a, e, i, o, u"),
       "vowel_count", groups=("case", "vowel"),
       blind_to=("text:remove", "text:replace", "text:letters"),
       wrong_constant='sum(1 for ch in {v} if ch in "aeio")'),
    Op("measure:upper", "finish", "text", "int", "sum(1 for ch in {v} if ch.isupper())",
       ("count the uppercase letters", "compute how many characters are uppercase letters"),
       "upper_count", groups=("case",),
       blind_to=("text:letters",),
       wrong_comparison="sum(1 for ch in {v} if ch.islower())"),
    Op("measure:digits", "finish", "text", "int", "sum(1 for ch in {v} if ch.isdigit())",
       ("count the digits", "compute how many characters are digits"),
       "digit_count", groups=("charclass",), blind_to=(*VALUE_MAPS, "text:no_vowels", "text:remove"),
       wrong_comparison="sum(1 for ch in {v} if ch.isalnum())"),
    # text -> words
    Op("split:words", "split", "text", "words", "{v}.split()",
       ("split the text into words (separated by whitespace)",
        "break the text into its whitespace-separated words"),
       "words", value_blind=True, wrong_constant='{v}.split(" ")'),
    # words -> words
    Op("words:longer", "words", "words", "words", _WORD_FILTER % "len(w) > {k}",
       ("keep only the words longer than {k} characters", "remove every word with {k} or fewer characters"),
       "long_words", (("k", _range(3, 6)),), _WORD_FILTER % "len(w) >= {k}", _WORD_FILTER % "len(w) < {k}",
       groups=("length",)),
    Op("words:shorter", "words", "words", "words", _WORD_FILTER % "len(w) < {k}",
       ("keep only the words shorter than {k} characters", "remove every word with {k} or more characters"),
       "short_words", (("k", _range(3, 5)),), _WORD_FILTER % "len(w) <= {k}", _WORD_FILTER % "len(w) > {k}",
       groups=("length",)),
    Op("words:startswith", "words", "words", "words", _WORD_FILTER % "w.startswith({c})",
       ("keep only the words that start with {c}", "remove every word that does not begin with {c}"),
       "words_starting", (("c", WORD_STARTS),), sees_order=True, groups=("char", "case")),
    Op("words:upper", "words", "words", "words", _WORD_MAP % "w.upper()",
       ("convert each word to upper case", "make every word uppercase"), "loud_words", groups=("case",)),
    Op("words:capitalize", "words", "words", "words", _WORD_MAP % "w.capitalize()",
       ("capitalize each word (first letter uppercase, the rest lowercase)",
        "make the first letter of every word uppercase and the rest lowercase"),
       "capitalized", sees_order=True, groups=("case",)),
    Op("words:reverse_each", "words", "words", "words", _WORD_MAP % "w[::-1]",
       ("reverse each word", "write every word backwards"), "reversed_words", sees_order=True),
    Op("words:sort", "words", "words", "words", "sorted({v})",
       ("sort the words alphabetically (uppercase letters come before lowercase ones)",
        "arrange the words in Python's default string order"),
       "sorted_words", wrong_comparison="sorted({v}, reverse=True)", reorders=True, groups=("reorder",),
       value_blind=True),
    Op("words:reverse", "words", "words", "words", "{v}[::-1]",
       ("reverse the order of the words", "put the words in reverse order"), "words_backwards", reorders=True,
       groups=("reorder",), value_blind=True),
    Op("words:take", "words", "words", "words", "{v}[:{k}]",
       ("keep only the first {k} words", "take the first {k} words (all of them if there are fewer)"),
       "first_words", (("k", _range(2, 4)),), off_by_one="{v}[:{k_plus}]", sees_order=True,
       value_blind=True),
    # words -> text / int
    Op("join:words", "finish", "words", "text", "{sep}.join({v})",
       ("join the words into one string with {sep} between them",
        "glue the words together, separated by {sep}"),
       "joined", (("sep", SEPARATORS),), sees_order=True),
    Op("count:words", "finish", "words", "int", "len({v})",
       ("count the words", "compute how many words there are"), "word_count",
       blind_to=(*VALUE_MAPS, "text:remove", "text:no_vowels"),
       off_by_one="len({v}) - 1"),
    Op("count:letters", "finish", "words", "int", "sum(len(w) for w in {v})",
       ("compute the total number of characters in the words", "add up the lengths of the words"),
       "letter_total", blind_to=VALUE_MAPS, off_by_one="sum(len(w) for w in {v}) - 1"),
    Op("count:longest", "finish", "words", "int", "max((len(w) for w in {v}), default=0)",
       ("find the length of the longest word (0 if there are none)",
        "compute the largest word length, or 0 for no words"),
       "longest_word", wrong_comparison="min((len(w) for w in {v}), default=0)",
       ignores_duplicates=True, groups=("length",), blind_to=VALUE_MAPS),
)
assert len({op.key for op in OPS}) == len(OPS), "op keys must be unique"


# What is known about the signs of the numbers ('any', 'pos', 'nonneg', 'neg', 'nonpos') after a stage.
SIGN_AFTER: dict[str, dict[str, str]] = {
    "keep": {s: s for s in ("any", "pos", "nonneg", "neg", "nonpos")},
    "pos": {s: "pos" for s in ("any", "pos", "nonneg", "neg", "nonpos")},
    "neg": {s: "neg" for s in ("any", "pos", "nonneg", "neg", "nonpos")},
    "nonneg": {"any": "nonneg", "pos": "nonneg", "nonneg": "nonneg", "neg": "nonneg", "nonpos": "nonneg"},
    "flip": {"any": "any", "pos": "neg", "nonneg": "nonpos", "neg": "pos", "nonpos": "nonneg"},
    "up": {"any": "any", "pos": "pos", "nonneg": "pos", "neg": "any", "nonpos": "any"},
    "down": {"any": "any", "pos": "any", "nonneg": "any", "neg": "neg", "nonpos": "neg"},
    "floor": {"any": "any", "pos": "nonneg", "nonneg": "nonneg", "neg": "neg", "nonpos": "nonpos"},
    "nonzero": {"any": "any", "pos": "pos", "nonneg": "pos", "neg": "neg", "nonpos": "neg"},
}


def is_valid(ops: tuple[Op, ...]) -> bool:
    """The static rules: at most one op of each group, and no stage that could never change the result."""
    groups = [g for op in ops for g in op.groups]
    if len(groups) != len(set(groups)) or len({op.key for op in ops}) != len(ops):
        return False
    if ops[0].fixed_start and len(ops) > 1 and ops[1].key in ("reduce:first", "reduce:min"):
        return False  # the first of range(n) is always 0
    finisher, sign = ops[-1], "any"
    for i, op in enumerate(ops):
        before, after = ops[:i], ops[i + 1:]
        if sign in op.moot_on:  # abs of squares, the negatives of a range
            return False
        sign = SIGN_AFTER[op.sign][sign]
        if after and op.key in finisher.blind_to and all(o.value_blind or o.key in finisher.blind_to
                                                         for o in after[:-1]):
            return False  # doubling, then counting
        if op.reorders and finisher.gives not in SEQUENCE_TYPES and not any(o.sees_order for o in after):
            return False  # sorting, then summing
        if op.key == "slice:unique" and ((after and after[0].ignores_duplicates) or (
                ops[0].distinct_values and not any(o.merges_values for o in before))):
            return False  # de-duplicating, then taking the maximum; or de-duplicating a range
        if op.removes_spaces and any(o.key == "split:words" for o in after):
            return False  # splitting text that has no spaces left
    return True


def _extend(prefix: tuple[Op, ...], value_type: str, phase_counts: dict[str, int], out: list) -> None:
    if prefix and is_valid(prefix):
        out.append(prefix)
    if len(prefix) == MAX_DEPTH:
        return
    last_phase = PHASE_ORDER[prefix[-1].phase] if prefix else -1
    for op in OPS:
        if op.takes != value_type or PHASE_ORDER[op.phase] < last_phase:
            continue
        if phase_counts.get(op.phase, 0) >= PHASE_LIMITS[op.phase]:
            continue
        counts = {**phase_counts, op.phase: phase_counts.get(op.phase, 0) + 1}
        _extend((*prefix, op), op.gives, counts, out)


@functools.cache
def structures() -> tuple[tuple[Op, ...], ...]:
    """Every valid program structure, in a fixed order (the order of OPS)."""
    out: list[tuple[Op, ...]] = []
    for input_type in INPUT_TYPES:
        _extend((), input_type, {}, out)
    return tuple(out)


def structure_name(ops: tuple[Op, ...]) -> str:
    return " -> ".join(op.key for op in ops)
