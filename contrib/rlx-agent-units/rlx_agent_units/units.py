"""The ``units`` tool: converts a value between units of length, mass, temperature or time.

A call is ``{"value": 3, "from": "km", "to": "mi"}``; the result is the converted value as text, rounded to
``precision`` significant digits (``tools.units.precision``, 6 by default):

>>> tool = build_units(UnitsOptions(), None)
>>> tool({"value": 3, "from": "km", "to": "mi"}), tool({"value": 100, "from": "C", "to": "F"})
('1.86411', '212')

Units are written as symbols (``km``, ``lb``, ``degF``, ``h``) or names (``kilometers``, ``pound``,
``fahrenheit``, ``hours``), in any case. Lengths, masses and times are linear factors of a base unit (metre,
kilogram, second; the international yard and pound, so ``1 in = 0.0254 m`` and ``1 lb = 0.45359237 kg``
exactly); temperatures are affine (kelvin, Celsius, Fahrenheit, Rankine). ``value`` is a JSON number (a string
holding one is accepted too, as models often write one).

Every call that cannot be converted raises :class:`rlx.protocols.ToolError`, whose message the model reads as
the tool's turn: an unknown unit (the message lists the known ones), units of two different dimensions, a
value that is not a finite number or is larger than ``max_magnitude``, a temperature below absolute zero,
arguments other than the three of the schema.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlx.protocols import ToolError

# dimension -> canonical symbol -> (factor to the base unit, offset, aliases). A value v in unit u is
# (v + offset) * factor base units: offsets are 0 except for the temperatures (base unit: kelvin).
_UNITS: dict[str, dict[str, tuple[float, float, tuple[str, ...]]]] = {
    "length": {
        "mm": (1e-3, 0.0, ("millimeter", "millimeters", "millimetre", "millimetres")),
        "cm": (1e-2, 0.0, ("centimeter", "centimeters", "centimetre", "centimetres")),
        "m": (1.0, 0.0, ("meter", "meters", "metre", "metres")),
        "km": (1e3, 0.0, ("kilometer", "kilometers", "kilometre", "kilometres")),
        "in": (0.0254, 0.0, ("inch", "inches")),
        "ft": (0.3048, 0.0, ("foot", "feet")),
        "yd": (0.9144, 0.0, ("yard", "yards")),
        "mi": (1609.344, 0.0, ("mile", "miles")),
        "nmi": (1852.0, 0.0, ("nautical mile", "nautical miles")),
    },
    "mass": {
        "mg": (1e-6, 0.0, ("milligram", "milligrams")),
        "g": (1e-3, 0.0, ("gram", "grams")),
        "kg": (1.0, 0.0, ("kilogram", "kilograms")),
        "t": (1e3, 0.0, ("tonne", "tonnes", "metric ton", "metric tons")),
        "oz": (0.028349523125, 0.0, ("ounce", "ounces")),
        "lb": (0.45359237, 0.0, ("lbs", "pound", "pounds")),
        "st": (6.35029318, 0.0, ("stone", "stones")),
    },
    "temperature": {
        "K": (1.0, 0.0, ("kelvin", "kelvins")),
        "degC": (1.0, 273.15, ("C", "°C", "celsius")),
        "degF": (5 / 9, 459.67, ("F", "°F", "fahrenheit")),
        "degR": (5 / 9, 0.0, ("R", "°R", "rankine")),
    },
    "time": {
        "ms": (1e-3, 0.0, ("millisecond", "milliseconds")),
        "s": (1.0, 0.0, ("sec", "second", "seconds")),
        "min": (60.0, 0.0, ("minute", "minutes")),
        "h": (3600.0, 0.0, ("hr", "hour", "hours")),
        "d": (86400.0, 0.0, ("day", "days")),
        "wk": (604800.0, 0.0, ("week", "weeks")),
    },
}

# What a model may write (lowercased, spaces collapsed) -> (dimension, canonical symbol).
_LOOKUP: dict[str, tuple[str, str]] = {}
for _dim, _table in _UNITS.items():
    for _symbol, (_, _, _aliases) in _table.items():
        for _spelling in (_symbol, *_aliases):
            _key = " ".join(_spelling.lower().split())
            assert _key not in _LOOKUP, f"unit spelling {_key!r} is ambiguous"
            _LOOKUP[_key] = (_dim, _symbol)

SYMBOLS: tuple[str, ...] = tuple(s for table in _UNITS.values() for s in table)
_ARGUMENTS = ("value", "from", "to")


class UnitsOptions(BaseModel):
    """``tools.units.*``."""

    model_config = ConfigDict(extra="forbid")
    precision: int = Field(6, ge=1, le=15, description="Significant digits of a result (1 to 15).")
    max_magnitude: float = Field(1e12, gt=0, le=1e100, description="Largest absolute value a call may convert; "
                                 "a larger one is refused with an error turn.")


def _unit(arguments: dict[str, Any], key: str) -> tuple[str, str]:
    raw = arguments[key]
    if not isinstance(raw, str):
        raise ToolError(f'Error: "{key}" must be a unit name (a string), got {type(raw).__name__}.')
    found = _LOOKUP.get(" ".join(raw.lower().split()))
    if found is None:
        raise ToolError(f'Error: unknown unit {raw!r} in "{key}". Known units: {", ".join(SYMBOLS)} '
                        "(or their names, e.g. kilometers, pounds, celsius, hours).")
    return found


def _number(raw: object, limit: float) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ToolError(f'Error: "value" must be a number, got {type(raw).__name__}.')
    if isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise ToolError(f'Error: "value" must be a number, got the text {raw[:40]!r}.') from None
    else:
        try:
            value = float(raw)
        except OverflowError:  # an integer too large for a float
            value = math.inf
    if not math.isfinite(value):
        raise ToolError('Error: "value" must be a finite number.')
    if abs(value) > limit:
        raise ToolError(f'Error: "value" must be at most {limit:g} in absolute value.')
    return value


def format_number(value: float, precision: int) -> str:
    """``value`` with ``precision`` significant digits, without a trailing ``.0`` or a negative zero."""
    text = f"{value:.{precision}g}"
    return "0" if text in ("-0", "0") else text


class Units:
    """The ``units`` tool: ``{"value": number, "from": unit, "to": unit}`` -> the converted value as text."""

    def __init__(self, options: UnitsOptions) -> None:
        self.options = options

    def schema(self) -> dict[str, Any]:
        unit = {"type": "string", "enum": list(SYMBOLS)}
        return {"type": "function", "function": {
            "name": "units",
            "description": "Convert a value between units of the same dimension: length (mm cm m km in ft yd mi "
                           "nmi), mass (mg g kg t oz lb st), temperature (K degC degF degR) or time (ms s min h d "
                           "wk). Returns the converted value.",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number", "description": "The value to convert, e.g. 3."},
                    "from": {**unit, "description": "The unit of value, e.g. \"km\"."},
                    "to": {**unit, "description": "The unit to convert to, e.g. \"mi\"."},
                },
                "required": list(_ARGUMENTS),
                "additionalProperties": False,
            }}}

    def __call__(self, arguments: dict[str, Any]) -> str:
        expected = 'units takes {"value": <number>, "from": "<unit>", "to": "<unit>"}'
        if not isinstance(arguments, dict):
            raise ToolError(f"Error: {expected}; got {type(arguments).__name__}.")
        extra = sorted(str(k) for k in arguments if k not in _ARGUMENTS)
        missing = [k for k in _ARGUMENTS if k not in arguments]
        if extra or missing:
            what = "; ".join(filter(None, [f"unknown argument(s): {', '.join(extra)}" if extra else "",
                                           f"missing: {', '.join(missing)}" if missing else ""]))
            raise ToolError(f"Error: {expected}; {what}.")
        value = _number(arguments["value"], self.options.max_magnitude)
        dim_from, src = _unit(arguments, "from")
        dim_to, dst = _unit(arguments, "to")
        if dim_from != dim_to:
            raise ToolError(f"Error: cannot convert {src} ({dim_from}) to {dst} ({dim_to}): the units must have "
                            "the same dimension.")
        factor, offset, _ = _UNITS[dim_from][src]
        base = (value + offset) * factor
        if dim_from == "temperature":
            if base < -1e-9:
                raise ToolError(f"Error: {format_number(value, self.options.precision)} {src} is below absolute "
                                "zero.")
            base = max(base, 0.0)  # -273.15 degC is 0 K, not a rounding error below it
        to_factor, to_offset, _ = _UNITS[dim_to][dst]
        scaled = base / to_factor
        result = scaled - to_offset
        if abs(result) <= 1e-12 * max(abs(scaled), abs(to_offset)):  # cancellation: only rounding error is left
            result = 0.0
        return format_number(result, self.options.precision)


def build_units(options: UnitsOptions | None, ctx: object) -> Units:
    return Units(options or UnitsOptions())
