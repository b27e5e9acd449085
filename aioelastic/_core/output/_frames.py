"""Cutting one worker stream into what the console shows: whole lines and progress frames.

A worker writes lines (ended by ``\\n``) and, for progress bars, *frames*: text that a
carriage return sends back to column 0 to be drawn over (``\\r 40%|####  |``). A
:class:`Framer` turns the raw bytes into console blocks that each end at column 0 —
with a ``\\n`` or with a ``\\r`` — so that blocks of different ranks written one after
the other are never spliced into one line, and it keeps the last lines for a failure
report, a redrawn line counting once, as it was last drawn.

What happens to a held piece (bytes after the last ``\\n`` or redrawing ``\\r``) when
:meth:`Framer.flush` is called (the flush delay expired, or the stream ended):

* a frame (the line was redrawn before, or the piece holds a ``\\r``) is shown followed by
  a ``\\r`` of our own, and stays held: if it grows it is drawn again in full, if the
  worker's own ``\\r`` follows nothing more is written, and a ``\\n`` after it is written
  bare, which leaves the frame on the screen and in a file reads as a ``\\r\\n`` ending;
* plain text (``print(end="")``) is printed as a line of its own, as before.

:attr:`Live.FRAMES` shows a frame as soon as it arrives (a terminal, where a bar should
move at the worker's pace); otherwise a frame waits for the next ``\\r`` or the flush
delay, so a file or pipe gets at most one copy of each frame, never one line per flush.
:attr:`Live.EVERYTHING` also shows plain partial text at once and as it is, without a
newline of ours — a prompt (``input("name? ")``, ``(Pdb) ``) stays on its line. Only for a
worker alone on its console: with several, its partial line could be spliced by another's.
"""

from __future__ import annotations

import enum
import re
from collections import deque

#: How many stderr lines a failure report quotes.
TAIL_LINES = 50
#: A longer stderr line is kept for the report as its head and end only.
TAIL_LINE_BYTES = 8 * 1024
#: A line longer than this is passed on in pieces rather than held in memory.
MAX_HELD_LINE = 8 * 1024 * 1024

# A carriage return that redraws a line (a progress bar), not the one of a CRLF ending.
_REDRAW = re.compile(rb"\r(?![\r\n])")
_CR, _LF = 13, 10


class Live(enum.IntEnum):
    """What the console is shown before the flush delay (see the module docstring)."""

    OFF = 0
    FRAMES = 1
    EVERYTHING = 2


