"""Incremental detokenization with stop strings.

Byte-level BPE splits one UTF-8 character over several tokens, so decoding token by token would emit
half characters as U+FFFD. The detokenizer decodes a sliding window of ids (TGI's prefix/read offsets)
and only moves forward once the window decodes to text that does not end in U+FFFD.

Stop strings are matched on characters, not tokens, and the text that could still become a stop string
is held back until it either completes the match (and is dropped) or can no longer do so.
"""

from __future__ import annotations

# Prompt tokens kept in front of the output so the first output token decodes with its context
# (sentencepiece tokenizers drop a leading space when a token is decoded alone).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_ids: the prompt's token ids (the last few give context).
        stop: stop strings; the first match ends generation and is not part of the text.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool, stop: list[str]):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token.

        Returns:
            The stop string matched (the text is cut where it starts), or None.
        """
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if not self.stop:
            return None
        start = max(0, old_len - self.max_stop + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def flush_undecoded(self) -> None:
        """At the end of generation, keep whatever the window still holds (even an incomplete
        character, as U+FFFD, which is what a full decode shows)."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix):
                self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned; while running, minus any tail that may still start a stop string."""
        end = len(self.text)
        if not finished and self.stop:
            for k in range(min(self.max_stop - 1, end - self.emitted), 0, -1):
                tail = self.text[end - k:]
                if any(s.startswith(tail) for s in self.stop):
                    end -= k
                    break
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
