"""Output assembly with stops inside multi-token steps.

Tokens of a round are pushed one at a time, so a stop token id (EOS), a stop string or
max_tokens falling inside an accepted path ends the output exactly where plain decoding would.
Conventions (as vLLM): a stop token id is kept in ``token_ids`` and usage but not in the text;
a stop string is cut from the text, and tokens after the one that completed it are dropped.
Streamed text holds back an incomplete UTF-8 tail and any tail that could begin a stop
string, so deltas never split a character, never repeat, and never show stop text.
"""
from __future__ import annotations

from modeling.tokenizer import IncrementalDetokenizer, TextTokenizer


class OutputStream:
    """Accumulates emitted tokens; ``push`` returns True once the output is finished.

    O(1) per token in the output's length: the detokenizer decodes a window of recent tokens
    (``IncrementalDetokenizer``), and stop strings are looked for, and held back, only in the
    text not handed out yet (a stop string can only start there: any tail that could begin one
    is held back); the whole output is decoded once, when a stop token or max_tokens ends it.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: list[str], stop_token_ids: set[int], max_tokens: int):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in stop if s]
        self.stop_token_ids = set(stop_token_ids)
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._sent: list[str] = []  # text handed out, in pieces
        self._sent_len = 0          # its length in characters
        self._unsent = ""           # stable text not handed out yet (may end in a stop string's prefix)
        self._final: str | None = None  # once finished: the text still to hand out, nothing held back
        self._sent_ids = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        if self.finished:
            raise RuntimeError("output already finished")
        self.token_ids.append(token)
        if token in self.stop_token_ids:
            self._finish("stop", self.detok.full_text()[self._sent_len:])
            return True
        new = self.detok.add(token)
        if new:
            self._unsent += new
            if self.stop:
                hits = [i for i in (self._unsent.find(s) for s in self.stop) if i >= 0]
                if hits:
                    self._finish("stop", self._unsent[:min(hits)])
                    return True
        if len(self.token_ids) >= self.max_tokens:
            self._finish("length", self.detok.full_text()[self._sent_len:])
        return self.finished

    def ends_within(self, tokens: list[int]) -> bool:
        """True when pushing ``tokens`` surely finishes the output (max_tokens reached, or a stop
        token id among them); stop strings are not looked for (``push`` decides)."""
        return self.finished or len(self.token_ids) + len(tokens) >= self.max_tokens or \
            any(t in self.stop_token_ids for t in tokens)

    def _finish(self, reason: str, rest: str) -> None:
        self.finish_reason = reason
        self._final, self._unsent = rest, ""

    def _ready(self) -> str:
        """The unsent text that may be handed out: all of it once finished, else without its
        longest tail that is a proper prefix of a stop string."""
        if self._final is not None:
            return self._final
        text, hold = self._unsent, 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return text[:len(text) - hold]

    def take_delta(self) -> tuple[str, list[int]]:
        """Text and token ids not yet handed out."""
        text, ids = self._ready(), self.token_ids[self._sent_ids:]
        if self._final is not None:
            self._final = ""
        else:
            self._unsent = self._unsent[len(text):]
        if text:
            self._sent.append(text)
            self._sent_len += len(text)
        self._sent_ids = len(self.token_ids)
        return text, ids

    @property
    def text(self) -> str:
        """The output's text so far: what was handed out and what may be (stop-string prefixes held back)."""
        return "".join(self._sent) + self._ready()