class Framer:
    """Whole lines and progress frames of one stream, for the console and a report.

    Args:
        prefix: Put before every console line and after every redrawing ``\\r``.
        console: Whether console blocks are wanted (else :meth:`feed` returns ``b""``).
        keep_tail: Whether to keep the last :data:`TAIL_LINES` lines for a report.
        live: What is shown as soon as it arrives (:class:`Live`); the prefix must be
            empty for :attr:`Live.EVERYTHING`.
    """

    # Two per worker, hundreds of workers: no per-instance dict.
    __slots__ = (
        "_console",
        "_fed",
        "_leading_cr",
        "_live",
        "_partial",
        "_partial_at",
        "_prefix",
        "_redrawn",
        "_shown",
        "_shown_raw",
        "_tail",
        "_tail_frame",
        "keeps_tail",
    )

    def __init__(
        self, prefix: bytes, *, console: bool, keep_tail: bool, live: Live = Live.OFF
    ) -> None:
        if live is Live.EVERYTHING and prefix:
            raise ValueError("Live.EVERYTHING shows text as written, which a prefix would cut")
        self._prefix = prefix
        self._console = console
        self._live = live
        #: What is shown of ``_partial`` was shown raw (plain text), not as a frame.
        self._shown_raw = False
        #: A redrawing \r arrived alone at the start of a line: the next piece starts with it.
        self._leading_cr = False
        self._partial = bytearray()
        #: Bytes fed so far, and where in the stream ``_partial`` begins.
        self._fed = 0
        self._partial_at = 0
        #: Bytes of ``_partial`` already on the console as a frame (closed by our ``\r``).
        self._shown = 0
        #: The line being written has been redrawn by a ``\r``: what is held is a frame.
        self._redrawn = False
        #: Whether the last lines are kept (see ``tail_lines``).
        self.keeps_tail = keep_tail
        # Made at the first line: a group of hundreds of quiet workers keeps no empty deques.
        self._tail: deque[bytes] | None = None
        #: The last frame of the current line shown so far (what a report quotes for it).
        self._tail_frame = b""

    @property
    def holding(self) -> bool:
        """Whether bytes are held that the console has not shown yet."""
        return len(self._partial) > self._shown

    @property
    def fed(self) -> int:
        """How many bytes were fed so far (where the next :meth:`feed` begins)."""
        return self._fed

    @property
    def held_from(self) -> int:
        """Where in the stream the bytes held back (see :attr:`holding`) begin.

        The flush delay of a held piece counts from its first byte: a caller keeping the
        deadline compares this before and after :meth:`feed` to tell a piece that grew
        from a new one, begun after a line the same chunk completed.
        """
        return self._partial_at + self._shown

    def feed(self, chunk: bytes) -> bytes:
        """Take the next bytes of the stream; return what the console should print now."""
        start = self._fed
        self._fed += len(chunk)
        cut = _boundary(chunk)
        if cut == 0 and self._partial[-1:] == b"\r" and chunk[:1] not in (b"\r", b"\n", b""):
            # The \r that ended the previous read redraws: all that is held is a frame.
            block, self._partial = bytes(self._partial), bytearray(chunk)
            self._partial_at = start
        elif cut == 0:
            if not self._partial:
                self._partial_at = start
            # bytearray appends are amortised O(1): a 1 MB line arriving in 64 KiB
            # chunks is copied once, not once per chunk.
            self._partial += chunk
            if len(self._partial) - self._shown > MAX_HELD_LINE:
                return self._emit_plain()
            if self._live and self._is_frame():
                return self._show_frame()
            if self._live is Live.EVERYTHING:
                return self._show_raw()
            return b""
        else:
            if self._partial:
                self._partial += chunk[:cut]
                block = bytes(self._partial)
            else:
                block = chunk[:cut] if cut < len(chunk) else chunk
            self._partial = bytearray(chunk[cut:])
            self._partial_at = start + cut
        out = self._emit_block(block)
        if self._live and self._partial and self._is_frame():
            out += self._show_frame()
        elif self._live is Live.EVERYTHING and self._partial:
            out += self._show_raw()
        return out

    @property
    def holds_frame(self) -> bool:
        """Whether what is held is a progress frame (redrawn by a ``\\r``), not plain text."""
        return self._is_frame()

    @property
    def prefixed(self) -> bool:
        """Whether console lines get a prefix."""
        return bool(self._prefix)

    @property
    def raw_text_shown(self) -> bool:
        """Whether the console shows the start of a line as written, not ended yet."""
        return self._shown_raw and self._shown > 0

    @property
    def live(self) -> Live:
        """What is shown as soon as it arrives (see :class:`Live`)."""
        return self._live

    def set_live(self, live: Live) -> bytes:
        """Show from now on what ``live`` says; return what the console should print now.

        Turned to :attr:`Live.EVERYTHING`, held plain text (a prompt) is shown at once.
        Turned back, plain text shown so far stays shown and the rest of its line
        follows when it ends. :attr:`Live.EVERYTHING` is ignored with a prefix.
        """
        if live is Live.EVERYTHING and self._prefix:
            return b""
        self._live = live
        if live is Live.EVERYTHING and self.holding and not self._is_frame():
            return self._show_raw()
        return b""

    def end_shown_line(self) -> None:
        """The console's line was ended elsewhere: the terminal echoed a typed newline.

        Plain text shown as written (a prompt) then counts as a line of its own, so that
        the stream's next newline, or its end, does not print an empty line.
        """
        if not self._shown_raw or self.holding:
            return
        line = bytes(self._partial)
        self._partial.clear()
        self._shown = 0
        self._shown_raw = False
        if self.keeps_tail:
            self._tail_lines().append(_tail_entry(_last_drawn(line) or self._tail_frame))
        self._tail_frame = b""

    def flush(self) -> bytes:
        """The flush delay expired: show what is held (see the module docstring)."""
        if not self.holding:
            return b""
        if self._is_frame():
            return self._show_frame()
        if self._live is Live.EVERYTHING:
            return self._show_raw()
        return self._emit_plain()

    def end(self) -> bytes:
        """The stream ended: end what is held with a newline."""
        if not self._partial:
            return b""
        block = bytes(self._partial) + b"\n"
        self._partial = bytearray()
        return self._emit_block(block)

    def tail_lines(self) -> list[bytes]:
        """The last lines, each as it was last drawn, with what is still held."""
        if not self.keeps_tail:
            return []
        lines = list(self._tail or ())
        if self._partial:
            lines.append(_tail_entry(_last_drawn(bytes(self._partial)) or self._tail_frame))
        elif self._tail_frame:
            lines.append(_tail_entry(self._tail_frame))
        return lines[-TAIL_LINES:]

    def _is_frame(self) -> bool:
        return self._redrawn or b"\r" in self._partial

    def _emit_block(self, block: bytes) -> bytes:
        """Print ``block``, which ends at column 0 (a ``\\n`` or a redrawing ``\\r``)."""
        shown, self._shown = self._shown, 0
        shown_raw, self._shown_raw = self._shown_raw, False
        self._keep_tail(block)
        self._redrawn = block[-1] == _CR
        if not self._console:
            return b""
        if self._prefix and not shown and not block.strip(b"\r"):
            # A bar's first \r, at the start of a line and read without its text (the
            # machine was busy): printed alone it would be a piece without our prefix,
            # which another rank's piece could follow. It leads our next piece instead.
            self._leading_cr = True
            return b""
        if shown and shown_raw:
            return block[shown:]  # the text so far is on the console as written
        if shown:
            rest = block[shown:]
            if rest[:1] in (b"\r", b"\n"):
                # The worker's own \r closes the frame we closed already; a \n is
                # written bare: the frame stays on screen, and a file reads "frame\r\n".
                rest = rest.lstrip(b"\r")
                if rest[:1] == b"\n":
                    return b"\n" + self._framed(rest[1:])
                return self._framed(rest)
            # Otherwise the frame grew: it is drawn again whole.
        return self._framed(block)

    def _show_raw(self) -> bytes:
        """Show the held plain text as it is, without ending its line (Live.EVERYTHING)."""
        if self._shown and not self._shown_raw:
            return b""  # a frame is up; it is redrawn when it changes
        new = bytes(self._partial[self._shown :])
        self._shown = len(self._partial)
        self._shown_raw = True
        return new if self._console else b""

    def _show_frame(self) -> bytes:
        if self._shown_raw:
            # Plain text shown raw turned into a frame (a \r arrived, not at the end):
            # what follows is shown raw too; the terminal interprets the \r itself.
            return self._show_raw_continuation()
        frame = bytes(self._partial)
        self._shown = len(frame)
        self._tail_frame = _last_drawn(frame) or self._tail_frame
        return self._framed(frame + b"\r") if self._console else b""

    def _show_raw_continuation(self) -> bytes:
        new = bytes(self._partial[self._shown :])
        self._shown = len(self._partial)
        self._tail_frame = _last_drawn(bytes(self._partial)) or self._tail_frame
        return new if self._console else b""

    def _emit_plain(self) -> bytes:
        """Print the held bytes as a line of their own (plain text, or a huge line)."""
        line = bytes(self._partial)
        # Plain text shown raw before (live was turned down since) is not shown again.
        shown = self._shown if self._shown_raw else 0
        self._partial.clear()
        self._shown = 0
        self._shown_raw = False
        if self.keeps_tail:
            self._tail_lines().append(_tail_entry(_last_drawn(line) or self._tail_frame))
        self._tail_frame = b""
        return self._framed(line[shown:] + b"\n") if self._console else b""

    def _keep_tail(self, block: bytes) -> None:
        if not self.keeps_tail:
            return
        end = block.rfind(b"\n") + 1
        if end:
            lines = block[: end - 1].split(b"\n")
            first_is_current = len(lines) <= TAIL_LINES
            lines = lines[-TAIL_LINES:]
            entries = [_last_drawn(line) for line in lines]
            if first_is_current and not entries[0]:
                entries[0] = self._tail_frame
            self._tail_lines().extend(_tail_entry(entry) for entry in entries)
            self._tail_frame = b""
        if end < len(block):
            self._tail_frame = _last_drawn(block[end:]) or self._tail_frame

    def _tail_lines(self) -> deque[bytes]:
        if self._tail is None:
            self._tail = deque(maxlen=TAIL_LINES)
        return self._tail

    def _framed(self, block: bytes) -> bytes:
        """``block`` (ending with ``\\n`` or ``\\r``) with the prefix at each column 0."""
        prefix = self._prefix
        if not prefix or not block:
            return self._lead(block)
        out = block.replace(b"\n", b"\n" + prefix)
        if b"\r" in block:
            # A progress bar returns to column 0 and would draw over the prefix. The
            # final \r (ours or the worker's) matches too: cut below like a final \n's.
            out = _REDRAW.sub(lambda _: b"\r" + prefix, out)
        out = out[: -len(prefix)]
        if block[0] != _CR or block[1:2] in (b"\r", b"\n"):
            out = prefix + out
        return self._lead(out)

    def _lead(self, out: bytes) -> bytes:
        """``out``, after the lone ``\\r`` held back at the start of its line, if any."""
        if self._leading_cr and out:
            self._leading_cr = False
            if out[:1] != b"\r":
                return b"\r" + out
        return out


def _boundary(chunk: bytes) -> int:
    """Where the last complete line or frame of ``chunk`` ends (0: none)."""
    end = chunk.rfind(b"\n") + 1
    cr = chunk.rfind(b"\r", end)
    while cr >= 0:
        following = chunk[cr + 1 : cr + 2]
        if following and following[0] not in (_CR, _LF):
            return cr + 1
        cr = chunk.rfind(b"\r", end, cr)
    return end


def _tail_entry(line: bytes) -> bytes:
    """What the report keeps of a stderr line: all of it unless it is huge."""
    if len(line) <= TAIL_LINE_BYTES:
        return line
    half = TAIL_LINE_BYTES // 2
    cut = len(line) - 2 * half
    return line[:half] + b" [... %d bytes cut ...] " % cut + line[-half:]


def _last_drawn(line: bytes) -> bytes:
    body = line.rstrip(b"\r")
    return body[body.rfind(b"\r") + 1 :]
