"""Chat templates rendered within limits of time and size.

Inside :func:`bounded_rendering`, every rendering of one template by transformers
(``apply_chat_template``, batched or not, with or without the assistant mask) may run
``seconds`` of wall time and write ``characters`` characters, checked while it renders,
so a template that loops forever or writes gigabytes is stopped, not waited for:

- output is counted piece by piece as the template writes it, and a block the template
  buffers (a macro's, a ``{% set %}``, ``{% call %}`` or ``{% generation %}`` block's
  text) is measured before it is joined;
- time is kept by one watchdog thread, which raises in the rendering's thread when its
  deadline passes (compiled templates are Python bytecode, so a loop that writes nothing
  is stopped too).

Both hooks sit on transformers' cached compiled template (one per template text) and
pass everything through unchanged outside a block, and in other threads than the
block's. What neither sees: one expression's value (``'x' * 10**9``) exists before it
is written; the time limit still ends the rendering.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from .._arguments import check_int
from ..errors import InvalidInputError
from .readers import missing_extra

#: Seconds between the watchdog's raises in a rendering that is still running after its
#: deadline (the first can be lost: an exception raised inside a finalizer is only printed).
REPEAT = 0.1


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on rendering one record with a chat template: ``seconds`` of wall time (a
    positive number, at most ``threading.TIMEOUT_MAX``) and ``characters`` of output (a
    positive int), both checked while it renders."""

    seconds: float = 10.0
    characters: int = 8_000_000

    def __post_init__(self):
        seconds = self.seconds
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) \
                or not 0 < seconds <= threading.TIMEOUT_MAX:
            raise InvalidInputError(f"the template time limit must be a positive number of seconds (at most "
                                    f"{threading.TIMEOUT_MAX:g}), not {seconds!r}")
        object.__setattr__(self, "seconds", float(seconds))
        object.__setattr__(self, "characters", check_int("the template character limit", self.characters))


class TemplateLimitError(InvalidInputError):
    """Rendering ``index`` (0-based, counted from the start of its
    :func:`bounded_rendering` block; in a batched ``apply_chat_template`` call it is the
    conversation's index) passed ``limit`` (``"seconds"`` or ``"characters"``), whose
    value is ``maximum``; ``detail`` says by how much and which flag raises it."""

    def __init__(self, index: int, detail: str, *, limit: str, maximum: float):
        super().__init__(f"rendering {index} of the chat template {detail}")
        self.index, self.detail, self.limit, self.maximum = index, detail, limit, maximum


@contextmanager
def bounded_rendering(chat_template: str, *, seconds: float, characters: int):
    """Within the block, each rendering of ``chat_template`` by transformers in this thread
    runs at most ``seconds`` of wall time and writes at most ``characters`` characters
    (its output, and any block it buffers); the first rendering past a limit raises
    :class:`TemplateLimitError` naming it. Renderings are counted from 0 at the start of
    the block; blocks nest (the innermost one's limits apply). Refused
    (:class:`InvalidInputError`): limits :class:`TemplateLimits` refuses, a template that
    does not compile.
    """
    limits = TemplateLimits(seconds, characters)
    bounds = _Bounds(limits.seconds, limits.characters)
    key = _install(chat_template)
    blocks = _BLOCKS.bounds
    outer = blocks.get(key)
    blocks[key] = bounds
    expired = False
    try:
        yield
    except _Expired:  # raised while transformers' code, not the template, was running
        expired = True
    finally:
        while True:  # an _Expired raised before every watch was disarmed arrives here at the latest
            try:
                for watch in list(bounds.watches):
                    _WATCHDOG.disarm(watch)
                break
            except _Expired:
                expired = True
        if outer is None:
            del blocks[key]
        else:
            blocks[key] = outer
    if expired:
        fired = [watch for watch in bounds.watches if watch.fired]
        if not fired:
            raise _Expired  # an enclosing block's rendering expired
        raise bounds.too_slow(min(fired, key=lambda watch: watch.index)) from None


class _Expired(BaseException):
    """Raised by the watchdog in a rendering's thread; a ``BaseException`` so that no
    ``except Exception`` in jinja or transformers stops it on its way to this module."""


class _Watch:
    """The deadline of one rendering, in the thread that renders it."""

    __slots__ = ("index", "thread", "start", "deadline", "due", "fired")

    def __init__(self, index: int, seconds: float):
        self.index, self.thread = index, threading.get_ident()
        self.start = time.monotonic()
        self.deadline = self.due = self.start + seconds
        self.fired = False


