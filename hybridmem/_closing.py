"""``with obj:`` for objects that own resources and free them in ``close()``.

Scope: none of its own; the class it is mixed into says what ``close()`` frees.
"""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

__all__ = ["ClosesOnExit"]

_C = TypeVar("_C", bound="ClosesOnExit")


class ClosesOnExit:
    """A mixin: entering returns the object, leaving calls its ``close()``, error or not.

    The class mixing it in defines ``close()`` (idempotent: a ``with`` block may end
    after an explicit close).

    Example:
        >>> class Held(ClosesOnExit):
        ...     closed = False
        ...     def close(self) -> None:
        ...         self.closed = True
        >>> with Held() as held:
        ...     pass
        >>> held.closed
        True
    """

    def close(self) -> None:
        """Free what the object holds; the class mixing this in says what."""
        raise NotImplementedError(f"{type(self).__name__} must define close()")

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
