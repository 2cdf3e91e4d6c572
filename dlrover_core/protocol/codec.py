"""The one converter every message crosses a process boundary with (cattrs).

Messages are frozen attrs classes; :func:`encode` turns one into JSON-safe data and
:func:`decode` builds one back. Decoding tolerates fields it does not know (a newer peer may
send more) and fills missing optional ones with their defaults; a missing required field or
a value of the wrong type raises :class:`~dlrover_core.errors.ProtocolError` naming the
message and the field.
"""

from __future__ import annotations

from typing import Any, TypeVar

import cattrs

from dlrover_core.errors import ProtocolError

__all__ = ["converter", "decode", "encode"]

T = TypeVar("T")

#: The converter of every protocol message (unknown keys are dropped, not refused).
converter = cattrs.Converter(forbid_extra_keys=False)
# JSON object keys are strings: ``dict[int, int]`` fields (ranks -> pids) come back as ints
converter.register_structure_hook(int, lambda v, _: int(v))
converter.register_structure_hook(float, lambda v, _: float(v))


def _structure_bool(value: Any, _: type) -> bool:
    # registered after int: bool subclasses int, and int's hook would turn True into 1
    if isinstance(value, bool):
        return value
    raise TypeError(f"expected true or false, got {value!r}")


converter.register_structure_hook(bool, _structure_bool)


def encode(message: Any) -> Any:
    """``message`` as JSON-safe data (dicts, lists, strings, numbers, None)."""
    return converter.unstructure(message)


def decode(cls: type[T], data: Any) -> T:
    """Build a ``cls`` from :func:`encode`'s output (or a newer peer's, with more fields).

    Raises:
        ProtocolError: a field is missing or has the wrong type; the message names both.
    """
    try:
        return converter.structure(data, cls)
    except cattrs.BaseValidationError as exc:
        notes = cattrs.transform_error(exc)
        raise ProtocolError(f"malformed {cls.__name__}: {'; '.join(notes)}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"malformed {cls.__name__}: {type(exc).__name__}: {exc}") from None