class _Watchdog:
    """One daemon thread per process: when an armed watch's deadline passes, it raises
    :class:`_Expired` in the watch's thread, and again every ``REPEAT`` seconds until the
    watch is disarmed. Firing and disarming hold one lock, so a watch never fires after
    :meth:`disarm`, which also withdraws a raise not yet delivered."""

    def __init__(self):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._watches: set[_Watch] = set()
        self._thread: threading.Thread | None = None
        self._wakes = math.inf

    def arm(self, watch: _Watch) -> None:
        with self._lock:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="seqpack-template-watchdog", daemon=True)
                self._thread.start()
            elif watch.due < self._wakes:
                self._changed.notify()

    def disarm(self, watch: _Watch) -> bool:
        """Whether ``watch`` fired (its raise delivered, or withdrawn here). Idempotent."""
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)
                if watch.fired:
                    _raise_in(watch.thread, None)
            return watch.fired

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                for watch in self._watches:
                    if watch.due <= now:
                        _raise_in(watch.thread, _Expired)
                        watch.fired, watch.due = True, now + REPEAT
                self._wakes = min((watch.due for watch in self._watches), default=math.inf)
                self._changed.wait(None if self._wakes == math.inf else self._wakes - now)


def _raise_in(thread: int, exception: type[BaseException] | None) -> None:
    """Raise ``exception`` in ``thread`` when it next runs bytecode (``None`` withdraws a pending one)."""
    pending = None if exception is None else ctypes.py_object(exception)  # None passes NULL
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), pending)


_WATCHDOG = _Watchdog()


def _after_fork_in_child() -> None:
    global _WATCHDOG
    _WATCHDOG = _Watchdog()  # the parent's thread and lock are not the child's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Bounds:
    """The limits of one block, and the renderings started in it."""

    def __init__(self, seconds: float, characters: int):
        self.seconds, self.characters = seconds, characters
        self.started = 0
        self.current: _Watch | None = None
        self.watches: set[_Watch] = set()  # armed, or fired: the block's exit disarms them

    def render(self, pieces):
        """``pieces`` (one rendering's output) passed through, within the limits."""
        self.current = watch = _Watch(self.started, self.seconds)
        self.started += 1
        self.watches.add(watch)
        written, interrupted = 0, False
        try:
            _WATCHDOG.arm(watch)
            for piece in pieces:
                written += len(piece)
                if written > self.characters:
                    raise self.too_long(watch.index, f"wrote {written} characters and was stopped")
                if time.monotonic() > watch.deadline:
                    raise self.too_slow(watch)
                yield piece
        except _Expired:
            interrupted = True
        finally:
            while True:  # an _Expired raised before disarm took effect arrives here at the latest
                try:
                    fired = _WATCHDOG.disarm(watch)
                    break
                except _Expired:
                    interrupted = True
            if not fired:
                self.watches.discard(watch)
        self.watches.discard(watch)  # a fired watch stays only when its error is left to the block
        if fired:
            raise self.too_slow(watch)
        if interrupted:
            raise _Expired  # another block's watch fired in this thread: its block names it

    def join(self, join, pieces):
        """A buffered block joined by ``join``, refused before joining when too long."""
        if type(pieces) is list:
            size = sum(map(len, pieces))
            if size > self.characters:
                index = self.current.index if self.current is not None else self.started - 1
                raise self.too_long(index, f"built a block of {size} characters")
        return join(pieces)

    def too_long(self, index: int, what: str) -> TemplateLimitError:
        return TemplateLimitError(index, f"{what}; the limit is {self.characters} characters (raise it with "
                                         f"--template-characters)", limit="characters", maximum=self.characters)

    def too_slow(self, watch: _Watch) -> TemplateLimitError:
        ran = time.monotonic() - watch.start
        return TemplateLimitError(watch.index, f"was still running after {ran:.2f} s; the limit is {self.seconds:g} s "
                                               f"(raise it with --template-seconds)", limit="seconds",
                                  maximum=self.seconds)


class _Blocks(threading.local):
    def __init__(self):
        self.bounds: dict[object, _Bounds] = {}  # a hooked template's key: its innermost block in this thread


_BLOCKS = _Blocks()
_INSTALLING = threading.Lock()


def _install(chat_template: str) -> object:
    """The key of transformers' compiled ``chat_template``, hooked once: its
    ``root_render_func`` (every rendering's output) and its environment's ``concat``
    (every buffered block's join) check the thread's innermost block for that key."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        raise missing_extra("bounding chat templates", "hf") from None
    if not isinstance(chat_template, str):
        raise InvalidInputError(f"chat_template must be the template's text (a str), not "
                                f"{type(chat_template).__name__}")
    try:
        compiled = _compile_jinja_template(chat_template)  # cached per text: the one apply_chat_template renders
    except Exception as error:  # jinja's syntax errors, transformers' version checks
        raise InvalidInputError(f"the chat template does not compile: {error}") from None
    with _INSTALLING:
        key = getattr(compiled.root_render_func, "_seqpack_bounds", None)
        if key is not None:
            return key
        key = object()
        root, join = compiled.root_render_func, compiled.environment.concat

        def root_render_func(context):
            bounds = _BLOCKS.bounds.get(key)
            return root(context) if bounds is None else bounds.render(root(context))

        def concat(pieces):
            bounds = _BLOCKS.bounds.get(key)
            return join(pieces) if bounds is None else bounds.join(join, pieces)

        root_render_func._seqpack_bounds = key
        root_render_func.__wrapped__ = root
        compiled.root_render_func = root_render_func
        compiled.environment.concat = concat
    return key
