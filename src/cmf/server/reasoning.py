"""Reasoning split off the answer: ``<think>...</think>`` becomes ``reasoning_content``.

Applies to templates that think (their text names ``<think>``). A template may open the block in
the prompt (``opened``): the answer is then reasoning up to ``</think>``. Streaming holds back
a tail that could be a tag's beginning.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template uses think blocks."""
    return bool(template) and OPEN in template  # type: ignore[operator]


def opened(prompt_tail: str) -> bool:
    """Whether a prompt's last text leaves a think block open (the answer starts inside it)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def split(text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer (a ``</think>`` alone closes a block the
    prompt opened)."""
    end = text.find(CLOSE)
    if end < 0:
        start = text.find(OPEN)
        if start < 0:
            return None, text
        return text[start + len(OPEN):].strip(), text[:start]  # cut off while thinking
    start = text.find(OPEN, 0, end)
    reasoning = text[start + len(OPEN) if start >= 0 else 0:end]
    return reasoning.strip(), (text[:start] if start >= 0 else "") + text[end + len(CLOSE):].lstrip()


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that begins ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningStream:
    """Streaming split: :meth:`feed` returns ``(reasoning, content)`` deltas safe to send now."""

    def __init__(self, opened: bool = False) -> None:
        self.buf = ""
        # start (nothing yet) → think → answer, or start → answer; "think" at once when the
        # prompt opened the block
        self.state = "think" if opened else "start"

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        r = c = ""
        while self.buf:
            if self.state == "start":
                lead = self.buf.lstrip()
                if not lead:
                    return r, c
                if lead.startswith(OPEN):
                    self.buf, self.state = lead[len(OPEN):], "think"
                    continue
                if OPEN.startswith(lead):
                    return r, c  # may still become <think>
                self.state = "answer"
            if self.state == "think":
                at = self.buf.find(CLOSE)
                if at >= 0:
                    r += self.buf[:at]
                    self.buf, self.state = self.buf[at + len(CLOSE):].lstrip(), "answer"
                    continue
                keep = _partial(self.buf, CLOSE)
                r += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return r, c
            c += self.buf
            self.buf = ""
        return r, c

    def finish(self) -> tuple[str, str]:
        """What is still held: reasoning (an unclosed think block) or content."""
        rest, self.buf = self.buf, ""
        if self.state == "think":
            return rest, ""
        return "", rest
