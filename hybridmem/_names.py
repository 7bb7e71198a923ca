"""Names a user may misspell: the nearest known one, said in the error.

Python answers an unknown keyword with ``f() got an unexpected keyword argument 'x'``
and nothing else; :func:`suggests_keywords` adds the parameter meant. It changes
nothing else about the call: the wrapper has the function's signature, and a
``TypeError`` raised inside the function passes through untouched.

Scope: pure; thread-safe.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["nearest", "suggests_keywords"]

_F = TypeVar("_F", bound=Callable[..., Any])
_UNEXPECTED = re.compile(r"got an unexpected keyword argument '(\w+)'")


def nearest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``name``, or ``""``.

    A known name that differs from ``name`` only in case is always the one meant.

    Args:
        name: what the user wrote.
        known: the names allowed there.
        cutoff: how close a name must be (``difflib``'s ratio, 0 to 1).

    Example:
        >>> nearest("relase_cache", ["release_cache", "force"])
        " (did you mean 'release_cache'?)"
        >>> nearest("VLLM", ["default", "sglang", "vllm"])
        " (did you mean 'vllm'?)"
        >>> nearest("zzz", ["force"])
        ''
    """
    names = list(known)
    same = [k for k in names if k.lower() == name.lower()]
    close = same or difflib.get_close_matches(name, names, n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _keywords(func: Callable[..., Any]) -> list[str]:
    """The names ``func`` takes by keyword."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    return [p.name for p in parameters if p.kind in kinds and p.name != "self"]


def _misspelled(func: Callable[..., Any], name: str, args: Any, kwargs: Any) -> bool:
    """Whether ``name`` is a keyword of this call that ``func``'s signature refuses."""
    if name not in kwargs:
        return False
    try:
        inspect.signature(func).bind_partial(*args, **kwargs)
    except TypeError as exc:
        return _UNEXPECTED.search(str(exc)) is not None
    except ValueError:  # a builtin without a signature
        return False
    return False


def suggests_keywords(func: _F) -> _F:
    """Wrap ``func`` so that an unknown keyword's ``TypeError`` names the parameter meant.

    Only the caller's keyword that ``func``'s signature refuses is said (a
    ``TypeError`` raised inside ``func`` passes through as it was, whatever it says);
    the message keeps Python's words and adds the nearest keyword ``func`` takes and
    the list of them. A class gets its ``__init__`` wrapped in place.

    Args:
        func: a function, method or class.

    Returns:
        The wrapper (``functools.wraps``: same name, docstring and signature), or the
        class itself.

    Example:
        >>> @suggests_keywords
        ... def toggle(enabled, *, release_cache=True): ...
        >>> try:
        ...     toggle(False, relase_cache=True)
        ... except TypeError as exc:
        ...     print(str(exc).split(";")[0])
        toggle() got an unexpected keyword argument 'relase_cache' (did you mean 'release_cache'?)
    """
    if inspect.isclass(func):
        func.__init__ = suggests_keywords(func.__init__)  # type: ignore[method-assign]
        return func
    if inspect.iscoroutinefunction(func) or inspect.isgeneratorfunction(func):
        raise TypeError(f"suggests_keywords wraps plain functions, not {func!r}")

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except TypeError as exc:
            found = _UNEXPECTED.search(str(exc))
            if found is None or not _misspelled(func, found.group(1), args, kwargs):
                raise  # raised inside func (or by a wrapper under this one): its own
            known = _keywords(func)
            takes = f"it takes: {', '.join(known)}" if known else "it takes no keywords"
            raise TypeError(f"{exc}{nearest(found.group(1), known)}; {takes}") from None

    return wrapper  # type: ignore[return-value]
