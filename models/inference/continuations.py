"""Each decoded row's new tokens and text as decoding goes: where it ends (an end id, a
stop string, its length) and, for streaming, the part of its text that is final.

`Continuations.push` is the decoding loop's per-step callback (`Decoder.decode`'s and
`Decoder.generate`'s `on_step`): it records each row's token, decodes the row's text
when stop strings or streaming need it, and returns the rows a stop string ended, which
the loop then finishes like an end id. The compiled step is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from namedmesh.errors import ParameterError

REASONS = ("stop", "eos", "length")  # a row's finish_reason
REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a character not yet whole


def check_stops(stops: Sequence[str] | None, flag: str = "stop (--stop)") -> list[str]:
    """The stop strings as a list; ParameterError for one that is not a non-empty str,
    or for `stops` that are neither a str nor a collection of them (a mapping included)."""
    if stops is None or isinstance(stops, str):
        stops = [] if stops is None else [stops]
    elif isinstance(stops, Iterable) and not isinstance(stops, Mapping | bytes):
        stops = list(stops)
    else:
        raise ParameterError(f"{flag} must be a str or a list of str, got {stops!r}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ParameterError(f"{flag} must be non-empty strings, got {s!r}")
    return stops


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest occurrence of any of `stops` begins in `text` (None: none)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of a row's text are not final yet: the bytes of a
    character still incomplete (decoded as U+FFFD), and the longest tail that begins a
    stop string (the next tokens may complete it, and it would be cut)."""
    n = len(text) - len(text.rstrip(REPLACEMENT))
    rest = text[: len(text) - n]
    starts = range(1, min(max(map(len, stops), default=1) - 1, len(rest)) + 1)
    return n + max((k for k in starts if any(s.startswith(rest[-k:]) for s in stops)), default=0)


class Continuations:
    """The continuations of `rows` prompts: `tokens[r]` (the new ids, without an end id),
    `texts[r]` (decoded, cut before the first stop string) and `reasons[r]` ("eos": an
    id of `ends`; "stop": a string of `stops`; "length": max_new or max_length reached).
    `on_text(row, piece)`, if given, receives each row's text in pieces as they become
    final (a character whole, no possible stop string pending): their concatenation is
    `texts[row]`."""

    def __init__(
        self,
        tokenizer,
        rows: int,
        ends: Sequence[int] = (),
        stops: Sequence[str] = (),
        on_text: Callable[[int, str], None] | None = None,
    ):
        self.tokenizer, self.ends = tokenizer, {int(e) for e in ends}
        self.stops, self.on_text = check_stops(stops), on_text
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.texts = [""] * rows
        self.reasons: list[str | None] = [None] * rows
        self._shown = [0] * rows  # characters of each text handed to on_text

    def push(self, tokens, live=None) -> np.ndarray:
        """Record one step's tokens (one per row; `live`: the rows whose token is new,
        all by default); the mask of rows that have ended, a stop string's included."""
        tokens = np.asarray(tokens).tolist()
        live = np.ones(len(tokens), bool) if live is None else np.asarray(live)
        for r, t in enumerate(tokens):
            if self.reasons[r] is not None:
                continue
            if not live[r]:  # the decoder finished it at its max_length
                self._end(r, "length")
            elif t in self.ends:
                self._end(r, "eos")
            else:
                self.tokens[r].append(int(t))
                if self.stops or self.on_text:
                    self._update(r)
        return np.array([x is not None for x in self.reasons])

    def finish(self) -> Continuations:
        """End every row still going ("length"); each text complete. Returns self."""
        for r, reason in enumerate(self.reasons):
            if reason is None:
                self._end(r, "length")
        return self

    def _update(self, r: int) -> None:
        text = self.tokenizer.decode(self.tokens[r])
        if first_stop(text, self.stops) is not None:
            self._end(r, "stop", text)
        else:
            self.texts[r] = text
            self._show(r, len(text) - held_back(text, self.stops))

    def _end(self, r: int, reason: str, text: str | None = None) -> None:
        """Row r ends: its whole text, cut before a stop string (which makes it "stop")."""
        text = self.tokenizer.decode(self.tokens[r]) if text is None else text
        if (at := first_stop(text, self.stops)) is not None:
            text, reason = text[:at], "stop"
        self.texts[r], self.reasons[r] = text, reason
        self._show(r, len(text))

    def _show(self, r: int, upto: int) -> None:
        """Hand on_text the text of row r up to `upto` characters, past what it has."""
        if self.on_text is not None and upto > self._shown[r]:
            self.on_text(r, self.texts[r][self._shown[r] : upto])
            self._shown[r] = upto
